"""The LoRA adapters of one linear layer, stacked by device slot, as the batched LoRA products read them.

A layer's output may be several projections side by side (q|k|v, gate|up): `bounds` are their first rows and the
end, part p writing rows bounds[p]:bounds[p + 1]. For each slot s and part p the stack holds
    a[s, p·R:(p + 1)·R]   A (r, in) of the part, zero-padded to R rows (R: the engine's rank width)
    b[s, bounds[p]:bounds[p + 1], :R]   B (rows, r), zero-padded to R columns
    scale[s, p]   lora_alpha / r (rsLoRA: / √r); 0 where the adapter leaves the part alone.
The tensors are allocated once, at their final addresses (CUDA graphs replay kernels that read them). A LoraSlab
holds the stacks of every layer as views of one buffer, so that a slot of all layers is one contiguous region:
installing an adapter is two copies of its flat host image (pinned), not three per layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def rank_width(max_rank: int) -> int:
    """R: the slots' rank dimension for adapters of rank up to max_rank (a power of two, at least 16, so the GPU's
    matrix instructions take it whole)."""
    return max(16, 1 << (max_rank - 1).bit_length())


@dataclass
class LoraImage:
    """One adapter's slot of one layer, on the host: what LoraStack.load copies."""

    a: torch.Tensor        # (P·R, in)
    b: torch.Tensor        # (out, R)
    scale: torch.Tensor    # (P,) float32

    def pin(self) -> "LoraImage":
        return LoraImage(self.a.pin_memory(), self.b.pin_memory(), self.scale.pin_memory())


def lora_image(parts: list, in_features: int, bounds: tuple[int, ...], max_rank: int, dtype: torch.dtype) -> LoraImage:
    """The host image of an adapter's parts on a layer of `in_features` and projections at `bounds`
    (kiln.checkpoint.lora.LoraPart: offset, a, b, scale); a part must start at one of the bounds and fit its rows
    and the rank width."""
    rank_pad, count = rank_width(max_rank), len(bounds) - 1
    a = torch.zeros((count * rank_pad, in_features), dtype=dtype)
    b = torch.zeros((bounds[-1], rank_pad), dtype=dtype)
    scale = torch.zeros(count, dtype=torch.float32)
    for part in parts:
        if part.offset not in bounds[:-1]:
            raise ValueError(f"a LoRA part at output row {part.offset} starts no projection of this layer "
                             f"(projections start at {bounds[:-1]})")
        p = bounds.index(part.offset)
        rank, rows = part.a.shape[0], bounds[p + 1] - part.offset
        if tuple(part.b.shape) != (rows, rank) or part.a.shape[1] != in_features or rank > rank_pad:
            raise ValueError(f"a LoRA part of shapes A {tuple(part.a.shape)}, B {tuple(part.b.shape)} does not fit "
                             f"projection {p} of this layer ({rows} rows, {in_features} inputs, rank up to "
                             f"{rank_pad})")
        a[p * rank_pad:p * rank_pad + rank] = part.a
        b[part.offset:part.offset + rows, :rank] = part.b
        scale[p] = part.scale
    return LoraImage(a, b, scale)


