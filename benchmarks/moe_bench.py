"""The fused MoE layer (kiln/kernels/triton/fused_moe.py) on Mixtral-8x7B's shapes (hidden 4096, intermediate 14336,
8 experts, top-2), one GPU: per expert format and token count, GPU µs per layer (CUDA-graph replays, the whole
launch sequence from the router's logits to the summed output), TB/s of the routed experts' bytes (weights, scales
and zero points of every expert that gets a token, read once) and TFLOP/s (2·T·k·3·H·I).

    python benchmarks/moe_bench.py [--tokens 1,16,128,1024,4096] [--formats bf16,fp8,int4] [--check] [--sweep]
                                   [--backends triton,grouped] [--tma off|on|both]

Needs Kiln installed (`pip install -e .`) and a CUDA GPU.

Formats: bf16, fp8 (e4m3 weights per channel, activations per token), fp8_static (one calibrated scale per
projection), int8 (W8A16), int4 (W4A16 AWQ: groups of 128 with zero points), int4_sym (W4A16 GPTQ layout: groups
of 128, no zero points). --check compares each layer with the reference loop on its first 64 tokens. --sweep times
each (format, token count) under every tile choice of `candidates` too and prints the fastest beside the table's
(the per-format tables MOE_CONFIGS, MOE_FLOAT_CONFIGS, MOE_FP8_CONFIGS in kiln/kernels/triton/tuning.py).
--backends: the experts' products on Kiln's Triton kernels ("triton") and on torch's grouped GEMMs ("grouped",
CUTLASS: bf16 and fp8 only), each row of the table once per backend.
"""
from __future__ import annotations

import argparse

import torch

from kiln import benchmark as bench
from kiln.config import QuantConfig
from kiln.kernels import quant, reference
from kiln.kernels.triton.fused_moe import expert_weights, fused_moe, grouped_mm_refusal, moe_config
from kiln.kernels.triton.tuning import MoeConfig, MoeTile
from kiln.quantization import round_experts

HIDDEN, INTER, EXPERTS, TOP_K = 4096, 14336, 8, 2
FORMATS = {"bf16": None, "fp8": "FP8_PER_CHANNEL_PER_TOKEN", "fp8_static": "FP8", "int8": "W8A16",
           "int4": "W4A16_AWQ", "int4_sym": "W4A16_GPTQ"}


def experts(algo: str | None, w: torch.Tensor, input_scale: float):
    if algo is None:
        return w
    out = round_experts(w, QuantConfig(algo, group_size=128))
    if algo == "FP8":
        out["input_scale"] = torch.tensor([input_scale], device=w.device)
    return out


def routed_bytes(x: torch.Tensor, router: torch.Tensor, projections) -> int:
    """Bytes of the experts that at least one token of x is routed to (every tensor of both projections)."""
    _, chosen = reference.route(x, router, TOP_K, True)
    used = chosen.unique().tolist()
    total = 0
    for w in projections:
        tensors = w.values() if isinstance(w, dict) else [w]
        total += sum(t[0].numel() * t.element_size() * len(used) for t in tensors if t.dim() > 1)
    return total


def check(x, router, gate_up, down, algo, grouped: bool = False, config: MoeConfig | None = None) -> float:
    """Relative error of the fused layer (on `config`'s tiles where given) against the reference loop
    (kiln.kernels.reference.moe, the CPU path) on its first 64 tokens (tests/kernels/test_fused_moe.py holds both
    to a float64 oracle)."""
    x = x[:64]
    out = fused_moe(x, router, gate_up, down, TOP_K, True, 0, algo, grouped_mm=grouped, config=config).double()
    ref = reference.moe(x, router, gate_up, down, TOP_K, True, 0, algo).double()
    return ((out - ref).norm() / ref.norm()).item()


