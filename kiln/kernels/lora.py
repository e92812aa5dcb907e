"""The LoRA adapters of the linear layers, stacked by device slot, as the batched LoRA products read them.

A layer's output may be several projections side by side (q|k|v, gate|up): `bounds` are their first rows and the
end, part p writing rows bounds[p]:bounds[p + 1]. For each slot s and part p a layer's LoraStack holds
    a[s, p·R:(p + 1)·R]   A (r, in) of the part, zero-padded to R rows (R: the engine's rank width)
    b[s, bounds[p]:bounds[p + 1], :R]   B (rows, r), zero-padded to R columns
    scale[s, p]   lora_alpha / r (rsLoRA: / √r); 0 where the adapter leaves the part alone.
A LoraSlab holds every layer's stack as views of one (slots, values) and one (slots, scales) buffer, allocated once
at their final addresses (CUDA graphs replay kernels that read them): a slot of all layers is one row of each, so
installing an adapter is two copies of its flat host image (pinned).
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
    """One adapter's slot of every layer of a slab, on the host: what LoraSlab.load copies."""

    values: torch.Tensor   # (values,): each layer's A then B, in the slab's order
    scales: torch.Tensor   # (scales,) float32: each layer's per-projection scales

    def pin(self) -> "LoraImage":
        return LoraImage(self.values.pin_memory(), self.scales.pin_memory())


class LoraStack:
    """`slots` adapter slots of one layer (in_features → out rows split at `bounds`): views of a LoraSlab's rows."""

    def __init__(self, in_features: int, bounds: tuple[int, ...], max_rank: int, values: torch.Tensor,
                 scales: torch.Tensor):
        """values (slots, ≥ elements()), scales (slots, ≥ parts): the slab's columns from this layer's on."""
        if list(bounds) != sorted(bounds) or bounds[0] != 0 or len(bounds) < 2:
            raise ValueError(f"LoRA part bounds {bounds} must rise from 0")
        self.bounds, self.rank = tuple(bounds), rank_width(max_rank)
        slots, parts = values.shape[0], len(bounds) - 1
        a_size = parts * self.rank * in_features
        self.a = values[:, :a_size].view(slots, parts * self.rank, in_features)
        self.b = values[:, a_size:a_size + bounds[-1] * self.rank].view(slots, bounds[-1], self.rank)
        self.scale = scales[:, :parts]
        self.host_scale = [[0.0] * parts for _ in range(slots)]     # scale, on the host (the CPU products read it)

    @property
    def parts(self) -> int:
        return len(self.bounds) - 1

    @staticmethod
    def elements(in_features: int, bounds: tuple[int, ...], max_rank: int) -> int:
        """Values a slot of a stack holds: its A then its B."""
        return ((len(bounds) - 1) * in_features + bounds[-1]) * rank_width(max_rank)

    def filled(self, slot: int) -> bool:
        """Whether `slot` holds an adapter with a part on this layer."""
        return any(self.host_scale[slot])

    def write_image(self, parts: list, values: torch.Tensor, scales: torch.Tensor) -> None:
        """Write an adapter's parts on this layer (kiln.checkpoint.lora.LoraPart: offset, a, b, scale) into a
        zeroed host image of one slot of this stack (values: A then B, flat; scales: one per projection); a part
        must start at one of the bounds and fit its rows and the rank width."""
        a, b = values[:self.a[0].numel()].view(self.a.shape[1:]), values[self.a[0].numel():].view(self.b.shape[1:])
        for part in parts:
            if part.offset not in self.bounds[:-1]:
                raise ValueError(f"a LoRA part at output row {part.offset} starts no projection of this layer "
                                 f"(projections start at {self.bounds[:-1]})")
            p = self.bounds.index(part.offset)
            rank, rows = part.a.shape[0], self.bounds[p + 1] - part.offset
            if tuple(part.b.shape) != (rows, rank) or part.a.shape[1] != a.shape[1] or rank > self.rank:
                raise ValueError(f"a LoRA part of shapes A {tuple(part.a.shape)}, B {tuple(part.b.shape)} does not "
                                 f"fit projection {p} of this layer ({rows} rows, {a.shape[1]} inputs, rank up to "
                                 f"{self.rank})")
            a[p * self.rank:p * self.rank + rank] = part.a
            b[part.offset:part.offset + rows, :rank] = part.b
            scales[p] = part.scale


class LoraSlab:
    """The LoraStacks of several layers (name → (in_features, bounds)) as views of one (slots, values) buffer and
    one (slots, scales) buffer: every layer's share of a slot lies in one row of each."""

    def __init__(self, geometries: dict[str, tuple[int, tuple[int, ...]]], slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.geometries, self.dtype = geometries, dtype
        self.at: dict[str, tuple[int, int]] = {}                   # name → (first value, first scale)
        values = scales = 0
        for name, (in_features, bounds) in geometries.items():
            self.at[name] = values, scales
            values += LoraStack.elements(in_features, bounds, max_rank)
            scales += len(bounds) - 1
        self.values = torch.zeros((slots, values), dtype=dtype, device=device)
        self.scales = torch.zeros((slots, scales), dtype=torch.float32, device=device)
        self.stacks = {name: LoraStack(in_features, bounds, max_rank, self.values[:, self.at[name][0]:],
                                       self.scales[:, self.at[name][1]:])
                       for name, (in_features, bounds) in geometries.items()}

    def image(self, modules: dict[str, list]) -> LoraImage:
        """An adapter's flat host image from its parts per layer name (layers of no stack are refused); layers
        it leaves alone are zero."""
        unknown = sorted(set(modules) - set(self.geometries))
        if unknown:
            raise ValueError(f"LoRA adapter parts on {unknown[0]}, which has no adapter slots in this engine")
        image = LoraImage(torch.zeros(self.values.shape[1], dtype=self.dtype),
                          torch.zeros(self.scales.shape[1], dtype=torch.float32))
        for name, parts in modules.items():
            stack, (first, scale_at) = self.stacks[name], self.at[name]
            size = stack.a[0].numel() + stack.b[0].numel()
            stack.write_image(parts, image.values[first:first + size], image.scales[scale_at:scale_at + stack.parts])
        return image

    def load(self, slot: int, image: LoraImage) -> None:
        """Put an adapter's image (image()) into `slot` of every layer: two copies."""
        self.values[slot].copy_(image.values, non_blocking=True)
        self.scales[slot].copy_(image.scales, non_blocking=True)
        host = image.scales.tolist()
        for name, stack in self.stacks.items():
            stack.host_scale[slot] = host[self.at[name][1]:self.at[name][1] + stack.parts]
