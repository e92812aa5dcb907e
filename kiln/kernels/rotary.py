"""Rotary position embedding tables (plain, linear-scaled and Llama 3.1 scaled frequencies)."""
from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    """(head_dim / 2,) float32 inverse frequencies."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["type"] == "linear":
        return inv_freq / factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    old_len = scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(max_positions: int, head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    """(max_positions, head_dim) float32: cos in the first half of each row, sin in the second."""
    inv_freq = rope_inv_freq(head_dim, base, scaling)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # (P, D/2)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)