def candidates(tokens: int, tma: str = "both") -> list[MoeConfig]:
    """Tile choices to time at `tokens`: row blocks near the rows an expert gets, tiles from narrow (few rows:
    many programs streaming weights) to wide (many rows: operand reuse); from 64-row blocks on each also with its
    operands read by the TMA engine (tma: "off", "on" (those alone) or "both")."""
    rows = tokens * TOP_K / EXPERTS
    block_ms = [m for m in (16, 32, 64, 128) if m <= max(16, 2 * rows)][-3:]
    tiles = [MoeTile(32, 128, 4, 4), MoeTile(64, 128, 4, 4), MoeTile(64, 64, 4, 4, 8), MoeTile(128, 64, 4, 4, 8),
             MoeTile(128, 64, 8, 3, 8), MoeTile(128, 128, 8, 3, 8), MoeTile(256, 64, 8, 3, 8)]
    if rows < 16:
        tiles = tiles[:3] + [MoeTile(16, 256, 4, 4), MoeTile(32, 256, 4, 3), MoeTile(64, 256, 4, 3)]
    elif rows >= 64:
        tiles += [MoeTile(128, 128, 8, 4, 8), MoeTile(256, 128, 8, 3, 8), MoeTile(128, 128, 8, 3, 16)]
    modes = {"off": (False,), "on": (True,), "both": (False, True)}[tma]
    return [MoeConfig(m, tile, tile, on) for m in block_ms for tile in tiles for on in modes if m >= 64 or not on]


def sweep(name: str, t: int, x, router, weights, algo, tma: str = "both") -> None:
    """The fastest of `candidates` against the table's choice (a candidate that fails to compile is skipped), each
    with its relative error against the reference loop."""
    timed = []
    for config in candidates(t, tma):
        try:
            timed.append((bench.graph_seconds([lambda: fused_moe(x, router, *weights, TOP_K, True, 0, algo,
                                                                  config=config)] * 4), config))
        except Exception as err:  # noqa: BLE001 - e.g. out of shared memory: not a choice
            print(f"    skipped {config}: {type(err).__name__}", flush=True)
    table = bench.graph_seconds([lambda: fused_moe(x, router, *weights, TOP_K, True, 0, algo)] * 4)
    for seconds, config in sorted(timed, key=lambda c: c[0])[:3]:
        error = check(x, router, *weights, algo, config=config)
        print(f"    {name} {t}: {seconds * 1e6:.1f} µs ({table / seconds:.2f}x the table's, rel.err {error:.1e}) "
              f"{config}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,16,128,1024,4096")
    parser.add_argument("--formats", default="bf16,fp8,int4")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="time the tile candidates too")
    parser.add_argument("--backends", default="triton", help="triton and/or grouped (torch's grouped GEMMs)")
    parser.add_argument("--tma", default="both", choices=("off", "on", "both"),
                        help="--sweep's candidates without, with, or with and without TMA operand reads")
    args = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    hw = bench.Hardware.measure(torch.device("cuda"))
    print(f"{hw.name}: copy {hw.copy_bytes_per_s / 1e12:.2f} TB/s, bf16 GEMM {hw.gemm_flops / 1e12:.0f} TFLOP/s")
    router = torch.randn(EXPERTS, HIDDEN, generator=g, device="cuda").bfloat16() / HIDDEN ** 0.5
    gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g, device="cuda") / HIDDEN ** 0.5).bfloat16()
    down = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g, device="cuda") / INTER ** 0.5).bfloat16()
    tokens = [int(t) for t in args.tokens.split(",")]
    x_all = torch.randn(max(tokens), HIDDEN, generator=g, device="cuda").bfloat16()
    print(f"{'format':>10} {'backend':>7} {'tokens':>6} {'block_m':>7} {'µs':>9} {'TB/s':>6} {'TFLOP/s':>8}" +
          (f" {'rel.err':>8}" if args.check else ""))
    for name in args.formats.split(","):
        algo = FORMATS[name]
        weights = (experts(algo, gate_up, 5.0 / quant.FP8_MAX), experts(algo, down, 2.0 / quant.FP8_MAX))
        for t in tokens:
            x = x_all[:t]
            for backend in args.backends.split(","):
                grouped = backend == "grouped"
                if grouped and grouped_mm_refusal(x, *(expert_weights(w, algo) for w in weights)) is not None:
                    continue
                seconds = bench.graph_seconds([lambda: fused_moe(x, router, *weights, TOP_K, True, 0, algo,
                                                                 grouped_mm=grouped)] * 4)
                flops = 2 * t * TOP_K * 3 * HIDDEN * INTER
                block_m = moe_config(t, TOP_K, EXPERTS, expert_weights(weights[0], algo).format).block_m
                line = (f"{name:>10} {backend:>7} {t:>6} {block_m:>7} {seconds * 1e6:>9.1f} "
                        f"{routed_bytes(x, router, weights) / seconds / 1e12:>6.2f} {flops / seconds / 1e12:>8.1f}")
                print(line + (f" {check(x, router, *weights, algo, grouped):>8.1e}" if args.check else ""), flush=True)
            if args.sweep:
                sweep(name, t, x, router, weights, algo, args.tma)
        weights = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
