"""Weight-only products of more rows than the decode GEMV takes, on the Llama-3.1-8B shapes, one GPU: the
tensor-core kernel (weight_only.tiled_matmul, a sweep of tile configurations, the best reported), dequantize
+ cuBLAS, and cuBLAS bf16 on a float weight; the summary says which configuration to keep per row count and from
which rows dequantize + cuBLAS wins (the kernel module's tile table and DEQUANTIZE_MIN_ROWS come from it).
Every variant is checked against a float64 product of the dequantized weight. Prints one table; JSON to
$OUT/weight_only_gemm.json (OUT defaults to /tmp).

    python benchmarks/weight_only_gemm.py [--quick] [--rows 8,128] [--shapes o,down] [--formats W8A16]

Needs Kiln installed (`pip install -e .`) and a CUDA GPU.
(`TRITON_INTERPRET=1 python benchmarks/weight_only_gemm.py --dry_run` runs the whole script on the CPU on a tiny
shape, wall-clock times meaning nothing: a check of the script itself.)

Times are GPU µs per product from CUDA graphs over enough weight copies that L2 holds none. The sweep's kernels
are compiled first by --compile_workers processes in parallel (Triton's disk cache then serves this one).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
import traceback

import torch

from kiln import benchmark as bench
from kiln.kernels import quant
from kiln.kernels.triton import tuning
from kiln.kernels.triton import weight_only as wo
from kiln.kernels.triton.gemv import interleave_weight

OUT = os.environ.get("OUT", "/tmp")
DEVICE = "cuda"
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = [8, 16, 32, 64, 128, 512, 2048]
FORMATS = {"W4A16_g128_zero": (4, 128, True), "W8A16": (8, None, False)}   # bits, group, zero points
TOLERANCE = 1e-2                                                        # relative (Frobenius) error, bf16 x
UNPACK_NAMES = {tuning.GATHER: "gather", tuning.PLANES: "planes", tuning.RESHAPE: "reshape",
                tuning.RESHAPE_INNER: "inner"}


def sweep(m: int, bits: int, quick: bool) -> list[tuning.MmaConfig]:
    """Tile configurations tried at m rows (quick: the module's own choice only)."""
    if quick:
        return [wo.mma_config(m, bits)]
    block_ms = [min(128, max(16, 1 << (m - 1).bit_length()))]
    if m >= 128:
        block_ms.append(64)
    configs = []
    for block_m in block_ms:
        for block_n in (64, 128):
            for unpack in UNPACK_NAMES:
                configs.append(tuning.MmaConfig(block_n=block_n, block_m=block_m, unpack=unpack))
                if block_m >= 64 and block_n == 128:
                    configs.append(tuning.MmaConfig(block_n=block_n, block_m=block_m, unpack=unpack, num_warps=8))
        if m <= 64:                                 # memory-bound: fewer programs, more loads in flight
            configs += [tuning.MmaConfig(block_n=64, block_m=block_m, unpack=u, split=1) for u in UNPACK_NAMES]
            configs += [tuning.MmaConfig(block_n=n, block_m=block_m, unpack=u, num_stages=5) for n in (64, 128)
                        for u in UNPACK_NAMES]
    return configs


def describe(config: tuning.MmaConfig) -> str:
    return (f"n{config.block_n}m{config.block_m}k{config.block_k}/{UNPACK_NAMES[config.unpack]}"
            f"/s{config.split or 'auto'}/w{config.num_warps}/st{config.num_stages}")


# --- inputs ------------------------------------------------------------------------------------------------------
def quantized_weights(n: int, k: int, bits: int, group: int | None, zero: bool, copies: int):
    """`copies` random interleaved weights with float32 scales (and zero points): [(weight, scale, zero)]."""
    groups = k // group if group else 1
    out = []
    for _ in range(copies):
        w = torch.randint(-128, 128, (n, k * bits // 8), device=DEVICE, dtype=torch.int8)
        w = w.view(torch.uint8) if bits == 4 else w.clamp_(-127, 127)
        scale = torch.rand((n, groups), device=DEVICE) * 2e-2 / (8 if bits == 4 else 127) + 1e-4
        zeros = torch.rand((n, groups), device=DEVICE) * 15 if zero else None
        out.append((w, scale if bits == 4 else scale.reshape(n), zeros))
    return out


def reference_matrix(weight, scale, zero, bits) -> torch.Tensor:
    """float64 (N, K) matrix of an interleaved weight."""
    engine = interleave_weight(weight, bits, inverse=True)
    params = {"weight": engine, "weight_scale": scale, **({"weight_zero": zero} if zero is not None else {})}
    return quant.dequantize_weight("W8A16" if bits == 8 else "W4A16", params).double()


def copies_for(nbytes: int) -> int:
    return max(2, -(-(512 << 20) // nbytes))                    # ≥ 512 MB per graph: 8× the L2


# --- timing ------------------------------------------------------------------------------------------------------
def graph_seconds(launches) -> float:
    """GPU seconds per launch (kiln.benchmark.graph_seconds). On the CPU (--dry_run): wall-clock seconds of one
    pass."""
    if DEVICE == "cpu":
        start = time.perf_counter()
        for launch in launches:
            launch()
        return (time.perf_counter() - start) / len(launches)
    return bench.graph_seconds(launches)


def measure(name, fn, weights, x, ref) -> dict:
    """{'us', 'err'} of fn(x, weight, scale, zero) over the weight copies, or {'error'}; checked on copy 0."""
    try:
        err = ((fn(x, *weights[0]).double() - ref).norm() / ref.norm()).item()
        us = graph_seconds([lambda w=w: fn(x, *w) for w in weights]) * 1e6
        return {"variant": name, "us": round(us, 2), "err": float(f"{err:.2e}"), "ok": err < TOLERANCE}
    except Exception as exc:  # noqa: BLE001 - one failing variant must not stop the others
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        return {"variant": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}",
                "trace": traceback.format_exc()[-1200:]}


# --- compiling in parallel ---------------------------------------------------------------------------------------
def compile_share(args, worker: int, workers: int) -> None:
    """Compile and check (format, config) pairs worker, worker + workers, ... on a small matrix with the 8B shapes'
    integer properties (K 4096, rows a multiple of 16), so that the disk cache then serves the real shapes; one
    JSON line per pair on stdout: null or the error (the main process skips those: a crash there would end it)."""
    pairs = sorted({(f, c) for f in args.formats for m in args.rows for c in sweep(m, FORMATS[f][0], args.quick)},
                   key=lambda p: (p[0], describe(p[1])))
    for fmt, config in pairs[worker::workers]:
        bits, group, zero = FORMATS[fmt]
        try:
            weights = quantized_weights(256, 4096, bits, group, zero, 1)
            x = torch.randn((max(5, config.block_m - 3), 4096), device=DEVICE, dtype=X_DTYPE[DEVICE])
            ref = x.double() @ reference_matrix(*weights[0], bits).T
            error = None
            for split in {1, config.split or 2}:                # float32 partial sums or x's dtype out: 2 kernels
                out = wo.tiled_matmul(x, *weights[0], bits, True, dataclasses.replace(config, split=split))
                err = ((out.double() - ref).norm() / ref.norm()).item()
                error = error or (None if err < TOLERANCE else f"relative error {err:.2e} (split {split})")
        except Exception as exc:  # noqa: BLE001
            error = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(json.dumps([fmt, describe(config), error]), flush=True)


def compile_in_parallel(args) -> dict:
    """(format, config) → error of each pair that failed in a compiling process."""
    start = time.time()
    argv = [sys.executable, os.path.abspath(__file__), "--rows", ",".join(map(str, args.rows)),
            "--formats", ",".join(args.formats)] + (["--quick"] if args.quick else [])
    procs = [subprocess.Popen(argv + ["--compile_share", f"{i}/{args.compile_workers}"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(args.compile_workers)]
    failed = {}
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        if proc.returncode:
            print("compile worker failed:", err[-800:], flush=True)
        for line in out.splitlines():
            if line.startswith("["):
                fmt, config, error = json.loads(line)
                if error:
                    failed[fmt, config] = error
    print(f"compiled and checked the sweep in {time.time() - start:.1f} s ({args.compile_workers} processes); "
          f"{len(failed)} failed", flush=True)
    return failed


# --- the run -----------------------------------------------------------------------------------------------------
def run_shape(args, fmt: str, shape: str, bf16_cache: dict, failed: dict) -> list[dict]:
    bits, group, zero = FORMATS[fmt]
    n, k = SHAPES[shape]
    row_bytes = k * bits // 8 + (k // group if group else 1) * 4 * (2 if zero else 1)
    weights = quantized_weights(n, k, bits, group, zero, copies_for(n * row_bytes))
    matrix = reference_matrix(*weights[0], bits)
    records = []
    for m in args.rows:
        x = torch.randn((m, k), device=DEVICE, dtype=X_DTYPE[DEVICE])
        ref = x.double() @ matrix.T
        found = []
        found.append(measure("dequant+cublas", lambda x, w, s, z: wo.dequantized_matmul(x, w, s, z, bits, True),
                             weights, x, ref))
        found.append(_dequant_only(weights, bits, k, x))
        for config in sweep(m, bits, args.quick):
            if (fmt, describe(config)) in failed:           # failed before: not tried again
                record = {"variant": "tiled", "error": "skipped: " + failed[fmt, describe(config)]}
            else:
                record = measure("tiled", lambda x, w, s, z, c=config: wo.tiled_matmul(x, w, s, z, bits, True, c),
                                 weights, x, ref)
                if "error" in record:
                    failed[fmt, describe(config)] = record["error"]
            records.append({**record, "config": describe(config), "format": fmt, "shape": shape, "n": n, "k": k,
                            "m": m})
        if (shape, m) not in bf16_cache:
            dense = [torch.randn((n, k), device=DEVICE, dtype=x.dtype) for _ in range(copies_for(n * k * 2))]
            bf16_cache[shape, m] = measure("cublas_bf16", lambda x, w: torch.nn.functional.linear(x, w),
                                           [(w,) for w in dense], x, x.double() @ dense[0].double().T)
            del dense
        found.append(bf16_cache[shape, m])
        records += [{**r, "format": fmt, "shape": shape, "n": n, "k": k, "m": m} for r in found]
        print_line(records, fmt, shape, m)
        del x, ref
    del weights, matrix
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return records


def _dequant_only(weights, bits, k, x) -> dict:
    """Time of the dequantize kernel alone (its output is checked by the dequant+cublas variant)."""
    try:
        us = graph_seconds([lambda w=w: wo.dequantize(w[0], w[1], w[2], bits, k, True, x.dtype) for w in weights])
        return {"variant": "dequant_only", "us": round(us * 1e6, 2), "ok": True}
    except Exception as exc:  # noqa: BLE001
        return {"variant": "dequant_only", "error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def best_tiled(records, fmt, shape, m) -> dict | None:
    ok = [r for r in records if r["variant"] == "tiled" and r.get("ok") and (r["format"], r["shape"], r["m"]) ==
          (fmt, shape, m)]
    return min(ok, key=lambda r: r["us"]) if ok else None


def cell(records, fmt, shape, m, variant) -> str:
    r = next((r for r in records if r["variant"] == variant and (r["shape"], r["m"]) == (shape, m) and
              (r["format"] == fmt or variant == "cublas_bf16")), None)
    if r is None:
        return "-"
    if "error" in r:
        return "ERROR"
    return f"{r['us']:.1f}" + ("" if r.get("ok", True) else "!")


def print_line(records, fmt, shape, m) -> None:
    best = best_tiled(records, fmt, shape, m)
    failed = [r for r in records if r["variant"] == "tiled" and (r["format"], r["shape"], r["m"]) == (fmt, shape, m)
              and not r.get("ok")]
    tiled = f"{best['us']:.1f} {best['config']} err {best['err']:.0e}" if best else "none ok"
    print(f"{fmt:16s} {shape:8s} {m:5d} | tiled {tiled:44s} | "
          f"deq+cublas {cell(records, fmt, shape, m, 'dequant+cublas'):>7s} (deq "
          f"{cell(records, fmt, shape, m, 'dequant_only')}) | bf16 {cell(records, fmt, shape, m, 'cublas_bf16'):>7s}"
          + (f" | {len(failed)} tiled configs failed" if failed else ""), flush=True)


def summarize(records, args) -> dict:
    """Per format and rows: the config fastest summed over the shapes, and the first rows from which dequantize +
    cuBLAS beats the best tiled config on every shape (DEQUANTIZE_MIN_ROWS)."""
    summary = {}
    for fmt in args.formats:
        per_rows = {}
        for m in args.rows:
            totals = {}
            for r in records:
                if r["variant"] == "tiled" and (r["format"], r["m"]) == (fmt, m):
                    totals.setdefault(r["config"], []).append(r["us"] if r.get("ok") else float("inf"))
            complete = {c: sum(t) for c, t in totals.items() if len(t) == len(args.shapes)}
            best = min(complete, key=complete.get) if complete else None
            dequant_wins = all(_us(records, fmt, s, m, "dequant+cublas") < (best_tiled(records, fmt, s, m) or
                                                                            {"us": float("inf")})["us"]
                               for s in args.shapes)
            per_rows[m] = {"best_config_over_shapes": best, "total_us": complete.get(best),
                           "dequant_beats_tiled_on_all_shapes": dequant_wins}
        first = next((m for m in args.rows if all(per_rows[r]["dequant_beats_tiled_on_all_shapes"]
                                                   for r in args.rows if r >= m)), None)
        summary[fmt] = {"rows": per_rows, "suggested_DEQUANTIZE_MIN_ROWS_at_or_below": first}
    return summary


def _us(records, fmt, shape, m, variant) -> float:
    r = next((r for r in records if (r["variant"], r["format"], r["shape"], r["m"]) == (variant, fmt, shape, m)), {})
    return r["us"] if r.get("ok") else float("inf")


# Triton's interpreter gets bf16 products wrong (tests/kernels/test_weight_only_gemm.py), so the dry run uses fp16
X_DTYPE = {"cuda": torch.bfloat16, "cpu": torch.float16}


def dry_run(args) -> None:
    """The script on the CPU: one small shape, two row counts, no compiling processes, a few weight copies."""
    global DEVICE, copies_for
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--dry_run needs TRITON_INTERPRET=1")
    DEVICE = "cpu"
    SHAPES.clear()
    SHAPES["tiny"] = (96, 512)
    args.shapes, args.compile_workers = ["tiny"], 0
    args.rows = [m for m in args.rows if m in (8, 512)] or args.rows
    copies_for = lambda nbytes: 2  # noqa: E731


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--quick", action="store_true", help="only the module's own tile configuration")
    p.add_argument("--compile_workers", type=int, default=min(12, os.cpu_count() or 1))
    p.add_argument("--compile_share", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dry_run", action="store_true", help="on the CPU under TRITON_INTERPRET=1, a tiny shape")
    args = p.parse_args()
    args.rows = [int(m) for m in args.rows.split(",")]
    args.shapes = args.shapes.split(",")
    args.formats = args.formats.split(",")
    if args.dry_run:
        dry_run(args)
    if args.compile_share:
        worker, workers = map(int, args.compile_share.split("/"))
        return compile_share(args, worker, workers)
    import triton
    device = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "CPU (dry run)"
    print(f"{device}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    start = time.time()
    failed = compile_in_parallel(args) if args.compile_workers > 1 else {}
    records, bf16_cache = [], {}
    for fmt in args.formats:
        for shape in args.shapes:
            try:
                records += run_shape(args, fmt, shape, bf16_cache, failed)
            except Exception:  # noqa: BLE001
                print(f"{fmt} {shape} failed:\n{traceback.format_exc()[-2000:]}", flush=True)
    summary = summarize(records, args)
    print(json.dumps(summary, indent=1))
    errors = sorted({(r["variant"], r.get("config"), r["error"]) for r in records if "error" in r}, key=str)
    for variant, config, error in errors[:20]:
        print("error:", variant, config or "", error)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "weight_only_gemm.json"), "w") as f:
        json.dump({"records": records, "summary": summary, "seconds": round(time.time() - start, 1)}, f, indent=1)
    print(f"done in {time.time() - start:.0f} s; {os.path.join(OUT, 'weight_only_gemm.json')}")


if __name__ == "__main__":
    main()
