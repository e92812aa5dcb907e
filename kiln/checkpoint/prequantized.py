"""Import of already-quantized Hugging Face checkpoints: AutoAWQ (GEMM packing) and AutoGPTQ (desc_act=False),
both 4-bit per group, into Kiln's W4A16 per-group layout (kiln.kernels.quant; packed as kiln.utils.int4).

AWQ: qweight int32 (in, out/8) — eight 4-bit output columns per int, nibble i holding column 8c + [0,2,4,6,1,3,5,7][i];
qzeros int32 (in/g, out/8) packed the same way; scales (in/g, out); w = (q - zero) * scale.
GPTQ: qweight int32 (in/8, out) — eight consecutive input rows per int, nibble i holding row 8r + i; qzeros int32
(in/g, out/8) with consecutive output columns per int, stored as zero - 1; scales (in/g, out).
"""
from __future__ import annotations

import torch

from kiln.config import QuantConfig
from kiln.utils.int4 import pack_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


def quant_config_from_hf(raw: dict) -> QuantConfig | None:
    """QuantConfig of an HF config's `quantization_config` (None when there is none)."""
    q = raw.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method not in ("awq", "gptq"):
        raise ValueError(f"quantized checkpoints of method {method!r} are not supported; Kiln imports awq and gptq")
    if q.get("bits") != 4:
        raise ValueError(f"{method} checkpoints with bits={q.get('bits')} are not supported; Kiln imports 4-bit")
    if method == "awq" and str(q.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"AWQ version {q.get('version')!r} is not supported; Kiln imports the GEMM packing")
    if method == "gptq" and q.get("desc_act"):
        raise ValueError("GPTQ checkpoints with desc_act=true are not supported; requantize with desc_act=false")
    return QuantConfig(quant_algo="W4A16_AWQ" if method == "awq" else "W4A16_GPTQ", group_size=q.get("group_size", 128),
                       has_zero_point=True)


def _unpack_columns(packed: torch.Tensor, order) -> torch.Tensor:
    """int32 (rows, cols/8) → (rows, cols) nibbles, nibble i of int c going to column 8c + order[i]."""
    rows, packs = packed.shape
    out = torch.empty(rows, packs * 8, dtype=torch.uint8)
    for i, column in enumerate(order):
        out[:, column::8] = ((packed >> (4 * i)) & 0xF).to(torch.uint8)
    return out


def _unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 (rows/8, cols) → (rows, cols) nibbles, nibble i of int r going to row 8r + i."""
    packs, cols = packed.shape
    out = torch.empty(packs * 8, cols, dtype=torch.uint8)
    for i in range(8):
        out[i::8] = ((packed >> (4 * i)) & 0xF).to(torch.uint8)
    return out


def convert_layer(tensors: dict[str, torch.Tensor], quant: QuantConfig) -> dict[str, torch.Tensor]:
    """{qweight, qzeros, scales[, g_idx]} of one linear layer → {weight, weight_scale, weight_zero}."""
    qweight, qzeros, scales = (tensors[k].to(torch.int32) if k != "scales" else tensors[k] for k in
                               ("qweight", "qzeros", "scales"))
    if quant.quant_algo == "W4A16_AWQ":
        q = _unpack_columns(qweight, AWQ_ORDER)               # (in, out)
        zeros = _unpack_columns(qzeros, AWQ_ORDER).float()   # (in/g, out)
    else:
        q = _unpack_rows(qweight)                             # (in, out)
        zeros = _unpack_columns(qzeros, range(8)).float() + 1
        if "g_idx" in tensors:
            expected = torch.arange(q.shape[0]) // quant.group_size
            if not torch.equal(tensors["g_idx"].long().cpu(), expected):
                raise ValueError("GPTQ g_idx is not sequential (desc_act reordering); Kiln imports desc_act=false")
    return {"weight": pack_int4(q.t().contiguous()), "weight_scale": scales.float().t().contiguous(),
            "weight_zero": zeros.t().contiguous()}
