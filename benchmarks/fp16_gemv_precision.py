"""Would an int4 decode GEMV in packed fp16 math be precise enough? (A CPU emulation, no GPU needed.)

The candidate kernel (docs/quantization.md, eighth-session status): x converted to fp16 after a per-token
power-of-two scale, signed levels q - 8 multiplied by x with fma.rn.f16x2 into fp16 partial sums of CHAIN products,
the partials flushed to float32 and scaled per group: s·(Σ x·(q - 8) - (z - 8)·Σ x). Emulated here exactly (each
fp16 FMA: the float32 result of acc + q·x, exact for these widths, rounded once to fp16) on the Llama-3.1-8B GEMV
shapes' K, with x of three kinds (normal; normal with outlier channels up to 1e3; heavy-tailed down_proj-like
inputs up to 3e3), against the float64 product of the same bf16 x and levels. Beside it: the error of the result's
own rounding to bf16 (what every kernel must add) and of the float32 kernel of today.
    python benchmarks/fp16_gemv_precision.py [--rows 256] [--chain 16]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kiln.kernels import quant  # noqa: E402

GROUP = 128


def activations(kind: str, k: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(k, generator=g, dtype=torch.float64)
    if kind == "outliers":                      # a few channels 100-1000× the others, as after RMSNorm in Llama
        idx = torch.randperm(k, generator=g)[:8]
        x[idx] *= torch.logspace(2, 3, 8, dtype=torch.float64)
    elif kind == "heavy":                       # SiLU(gate)·up of a massive-activation layer
        x = x * torch.exp(2.0 * torch.randn(k, generator=g, dtype=torch.float64)).clamp(max=3e3)
    return x.to(torch.bfloat16)


def fp16_chains(levels: torch.Tensor, x16: torch.Tensor, chain: int) -> torch.Tensor:
    """Σ over each chain of `chain` columns of (q - 8)·x in fp16 FMAs: (N, K / chain) partial sums, float32."""
    n, k = levels.shape
    q = (levels.to(torch.float32) - 8).view(n, k // chain, chain)
    xs = x16.to(torch.float32).view(1, k // chain, chain)
    acc = torch.zeros((n, k // chain), dtype=torch.float16)
    for j in range(chain):
        acc = (acc.to(torch.float32) + q[:, :, j] * xs[:, :, j]).to(torch.float16)
    return acc.to(torch.float32)


def candidate(levels, scale, zero, x: torch.Tensor, chain: int, per_token: bool) -> torch.Tensor:
    """The fp16 kernel's result (float32, before the output's rounding)."""
    xf = x.to(torch.float32)
    e = torch.ceil(torch.log2(xf.abs().max())) - 4 if per_token else torch.tensor(0.0)   # max |x'| ≤ 16
    x16 = (xf * torch.exp2(-e)).to(torch.float16)
    parts = fp16_chains(levels, x16, chain).view(levels.shape[0], -1, GROUP // chain).sum(-1)    # (N, G)
    xsum = x16.to(torch.float32).view(-1, GROUP).sum(-1)                                          # (G,)
    return ((scale * (parts - (zero - 8) * xsum)).sum(-1) * torch.exp2(e))


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--chain", type=int, default=16, help="products per fp16 partial sum before the float32 flush")
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    results = {}
    for k in (4096, 14336):
        w = torch.randn((args.rows, k), generator=g) * 0.02
        packed, scale, zero = quant.quantize_int4(w, GROUP, True)
        levels = quant.unpack_int4(packed)
        weight = quant.dequantize_int4(packed, scale, zero).double()
        for kind in ("normal", "outliers", "heavy"):
            x = activations(kind, k, g)
            ref = weight @ x.double()
            today = weight.float() @ x.float()                        # float32 accumulation of the same products
            row = {"bf16 output rounding": rel(ref.to(torch.bfloat16), ref), "float32 kernel": rel(today, ref)}
            for per_token in (True, False):
                out = candidate(levels, scale, zero, x, args.chain, per_token)
                name = "fp16 kernel, per-token scale" if per_token else "fp16 kernel, no scale"
                row[name] = rel(out, ref) if torch.isfinite(out).all() else "overflow"
            results[f"K={k} {kind}"] = {n: (f"{v:.2e}" if isinstance(v, float) else v) for n, v in row.items()}
    print(json.dumps({"rows": args.rows, "chain": args.chain, "relative error against float64": results}, indent=1))


if __name__ == "__main__":
    main()