class LoraStack:
    """`slots` adapter slots of one layer (in_features → out rows split at `bounds`)."""

    def __init__(self, in_features: int, bounds: tuple[int, ...], slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device | str, storage: tuple[torch.Tensor, torch.Tensor] | None = None):
        """storage: (values (slots, ≥ elements()), scales (slots, ≥ parts)) to view instead of allocating."""
        if list(bounds) != sorted(bounds) or bounds[0] != 0 or len(bounds) < 2:
            raise ValueError(f"LoRA part bounds {bounds} must rise from 0")
        self.bounds, self.rank = tuple(bounds), rank_width(max_rank)
        parts = len(bounds) - 1
        a_size, b_size = parts * self.rank * in_features, bounds[-1] * self.rank
        values, scales = storage or (torch.zeros((slots, a_size + b_size), dtype=dtype, device=device),
                                     torch.zeros((slots, parts), dtype=torch.float32, device=device))
        self.a = values[:, :a_size].view(slots, parts * self.rank, in_features)
        self.b = values[:, a_size:a_size + b_size].view(slots, bounds[-1], self.rank)
        self.scale = scales[:, :parts]
        self.host_scale = [[0.0] * parts for _ in range(slots)]     # scale, on the host (the CPU products read it)

    @property
    def parts(self) -> int:
        return len(self.bounds) - 1

    @staticmethod
    def elements(in_features: int, bounds: tuple[int, ...], max_rank: int) -> int:
        """Values a slot of a stack holds: its A then its B."""
        return (len(bounds) - 1) * rank_width(max_rank) * in_features + bounds[-1] * rank_width(max_rank)

    def filled(self, slot: int) -> bool:
        """Whether `slot` holds an adapter with a part on this layer."""
        return any(self.host_scale[slot])

    def image(self, parts: list) -> LoraImage:
        """The host image of an adapter's parts on this layer (lora_image)."""
        return lora_image(parts, self.a.shape[2], self.bounds, self.rank, self.a.dtype)

    def load(self, slot: int, image: LoraImage | None) -> None:
        """Put an adapter's image into `slot` (None: the adapter leaves this layer alone; the slot is cleared)."""
        if image is None:
            if self.filled(slot):
                for t in (self.a, self.b, self.scale):
                    t[slot].zero_()
            self.host_scale[slot] = [0.0] * self.parts
            return
        self.a[slot].copy_(image.a, non_blocking=True)
        self.b[slot].copy_(image.b, non_blocking=True)
        self.scale[slot].copy_(image.scale, non_blocking=True)
        self.host_scale[slot] = image.scale.tolist()


class LoraSlab:
    """The LoraStacks of several layers (name → (in_features, bounds)) as views of one (slots, values) buffer and
    one (slots, scales) buffer: every layer's share of a slot lies in one row of each."""

    def __init__(self, geometries: dict[str, tuple[int, tuple[int, ...]]], slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.geometries, self.max_rank, self.dtype = geometries, max_rank, dtype
        self.at: dict[str, tuple[int, int]] = {}                   # name → (first value, first scale)
        values = scales = 0
        for name, (in_features, bounds) in geometries.items():
            self.at[name] = values, scales
            values += LoraStack.elements(in_features, bounds, max_rank)
            scales += len(bounds) - 1
        self.values = torch.zeros((slots, values), dtype=dtype, device=device)
        self.scales = torch.zeros((slots, scales), dtype=torch.float32, device=device)
        self.stacks = {name: LoraStack(in_features, bounds, slots, max_rank, dtype, device,
                                       (self.values[:, self.at[name][0]:], self.scales[:, self.at[name][1]:]))
                       for name, (in_features, bounds) in geometries.items()}

    def image(self, modules: dict[str, list]) -> LoraImage:
        """An adapter's flat host image (its parts per layer name; layers of no stack are refused): `a` holds every
        layer's values, `b` is empty, `scale` every layer's scales."""
        unknown = sorted(set(modules) - set(self.geometries))
        if unknown:
            raise ValueError(f"LoRA adapter parts on {unknown[0]}, which has no adapter slots in this engine")
        values = torch.zeros(self.values.shape[1], dtype=self.dtype)
        scales = torch.zeros(self.scales.shape[1], dtype=torch.float32)
        for name, parts in modules.items():
            in_features, bounds = self.geometries[name]
            image = lora_image(parts, in_features, bounds, self.max_rank, self.dtype)
            first, scale_at = self.at[name]
            values[first:first + image.a.numel()] = image.a.flatten()
            values[first + image.a.numel():first + image.a.numel() + image.b.numel()] = image.b.flatten()
            scales[scale_at:scale_at + image.scale.numel()] = image.scale
        return LoraImage(values, values[:0], scales)

    def load(self, slot: int, image: LoraImage) -> None:
        """Put an adapter's flat image (image()) into `slot` of every layer: two copies."""
        self.values[slot].copy_(image.a, non_blocking=True)
        self.scales[slot].copy_(image.scale, non_blocking=True)
        host = image.scale.tolist()
        for name, stack in self.stacks.items():
            stack.host_scale[slot] = host[self.at[name][1]:self.at[name][1] + stack.parts]

