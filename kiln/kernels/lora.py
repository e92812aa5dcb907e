"""The LoRA adapters of one linear layer, stacked by device slot, as the batched LoRA products read them.

A layer's output may be several projections side by side (q|k|v, gate|up): `bounds` are their first rows and the
end, part p writing rows bounds[p]:bounds[p + 1]. For each slot s and part p the stack holds
    a[s, p·R:(p + 1)·R]   A (r, in) of the part, zero-padded to R rows (R: the engine's rank width)
    b[s, bounds[p]:bounds[p + 1], :R]   B (rows, r), zero-padded to R columns
    scale[s, p]   lora_alpha / r (rsLoRA: / √r); 0 where the adapter leaves the part alone.
The tensors are allocated once, at their final addresses (CUDA graphs replay kernels that read them); installing an
adapter copies its image (LoraImage, made on the host) into a slot.
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
                 device: torch.device | str):
        if list(bounds) != sorted(bounds) or bounds[0] != 0 or len(bounds) < 2:
            raise ValueError(f"LoRA part bounds {bounds} must rise from 0")
        self.bounds, self.rank = tuple(bounds), rank_width(max_rank)
        parts = len(bounds) - 1
        self.a = torch.zeros((slots, parts * self.rank, in_features), dtype=dtype, device=device)
        self.b = torch.zeros((slots, bounds[-1], self.rank), dtype=dtype, device=device)
        self.scale = torch.zeros((slots, parts), dtype=torch.float32, device=device)
        self.host_scale = [[0.0] * parts for _ in range(slots)]     # scale, on the host (the CPU products read it)

    @property
    def parts(self) -> int:
        return len(self.bounds) - 1

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
