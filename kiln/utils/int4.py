"""How int4 weights are stored wherever they are (checkpoints, engines, kernels): two 4-bit levels to a byte,
the even column in the low nibble."""
from __future__ import annotations

import torch


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(out, in) values in [0, 15] → (out, in/2) bytes, even columns in the low nibble."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(out, in/2) bytes → (out, in) values in [0, 15]."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)
