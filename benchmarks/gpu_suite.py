"""One GPU run: checks, then times many variants (GPU time is scarce). Prints a table; JSON to $OUT/suite.json.

    python3 benchmarks/gpu_suite.py --phases tests,latency,throughput [--quick]

Phases: env (always), tests (pytest -m gpu), latency (8B bf16 batch 1), throughput (8B bf16, 128/128 and the
long shapes unless --quick), load (build an 8B engine, save it, time load-to-first-token in a fresh process),
quant (quant_kernels, quant_latency, quant_fp8_kernels, quant_fp8_throughput; each can run alone), decode_fusions
(batch-1 decode of W8A16 and W4A16_AWQ with the decode GEMV's fusions off, each alone, all on), attn_sweep,
attn_split, attn_small, attn_fused (decode attention in one kernel against three), decode_doubling (each kernel of
the W4A16 batch-1 step made twice inside the decode graph: its cost where it runs), timeline;
--profile adds torch profiler tables.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import traceback

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kiln.kernels import triton_kernels as tk  # noqa: E402  (the spin kernel calls its PDL wait)

from kiln import LLM, SamplingConfig  # noqa: E402
from kiln import benchmark as bench  # noqa: E402

RESULTS: dict = {}
OUT = os.environ.get("OUT", "/tmp")


def log(key, value):
    RESULTS[key] = value
    with open(os.path.join(OUT, "suite.jsonl"), "a") as f:          # kept if the run is cut short
        f.write(json.dumps({key: value}, default=str) + "\n")
    print(f"{key:48s} {json.dumps(value) if not isinstance(value, str) else value}", flush=True)


def phase(fn):
    def run(args):
        start = time.time()
        try:
            fn(args)
        except Exception:  # noqa: BLE001 - one failing phase must not hide the others
            log(f"{fn.__name__}_error", traceback.format_exc()[-2000:])
        log(f"{fn.__name__}_seconds", round(time.time() - start, 1))
        torch.cuda.empty_cache()
    return run


@phase
def env(args):
    log("gpu", torch.cuda.get_device_name(0))
    log("torch", torch.__version__)
    import triton
    log("triton", triton.__version__)
    hw = bench.Hardware.measure(torch.device("cuda"))
    log("copy_TBps", round(hw.copy_bytes_per_s / 1e12, 2))
    log("gemm_TFLOPs", round(hw.gemm_flops / 1e12, 1))


@phase
def tests(args):
    path = os.path.join(OUT, "gpu_tests.txt")
    with open(path, "w") as f:                     # written as it runs: kept if the tests run out of time
        try:
            rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", *args.test_paths.split(","), "-p",
                                 "no:cacheprovider"], stdout=f, stderr=subprocess.STDOUT,
                                timeout=args.test_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    log("gpu_tests_tail", open(path).read()[-3000:])
    log("gpu_tests_rc", rc)


@phase
def diag(args):
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-m", "gpu", "-p", "no:cacheprovider",
                           "tests/test_gpu.py::test_llama31_8b_shape_logits_match_transformers"],
                          capture_output=True, text=True, timeout=args.test_timeout)
    log("diag_8b_logits", "\n".join(line for line in proc.stdout.splitlines() if "vs" in line or "position" in line
                                   or "passed" in line or "failed" in line))


@phase
def kernels(args):
    """Matrix-vector products of the 8B shapes: cuBLAS against the streaming Triton kernel."""
    import triton.testing
    from kiln.kernels import triton_kernels as tk
    for name, (n, k) in {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                         "lm_head": (128256, 4096)}.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in (1, 2, 4):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cublas = triton.testing.do_bench(lambda: torch.nn.functional.linear(x, w), return_mode="median")
            gemv = triton.testing.do_bench(lambda: tk.linear(x, w), return_mode="median")
            ref = torch.nn.functional.linear(x.float(), w.float())
            err = ((tk.linear(x, w).float() - ref).norm() / ref.norm()).item()
            gbps = lambda ms: n * k * 2 / (ms * 1e-3) / 1e12  # noqa: E731
            log(f"gemv_{name}_m{m}", f"cublas {cublas * 1e3:.1f}us ({gbps(cublas):.2f} TB/s)  triton {gemv * 1e3:.1f}us "
                                     f"({gbps(gemv):.2f} TB/s)  err {err:.1e}")


def _llm(mode, input_len, output_len, max_batch):
    build = bench.default_bench_build(mode, input_len, output_len, max_batch)
    t0 = time.time()
    engine = bench.random_engine("llama-3.1-8b", "bfloat16", build)
    t1 = time.time()
    llm = LLM(engine, kv_cache_config=bench.default_kv_config(), device="cuda")
    log(f"{mode}_{input_len}_{output_len}_build_s", round(t1 - t0, 1))
    log(f"{mode}_{input_len}_{output_len}_llm_init_s", round(time.time() - t1, 1))
    return engine, llm


@phase
def latency(args):
    engine, llm = _llm("latency", 128, 128, 1)
    hw = bench.Hardware.measure(torch.device("cuda"))
    outputs, elapsed = [], 0.0
    for i, prompt in enumerate(bench.random_prompts(4, 128, 128000)):
        out, seconds = bench.run_requests(llm, [prompt], 128)
        if i:
            outputs += out
            elapsed += seconds
    result = bench.summarize("latency", "llama-3.1-8b", "bfloat16", outputs, elapsed, 128, 128)
    bench.decode_limit_pct(result, engine, hw)
    log("latency_bs1_decode_tok_s", round(1e3 / result.tpot_ms["p50"], 1))
    log("latency_bs1_ttft_ms", round(result.ttft_ms["p50"], 1))
    log("latency_pct_of_roofline", round(result.hardware_limit_pct or 0, 1))
    if args.profile:
        _profile_decode(llm, "latency")
    llm.shutdown()


def _profile_decode(llm, name):
    from torch.profiler import ProfilerActivity, profile
    prompt = bench.random_prompts(1, 128, 128000, seed=5)[0]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt, SamplingConfig(max_new_tokens=16, end_id=-1))
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    with open(os.path.join(OUT, f"profile_{name}.txt"), "w") as f:
        f.write(table)
    print(table[:6000])


def _profile_throughput(llm, prompts):
    """Where a big-batch decode step spends its time, on the host and on the GPU."""
    import cProfile
    import pstats
    from torch.profiler import ProfilerActivity, profile
    results = [llm.generate_async(p, SamplingConfig(max_new_tokens=40, min_tokens=40, end_id=-1)) for p in prompts]
    while llm.stats()["running_requests"] < len(prompts) or any(r.finished for r in results):
        time.sleep(0.005)
        if all(r.finished for r in results):
            break
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        time.sleep(0.3)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20)
    with open(os.path.join(OUT, "profile_throughput.txt"), "w") as f:
        f.write(table)
    print(table[:5000])
    [r.result() for r in results]
    core = llm.core
    reqs = [llm._make_request(p, SamplingConfig(max_new_tokens=24, min_tokens=24, end_id=-1)) for p in prompts]
    llm.shutdown()                                     # drive the engine from this thread, under cProfile
    for r in reqs:
        core.add_request(r)
    for _ in range(6):
        core.step()
    prof = cProfile.Profile()
    prof.enable()
    start = time.perf_counter()
    for _ in range(10):
        core.step()
    torch.cuda.synchronize()
    log("throughput_decode_step_ms_b512", round((time.perf_counter() - start) / 10 * 1e3, 2))
    prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(18)


@phase
def throughput(args):
    shapes = [(128, 128, args.requests)]
    if args.max_batch_sweep:
        shapes = [(128, 128, args.requests, b) for b in (512, 1024)]
    if not args.quick:
        shapes += [(2048, 128, 256), (128, 2048, 256), (2048, 2048, 128)]
    for shape in shapes:
        input_len, output_len, num = shape[:3]
        max_batch = shape[3] if len(shape) > 3 else args.max_batch
        engine, llm = _llm("throughput", input_len, output_len, max_batch)
        vocab = engine.pretrained_config.vocab_size
        bench.warm_up(llm, input_len, output_len, vocab, max_batch, num)
        prompts = bench.random_prompts(num, input_len, vocab)
        torch.cuda.synchronize()
        outputs, elapsed = bench.run_requests(llm, prompts, output_len)
        result = bench.summarize("throughput", "llama-3.1-8b", "bfloat16", outputs, elapsed, input_len, output_len)
        key = f"throughput_{input_len}_{output_len}_b{max_batch}"
        log(f"{key}_out_tok_s", round(result.output_tok_s, 1))
        log(f"{key}_ttft_p50_ms", round(result.ttft_ms.get("p50", 0), 1))
        log(f"{key}_tpot_p50_ms", round(result.tpot_ms.get("p50", 0), 2))
        log(f"{key}_stats", llm.stats())
        log(f"{key}_peak_mem_gib", round(result.peak_memory_gib, 1))
        log(f"{key}_steps_per_s", round(llm.stats()["steps"] / elapsed, 1))
        if args.profile and input_len == 128 and output_len == 128:
            _profile_throughput(llm, prompts[:512])
        llm.shutdown()
        del engine, llm, outputs
        import gc
        gc.collect()
        torch.cuda.empty_cache()


LOAD_CHILD = """
import json, sys, time
start = time.time()
from kiln import LLM, SamplingConfig
llm = LLM(sys.argv[1], device="cuda", quiet=True)
ready = time.time()
llm.generate([1, 2, 3], SamplingConfig(max_new_tokens=1, end_id=-1))
print(json.dumps({"load_s": ready - start, "load_to_first_token_s": time.time() - start,
                  "kernels_compiled_at_load": llm.stats()["kernels_compiled_at_load"]}))
llm.shutdown()
"""


@phase
def load(args):
    """Build an 8B-shaped engine, compile its kernels into it, save it; then a fresh process loads it."""
    from kiln.config import BuildConfig
    from kiln.runtime.kernel_cache import compile_kernels
    path = "/tmp/kiln_engine_8b"
    start = time.time()
    engine = bench.random_engine("llama-3.1-8b", "bfloat16", BuildConfig(max_batch_size=256, max_input_len=2048,
                                                                         max_seq_len=4096))
    built = time.time()
    count = compile_kernels(engine)
    compiled = time.time()
    engine.save(path)
    saved = time.time()
    log("load_build_random_8b_s", round(built - start, 1))
    log("load_compile_kernels_s", round(compiled - built, 1))
    log("load_kernels_in_engine", count)
    log("load_save_s", round(saved - compiled, 1))
    del engine
    torch.cuda.empty_cache()
    for attempt in ("first", "second"):
        proc = subprocess.run([sys.executable, "-c", LOAD_CHILD, path], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
        log(f"load_{attempt}_process", (proc.stdout.strip().splitlines() or [proc.stderr[-1500:]])[-1])


QUANT_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def _graph_seconds(launches) -> float:
    return bench.graph_seconds(launches, repeats=5)


def _copies(nbytes: int) -> int:
    return max(2, -(-(512 << 20) // nbytes))                    # ≥ 512 MB per graph: 8× the L2


def _gemv_sweep(bits: int, zero: bool):
    """Every GEMV configuration on the 8B shapes at one decode row: µs and TB/s of the bytes it must read."""
    from kiln.kernels import triton_kernels as tk
    best = {}
    for name, (n, k) in QUANT_SHAPES.items():
        groups = k // 128 if bits == 4 else 1
        half = zero and tk.GEMV_HALF_SCALES                     # the engine's int4 layout: fp16 scale pairs
        row_bytes = k * bits // 8 + groups * 4 * (2 if zero and not half else 1)
        copies = _copies(n * row_bytes)
        weights = [torch.randint(-128, 127, (n, k * bits // 8), device="cuda", dtype=torch.int8).view(
            torch.uint8 if bits == 4 else torch.int8) for _ in range(copies)]
        scales = [torch.rand((n, groups), device="cuda") * 1e-2 for _ in range(copies)]
        zeros = [torch.rand((n, groups), device="cuda") * 15 if zero else None for _ in range(copies)]
        if half:
            scales, zeros = [tk.half_scale_pairs(s, z) for s, z in zip(scales, zeros)], [None] * copies
        x = torch.randn((1, k), device="cuda", dtype=torch.bfloat16)
        dense = [torch.randn((n, k), device="cuda", dtype=torch.bfloat16) for _ in range(_copies(n * k * 2))]
        bf16 = _graph_seconds([lambda w=w: torch.nn.functional.linear(x, w) for w in dense])
        del dense
        times = {}
        for config in tk.GEMV_SWEEP:
            times[config] = _graph_seconds([lambda w=w, s=s, z=z: tk.weight_only_gemv(x, w, s, z, bits, config)
                                            for w, s, z in zip(weights, scales, zeros)])
        config = min(times, key=times.get)
        best[n, k, bits] = config
        tb = lambda sec: n * row_bytes / sec / 1e12  # noqa: E731
        log(f"gemv_int{bits}{'_zero' if zero else ''}_{name}",
            f"best {config}: {times[config] * 1e6:.1f}us {tb(times[config]):.2f}TB/s | cuBLAS bf16 {bf16 * 1e6:.1f}us "
            f"{n * k * 2 / bf16 / 1e12:.2f}TB/s | x{bf16 / times[config]:.2f} | all " +
            " ".join(f"{'/'.join(str(int(v)) for v in c)}:{t * 1e6:.1f}" for c, t in times.items()))
        del weights, scales, zeros
        torch.cuda.empty_cache()
    return best


MMA_LAYOUTS = [(4, 2, 1), (8, 2, 1), (16, 1, 1), (8, 4, 1), (4, 8, 1), (4, 2, 2), (2, 2, 2), (4, 4, 2), (2, 2, 4),
               (4, 1, 4)]                   # (warps, chunks a warp a step, row blocks a program)


@triton.jit
def _spin_kernel(out_ptr, cycles, PDL: tl.constexpr):
    """Programs that wait for the kernel before (PDL), let the next start launching and spin for `cycles` clocks."""
    tk._wait_for_inputs(PDL)
    start = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    now = start
    while now - start < cycles:
        now = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(out_ptr + tl.program_id(0), now - start)


def _after_short_kernel(launches) -> float:
    """Seconds a launch adds after a ~3 µs kernel on 32 programs (as a GEMV follows attention or a norm in a decode
    step, its programs resident early through PDL): graph time of (spin, launch) pairs less the spins'."""
    out = torch.zeros(32, dtype=torch.int64, device="cuda")
    spin = lambda: _spin_kernel[(32,)](out, 6000, **tk._launch())  # noqa: E731
    spins = bench.graph_seconds([spin for _ in launches], repeats=5)
    pairs = bench.graph_seconds([f for launch in launches for f in (spin, launch)], repeats=5)
    return 2 * pairs - spins


@phase
def int4_mma(args):
    """int4 g128 with zero points on the 8B shapes, one kernel in a CUDA graph over enough weight copies that L2
    holds none: the tensor-core product (kernels/int4_mma.py, its pack_grid) at one row in every MMA_LAYOUTS layout,
    alone and after a short kernel (_after_short_kernel: how MEASURED was chosen), and at 4/8/16 rows in its
    default layout, against the CUDA-core GEMV (its engine configuration and fp16 scale pairs, 1 and 4 rows), and
    the dequantize kernel; µs and TB/s of the bytes each must read (float32 grid: the CUDA-core GEMV reads half
    its scale bytes)."""
    from kiln.kernels import int4_mma as mma
    from kiln.kernels import triton_kernels as tk
    for name, (n, k) in QUANT_SHAPES.items():
        groups = k // 128
        nbytes = n * (k // 2 + groups * 8)
        copies = _copies(nbytes)
        weights = [torch.randint(-2**31, 2**31 - 1, (n, k // 8), device="cuda", dtype=torch.int32)
                   for _ in range(copies)]
        scales = [torch.rand((n, groups), device="cuda") * 1e-2 for _ in range(copies)]
        zeros = [torch.rand((n, groups), device="cuda") * 15 for _ in range(copies)]
        grids = [mma.pack_grid(s, z) for s, z in zip(scales, zeros)]
        pairs = [tk.half_scale_pairs(s, z) for s, z in zip(scales, zeros)]
        rate = lambda sec: f"{sec * 1e6:.1f}us {nbytes / sec / 1e12:.2f}TB/s"  # noqa: E731
        result = {}
        for rows in (1, 4, 8, 16):
            x = torch.randn((rows, k), device="cuda", dtype=torch.bfloat16)
            for layout in MMA_LAYOUTS if rows == 1 else [None]:
                launches = [lambda w=w, q=q: mma.gemv(x, w, q, tk._launch(), layout) for w, q in zip(weights, grids)]
                label = f"mma_{rows}" + ("_w%d_c%d_r%d" % layout if layout else "")
                result[label] = rate(_graph_seconds(launches))
                if rows == 1:
                    result[label] += f" after {_after_short_kernel(launches) * 1e6:.1f}us"
            if rows <= 4:
                launches = [lambda w=w, p=p: tk.weight_only_gemv(x, w.view(torch.uint8), p, None, 4)
                            for w, p in zip(weights, pairs)]
                result[f"cuda_core_{rows}"] = rate(_graph_seconds(launches))
                if rows == 1:
                    result["cuda_core_1"] += f" after {_after_short_kernel(launches) * 1e6:.1f}us"
        sec = _graph_seconds([lambda w=w, q=q: mma.dequantize(w, q, torch.bfloat16) for w, q in zip(weights[:2], grids)])
        result["dequantize"] = f"{sec * 1e6:.1f}us {(nbytes + n * k * 2) / sec / 1e12:.2f}TB/s"
        log(f"int4_mma_{name}", result)
        del weights, scales, zeros, grids, pairs
        torch.cuda.empty_cache()


def _fp8_gemms():
    """FP8 products of the 8B shapes at throughput batches: fused activation quantization + torch._scaled_mm
    (row-wise scales), against cuBLAS bf16."""
    from kiln.kernels import triton_kernels as tk
    for m in (512, 4096):
        for name, (n, k) in QUANT_SHAPES.items():
            x = torch.randn((m, k), device="cuda", dtype=torch.bfloat16)
            w = torch.randn((n, k), device="cuda", dtype=torch.bfloat16)
            w8, ws = w.float().to(torch.float8_e4m3fn), torch.rand((1, n), device="cuda")
            bf16 = _graph_seconds([lambda: torch.nn.functional.linear(x, w)] * 4)
            quant = _graph_seconds([lambda: tk.quantize_fp8_rows(x)] * 4)
            mm = {}
            for fast in (False, True):
                qx, sx = tk.quantize_fp8_rows(x)
                mm[fast] = _graph_seconds([lambda f=fast: torch._scaled_mm(qx, w8.t(), scale_a=sx, scale_b=ws,
                                                                            out_dtype=torch.bfloat16,
                                                                            use_fast_accum=f)] * 4)
            flops = lambda sec: 2 * m * n * k / sec / 1e12  # noqa: E731
            log(f"fp8_m{m}_{name}", f"bf16 {bf16 * 1e6:.0f}us {flops(bf16):.0f}TF | quantize {quant * 1e6:.1f}us | "
                                    f"scaled_mm {mm[False] * 1e6:.0f}us {flops(mm[False]):.0f}TF, fast_accum "
                                    f"{mm[True] * 1e6:.0f}us {flops(mm[True]):.0f}TF")
            del x, w, w8
        torch.cuda.empty_cache()


@phase
def quant_kernels(args):
    """The decode GEMV per configuration on the 8B shapes; the engine then uses the best of each (quant_latency)."""
    from kiln.kernels import triton_kernels as tk
    best = {**_gemv_sweep(4, True), **_gemv_sweep(8, False)}
    default = tk.gemv_config
    tk.gemv_config = lambda n, k, rows, bits: best.get((n, k, bits), default(n, k, rows, bits)) if rows == 1 \
        else default(n, k, rows, bits)
    log("gemv_best_configs", {f"{n}x{k}_int{bits}": c for (n, k, bits), c in best.items()})


@phase
def quant_latency(args):
    """Batch-1 decode of the 8B shape (3 prompts of 128 tokens, 128 new tokens, the first a warm-up) per mode of
    --latency_modes (_mode_quant; a quantized KV cache is not for this phase)."""
    for mode in args.latency_modes.split(","):
        quant, lm_head = _mode_quant(mode)
        log(f"quant_{mode}_bs1_decode_tok_s",
            _decode_tok_s(quant.quant_algo, new_tokens=128, lm_head=lm_head,
                          profile=f"latency_{mode.replace('+', '_')}" if args.profile else None))


@phase
def quant_fp8_kernels(args):
    _fp8_gemms()


@phase
def quant_fp8_throughput(args):
    """FP8 (per-channel weights, per-token activations) 128/128 throughput."""
    from kiln.config import QuantConfig
    build = bench.default_bench_build("throughput", 128, 128, args.max_batch)
    engine = bench.random_engine("llama-3.1-8b", "bfloat16", build,
                                 quant_config=QuantConfig(quant_algo="FP8_PER_CHANNEL_PER_TOKEN"))
    with LLM(engine, kv_cache_config=bench.default_kv_config(), device="cuda", quiet=True) as llm:
        bench.warm_up(llm, 128, 128, 128000, args.max_batch)
        outputs, elapsed = bench.run_requests(llm, bench.random_prompts(args.requests, 128, 128000), 128)
        log("quant_FP8_throughput_128_128_out_tok_s", round(sum(len(o.token_ids) for o in outputs) / elapsed, 1))
        log("quant_FP8_throughput_steps_per_s", round(llm.stats()["steps"] / elapsed, 1))
        if args.profile:
            _profile_fp8_decode(llm)


def _mode_quant(mode: str):
    """(QuantConfig, LM head quantized) of a mode written ALGO (bf16 = none), then +INT8 or +FP8 for a quantized KV
    cache and +lm_head for quantize_lm_head."""
    from kiln.config import QuantConfig, excluded_modules
    algo, *extras = mode.split("+")
    lm_head = "lm_head" in extras
    kv = next((e for e in extras if e in ("INT8", "FP8")), None)
    return QuantConfig(quant_algo=None if algo == "bf16" else algo, kv_cache_quant_algo=kv,
                       exclude_modules=excluded_modules(lm_head)), lm_head


def _decode_tok_s(algo: str | None, new_tokens: int = 96, profile: str | None = None, lm_head: bool = False) -> float:
    """Batch-1 decode tok/s (median TPOT) of the 8B shape, bf16 or weight-only quantized (round to nearest; lm_head:
    the LM head too)."""
    engine = _latency_engine(algo, new_tokens, lm_head)
    tok_s = _engine_decode_tok_s(engine, algo, new_tokens, profile)
    del engine
    torch.cuda.empty_cache()
    return tok_s


def _latency_engine(algo: str | None, new_tokens: int, lm_head: bool = False):
    from kiln.config import QuantConfig, excluded_modules
    build = bench.default_bench_build("latency", 128, new_tokens, 1)
    quant = QuantConfig(quant_algo=algo, exclude_modules=excluded_modules(lm_head)) if algo else None
    return bench.random_engine("llama-3.1-8b", "bfloat16", build, quant_config=quant)


def _engine_decode_tok_s(engine, algo: str | None, new_tokens: int, profile: str | None = None) -> float:
    """_decode_tok_s on an engine already built (3 prompts of 128 tokens, the first a warm-up)."""
    with LLM(engine, kv_cache_config=bench.default_kv_config(), device="cuda", quiet=True) as llm:
        outputs = []
        for i, prompt in enumerate(bench.random_prompts(3, 128, 128000)):
            out, _ = bench.run_requests(llm, [prompt], new_tokens)
            if i:
                outputs += out
        result = bench.summarize("latency", "llama-3.1-8b", algo or "bf16", outputs, 1.0, 128, new_tokens)
        if profile:
            _profile_decode(llm, profile)
    return round(1e3 / result.tpot_ms["p50"], 1)


def _set_switches(tk, switches, enabled: set[str] | dict) -> None:
    """enabled: the switches on (a set; the others off), or every switch's value (a dict)."""
    for name in switches:
        setattr(tk, name, enabled[name] if isinstance(enabled, dict) else name in enabled)


@phase
def decode_fusions(args):
    """Batch-1 decode of the weight-only modes (each engine built once) with the decode GEMV's fusions
    (triton_kernels.GEMV_SWITCHES, read when a network is loaded) all off, each alone, all on and all but one;
    then W4A16_AWQ with an int4 LM head, all on and all but the SiLU epilogue. --latency_modes picks the modes
    (W4A16_AWQ+lm_head for the last part), --fusion_labels the variants (default: the engine's switches,
    default_but_X: those with X off, default_mma_all: every int4 layer on int4_mma, default_silu_all: int4 gate_up
    on paired rows too)."""
    from kiln.kernels import triton_kernels as tk
    switches = tk.GEMV_SWITCHES
    saved = {name: getattr(tk, name) for name in switches}
    variants = [("off", set()), *[(name[5:].lower(), {name}) for name in switches], ("all", set(switches)),
                *[(f"all_but_{name[5:].lower()}", set(switches) - {name}) for name in switches],
                ("default", dict(saved)), *[(f"default_but_{name[5:].lower()}", {**saved, name: False})
                                            for name in switches if saved[name]],
                ("default_mma_all", {**saved, "GEMV_MMA": "all"}), ("default_silu_all", {**saved, "GEMV_SILU": True})]
    if args.fusion_labels:
        variants = [(label, enabled) for label, enabled in variants if label in args.fusion_labels.split(",")]
    log("decode_fusions_bf16_bs1_tok_s", _decode_tok_s(None, new_tokens=128))
    try:
        for algo in [mode for mode in args.latency_modes.split(",") if "+" not in mode]:
            engine = _latency_engine(algo, 128)
            for label, enabled in variants:
                _set_switches(tk, switches, enabled)
                log(f"decode_fusions_{label}_{algo}_bs1_tok_s", _engine_decode_tok_s(engine, algo, 128))
            del engine
            torch.cuda.empty_cache()
        if "W4A16_AWQ+lm_head" not in args.latency_modes.split(","):
            return
        engine = _latency_engine("W4A16_AWQ", 128, lm_head=True)        # the LM head quantized too
        for label, enabled in (("all", set(switches)), ("all_but_silu", set(switches) - {"GEMV_SILU"})):
            _set_switches(tk, switches, enabled)
            log(f"decode_fusions_{label}_W4A16_AWQ+lm_head_bs1_tok_s", _engine_decode_tok_s(engine, "W4A16_AWQ", 128))
        del engine
    finally:
        for name, value in saved.items():
            setattr(tk, name, value)


# label → (triton_kernels function, which of its calls to repeat); the products by their (N, K) at the 8B shape
_REPEATABLE = {
    "qkv": ("quant_linear", (6144, 4096)), "o": ("quant_linear", (4096, 4096)),
    "gate_up": ("quant_linear", (28672, 4096)), "down": ("quant_linear", (4096, 14336)),
    "lm_head": ("quant_linear", (128256, 4096)), "norm": ("add_rms_norm", None), "silu": ("silu_and_mul", None),
    "attention": ("decode_attention", None),
}


def _repeated(fn, shape):
    """fn, each call (with a product of that (N, K) if shape) made twice, the first result dropped."""
    def run(*args, **kwargs):
        if shape is None or (tuple(args[2]["weight"].shape[:1]) + tuple(args[0].shape[-1:])) == shape:
            fn(*args, **kwargs)
        return fn(*args, **kwargs)
    return run


@phase
def decode_doubling(args):
    """What each kernel of a W4A16_AWQ (+ int4 LM head) batch-1 decode step costs where it runs — inside the decode
    graph, with PDL overlapping its neighbours — measured by making each of its calls twice (the first result
    dropped; the values go wrong, the times do not) and taking the difference in time a step: rounds alternating
    over the variants, median of 3. Divide by the calls a step (32 a layer op, 64 norms — add_rms_norm; the first layer's rms_norm is not
    repeated — and 1 LM head)."""
    from kiln.kernels import triton_kernels as tk
    engine = _latency_engine("W4A16_AWQ", 128, lm_head=True)
    saved = {name: getattr(tk, name) for name, _ in _REPEATABLE.values()}
    labels = ["none", *(args.doubling_labels.split(",") if args.doubling_labels else _REPEATABLE)]
    rounds = {label: [] for label in labels}
    try:
        for _ in range(3):
            for label in labels:
                for name, fn in saved.items():
                    setattr(tk, name, fn)
                if label != "none":
                    name, shape = _REPEATABLE[label]
                    setattr(tk, name, _repeated(saved[name], shape))
                rounds[label].append(_engine_decode_tok_s(engine, "W4A16_AWQ", 128))
    finally:
        for name, fn in saved.items():
            setattr(tk, name, fn)
    base = sorted(rounds["none"])[1]
    for label, got in rounds.items():
        tok_s = sorted(got)[1]
        log(f"decode_doubling_{label}", f"{tok_s} tok/s, +{1e3 / tok_s - 1e3 / base:.3f} ms a step | all {got}")
    del engine
    torch.cuda.empty_cache()


@phase
def pdl(args):
    """Batch-1 decode with programmatic dependent launch off and on (bf16, W8A16, W4A16_AWQ g128)."""
    from kiln.kernels import triton_kernels as tk
    log("pdl_available", tk.gdc_wait is not None)
    for algo in (None, "W8A16", "W4A16_AWQ"):
        for enabled in (False, True):
            tk.PDL_ENABLED = enabled
            name = f"pdl_{'on' if enabled else 'off'}_{algo or 'bf16'}"
            log(f"{name}_bs1_tok_s", _decode_tok_s(algo, profile=name if args.profile and enabled else None))
    tk.PDL_ENABLED = None


def _overlapped_tok_s(engine, args, profile: bool) -> float:
    """Output tok/s of --requests 128/128 requests with overlapped steps, after a warm-up on the same shapes."""
    with LLM(engine, kv_cache_config=bench.default_kv_config(), device="cuda", quiet=True,
             enable_trt_overlap=True) as llm:
        bench.warm_up(llm, 128, 128, 128000, args.max_batch)
        outputs, elapsed = bench.run_requests(llm, bench.random_prompts(args.requests, 128, 128000), 128)
        if profile:
            _profile_fp8_decode(llm)
    return round(sum(len(o.token_ids) for o in outputs) / elapsed, 1)


@phase
def fp8_overlap(args):
    """FP8 per-token 128/128 throughput with overlapped steps; fast accumulation off and on."""
    from kiln.config import QuantConfig
    build = bench.default_bench_build("throughput", 128, 128, args.max_batch)
    engine = bench.random_engine("llama-3.1-8b", "bfloat16", build,
                                 quant_config=QuantConfig(quant_algo="FP8_PER_CHANNEL_PER_TOKEN"))
    for fast in (False, True):
        engine.build_config.plugin_config.fp8_fast_accumulation = fast
        log(f"fp8_overlap_fast_accum_{fast}_out_tok_s", _overlapped_tok_s(engine, args, args.profile and fast))


@phase
def fp8_fused(args):
    """FP8 per-token 128/128 overlapped throughput with the norm/SiLU kernels emitting e4m3 rows (quant.Fp8Rows)
    off and on (fast accumulation on); --profile profiles the second."""
    from kiln.config import QuantConfig
    from kiln.models import llama
    build = bench.default_bench_build("throughput", 128, 128, args.max_batch)
    engine = bench.random_engine("llama-3.1-8b", "bfloat16", build,
                                 quant_config=QuantConfig(quant_algo="FP8_PER_CHANNEL_PER_TOKEN"))
    takes = llama.QuantLinear.takes_fp8_rows
    for fused in (False, True):
        llama.QuantLinear.takes_fp8_rows = takes if fused else property(lambda self: False)
        log(f"fp8_fused_{fused}_out_tok_s", _overlapped_tok_s(engine, args, args.profile and fused))
    llama.QuantLinear.takes_fp8_rows = takes


ATTN_SWEEP = [(tile, 4, stages, words) for tile in (32, 64, 128) for stages in (2, 3, 4) for words in (True, False)]


def _decode_attention_case(batch: int, context: tuple[int, int], kv_dtype, layers: int, seed: int = 0):
    """Random decode attention inputs of the 8B shape (32 query heads, 8 KV heads, head dim 128, blocks of 32):
    `layers` caches (so that L2 holds none), shuffled block tables, lengths uniform in `context`."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    tpb, kh, dim = 32, 8, 128
    lens = torch.randint(context[0], context[1] + 1, (batch,), device="cuda", generator=g)
    blocks_per_seq = -(-int(lens.max()) // tpb)
    num_blocks = batch * blocks_per_seq
    tables = torch.randperm(num_blocks, device="cuda", generator=g).view(batch, blocks_per_seq)
    caches = []
    for _ in range(layers):
        cache = torch.randn((2, num_blocks, tpb, kh, dim), device="cuda", dtype=torch.bfloat16, generator=g)
        caches.append((cache * (1 if kv_dtype == torch.bfloat16 else 60)).clamp(-127, 127).to(kv_dtype))
    q = torch.randn((batch, 32, dim), device="cuda", dtype=torch.bfloat16, generator=g)
    starts = torch.arange(batch + 1, device="cuda")
    scale = None if kv_dtype == torch.bfloat16 else torch.tensor([1 / 60, 1 / 60], device="cuda")
    return q, caches, tables, lens, starts, scale


@phase
def attn_sweep(args):
    """Decode attention (one new token per sequence) per ATTN_SWEEP configuration (tile, warps, stages, word-wise
    reads of a quantized cache) for the --attn_dtypes caches: µs per layer and TB/s of the cache bytes it must read;
    every configuration's output is checked against the first one's."""
    from kiln.kernels import triton_kernels as tk
    cases = [(512, (128, 256)), (256, (1024, 2048))]
    for kv_dtype in [getattr(torch, name) for name in args.attn_dtypes.split(",")]:
        for batch, context in cases:
            q, caches, tables, lens, starts, scale = _decode_attention_case(batch, context, kv_dtype, layers=6)
            nbytes = int(lens.sum()) * 8 * 128 * 2 * kv_dtype.itemsize
            times, reference = {}, None
            for config in ATTN_SWEEP + [(0, 1, 0, True)]:        # the last: the mma.sync kernel (8-bit caches)
                tile, warps, stages, words = config
                if kv_dtype == torch.bfloat16 and (not words or not tile):
                    continue
                run = lambda c, t=tile, w=warps, st=stages, wl=words: tk.paged_attention(  # noqa: E731
                    q, c, tables, lens, starts, 1, 128 ** -0.5, None, tile=t or None, kv_scale=scale,
                    launch=(w, st) if t else None, word_loads=wl, mma=not t)
                try:
                    out = run(caches[0])
                    if reference is None:
                        reference = out
                    err = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
                    if err > 1e-2:
                        times[config] = f"WRONG {err:.1e}"
                        continue
                    times[config] = _graph_seconds([lambda c=c: run(c) for c in caches])
                except Exception as exc:  # noqa: BLE001 - a config that fails to compile is skipped
                    times[config] = f"fail {type(exc).__name__}"
            ok = {c: t for c, t in times.items() if isinstance(t, float)}
            best = min(ok, key=ok.get)
            name = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8", torch.int8: "int8"}[kv_dtype]
            log(f"attn_{name}_b{batch}_ctx{context[0]}-{context[1]}",
                f"default 64/4/2 {ok.get((64, 4, 2, True), 0) * 1e6:.1f}us "
                f"{nbytes / ok.get((64, 4, 2, True), 1) / 1e12:.2f}TB/s | "
                f"best {best} {ok[best] * 1e6:.1f}us {nbytes / ok[best] / 1e12:.2f}TB/s | all " +
                " ".join(f"{c[0]}/{c[1]}/{c[2]}/{int(c[3])}:{t * 1e6:.1f}" if isinstance(t, float) else f"{c}:{t}"
                         for c, t in times.items()))
            del caches
            torch.cuda.empty_cache()


def _decode_attention_variants(name: str, batch: int, keys: int, kv_dtype, variants: dict) -> None:
    """Decode attention of `batch` sequences of `keys` keys (8B shape, 6 caches) per variant, label → (max_keys →
    (num_parts, part_tokens, other paged_attention options)): µs, TB/s of the cache bytes and partitions of each,
    and the others' relative difference from the first's output."""
    from kiln.kernels import triton_kernels as tk
    q, caches, tables, lens, starts, scale = _decode_attention_case(batch, (keys, keys), kv_dtype, layers=6)
    nbytes = int(lens.sum()) * 8 * 128 * 2 * kv_dtype.itemsize
    times, outs = {}, {}
    for label, choose in variants.items():
        parts, part, options = choose(tables.shape[1] * 32)
        run = lambda c, n=parts, pt=part, o=options: tk.paged_attention(  # noqa: E731
            q, c, tables, lens, starts, 1, 128 ** -0.5, None, num_parts=n, part_tokens=pt, kv_scale=scale, **o)
        outs[label] = run(caches[0]).float()
        times[label] = (_graph_seconds([lambda c=c: run(c) for c in caches]), parts)
    first = next(iter(outs.values()))
    err = max(((o - first).norm() / first.norm()).item() for o in outs.values())
    log(name, " | ".join(f"{label} {t * 1e6:.1f}us {nbytes / t / 1e12:.2f}TB/s parts {n}"
                         for label, (t, n) in times.items()) + f" | err {err:.1e}")


@phase
def attn_small(args):
    """Decode attention over an e4m3 cache at small batches, each kernel with its own split-K partitions
    (model_runner.decode_partitions): the mma.sync kernel (one warp a program) against the Triton kernel; then
    batch-1 decode of the 8B shape with an FP8 KV cache (bf16 weights), mma on and off."""
    from kiln.kernels import triton_kernels as tk
    from kiln.runtime.model_runner import decode_partitions
    for batch, keys in [(1, 256), (1, 2048), (8, 512), (8, 4096), (32, 1024), (64, 256), (128, 2048)]:
        _decode_attention_variants(f"attn_small_b{batch}_keys{keys}", batch, keys, torch.float8_e4m3fn, {
            label: lambda max_keys, m=mma: (*decode_partitions(batch * 8, max_keys, m), {"mma": m})
            for label, mma in (("mma", True), ("triton", False))})
    from kiln.config import QuantConfig
    build = bench.default_bench_build("latency", 128, 128, 1)
    engine = bench.random_engine("llama-3.1-8b", "bfloat16", build, quant_config=QuantConfig(kv_cache_quant_algo="FP8"))
    for mma in (True, False):
        tk.DECODE_MMA = mma
        log(f"attn_small_bs1_fp8kv_{'mma' if mma else 'triton'}_tok_s", _engine_decode_tok_s(engine, None, 128))
    tk.DECODE_MMA = True
    del engine
    torch.cuda.empty_cache()


@phase
def attn_split(args):
    """Decode attention over a bf16 cache at small batches on the Triton kernel with the split-K partitions of
    model_runner.decode_partitions, small-batch splitting (SPLIT_SMALL_BATCHES) off and on; then batch-1 decode of
    the 8B shape (bf16, W4A16_AWQ) with each (the switch is read when the decode graphs are captured), and with
    torch's argmax for greedy tokens instead of the Triton one."""
    from kiln.runtime import model_runner

    def split_parts(max_keys, batch, split):
        model_runner.SPLIT_SMALL_BATCHES = split
        return (*model_runner.decode_partitions(batch * 8, max_keys, False), {})

    for batch, keys in [(1, 256), (1, 1024), (1, 4096), (4, 512), (8, 256), (16, 1024), (32, 256)]:
        _decode_attention_variants(f"attn_split_b{batch}_keys{keys}", batch, keys, torch.bfloat16, {
            label: lambda max_keys, b=batch, on=split: split_parts(max_keys, b, on)
            for label, split in (("old", False), ("split", True))})
    from kiln.kernels import reference
    from kiln.kernels import triton_kernels as tk
    triton_argmax = tk.argmax_rows                      # read by TritonOps when an LLM loads its network
    for algo in (None, "W4A16_AWQ"):
        engine = _latency_engine(algo, 128)
        for split, argmax in ((False, False), (True, False), (True, True)):
            model_runner.SPLIT_SMALL_BATCHES = split
            tk.argmax_rows = triton_argmax if argmax else reference.argmax_rows
            log(f"attn_split_{'on' if split else 'off'}_{'triton' if argmax else 'torch'}_argmax_{algo or 'bf16'}"
                "_bs1_tok_s", _engine_decode_tok_s(engine, algo, 128))
        del engine
        torch.cuda.empty_cache()
    model_runner.SPLIT_SMALL_BATCHES = True
    tk.argmax_rows = triton_argmax


@phase
def attn_fused(args):
    """Decode steps over a bf16 cache that decode_partitions splits: rope + cache write, attention and merge as
    three kernels against triton_kernels.decode_attention (one kernel; its first tile loaded before the PDL wait or
    after), µs a layer over 6 layers' caches; then batch-1 decode of the 8B shape (bf16, W4A16_AWQ + int4 LM head)
    with FUSED_DECODE off and on, alternating rounds (the switch is read when the decode graphs are captured)."""
    from kiln.kernels import triton_kernels as tk
    from kiln.kernels.rotary import rope_cos_sin
    from kiln.runtime.model_runner import decode_partitions
    table = rope_cos_sin(8192, 128, 500000.0, None).to("cuda")
    for batch, keys in [(1, 129), (1, 256), (1, 1024), (1, 4096), (8, 256), (16, 1024)]:
        _, caches, tables, lens, starts, _ = _decode_attention_case(batch, (keys, keys), torch.bfloat16, layers=6)
        qkv = torch.randn((batch, 48 * 128), device="cuda", dtype=torch.bfloat16)
        slots = tables.gather(1, ((lens - 1) // 32)[:, None])[:, 0] * 32 + (lens - 1) % 32
        parts, part_tokens = decode_partitions(batch * 8, keys, False)

        def three(c):
            q = tk.rope_and_cache(qkv, lens - 1, table, c, slots, 32, 8, 128)
            return tk.paged_attention(q, c, tables, lens, starts, 1, 128 ** -0.5, None, num_parts=parts,
                                      part_tokens=part_tokens)

        def one(c, preload):
            return tk.decode_attention(qkv, lens - 1, table, c, slots, tables, lens, 32, 8, 128, 128 ** -0.5, None,
                                       num_parts=parts, part_tokens=part_tokens, preload=preload)

        variants = {"three": three, "one": lambda c: one(c, True), "one_after_wait": lambda c: one(c, False)}
        first = three(caches[0]).float()
        err = max(((fn(caches[0]).float() - first).norm() / first.norm()).item() for fn in variants.values())
        log(f"attn_fused_b{batch}_keys{keys}", " | ".join(
            f"{label} {_graph_seconds([lambda c=c, f=fn: f(c) for c in caches]) * 1e6:.2f}us"
            for label, fn in variants.items()) + f" | parts {parts} | err {err:.1e}")
        del caches
        torch.cuda.empty_cache()
    for mode in ("bf16", "W4A16_AWQ+lm_head"):
        quant, lm_head = _mode_quant(mode)
        engine = _latency_engine(quant.quant_algo, 128, lm_head)
        rounds = {False: [], True: []}
        for _ in range(3):
            for fused in (False, True):
                tk.FUSED_DECODE = fused
                rounds[fused].append(_engine_decode_tok_s(engine, quant.quant_algo, 128))
        for fused, got in rounds.items():
            log(f"attn_fused_{'on' if fused else 'off'}_{mode}_bs1_tok_s", f"median {sorted(got)[1]} all {got}")
        del engine
        torch.cuda.empty_cache()
    tk.FUSED_DECODE = True


def _median_ms(seconds: list[float]) -> float | None:
    return round(1e3 * sorted(seconds)[len(seconds) // 2], 2) if seconds else None


@contextlib.contextmanager
def _stall_watch():
    """What may stall a measured run: Triton compilations (kernel and specialization), garbage-collector pauses
    (seconds in all) and the caching allocator's device allocations and retries (a retry frees cached blocks)."""
    import gc
    import triton
    found = {"compiled": [], "gc_s": 0.0}
    started = []

    def on_gc(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            found["gc_s"] += time.perf_counter() - started.pop()

    def on_compile(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        found["compiled"].append(repr[:400])
        return None
    before = torch.cuda.memory_stats()
    hook, triton.knobs.runtime.jit_cache_hook = triton.knobs.runtime.jit_cache_hook, on_compile
    gc.callbacks.append(on_gc)
    try:
        yield found
    finally:
        gc.callbacks.remove(on_gc)
        triton.knobs.runtime.jit_cache_hook = hook
        after = torch.cuda.memory_stats()
        for name in ("num_alloc_retries", "num_device_alloc", "num_device_free"):
            found[name] = after.get(name, 0) - before.get(name, 0)
        found["gc_s"] = round(found["gc_s"], 3)


@phase
def timeline(args):
    """Where a 128/128 throughput run's time goes: every engine step's wall time, by kind (steps with prompt
    tokens, pure decode steps), and how long the host waited for the device's tokens (overlapped steps: a host
    that never waits is the bottleneck). One run per mode in --timeline_modes (_mode_quant)."""
    from kiln.runtime import model_runner
    for mode in args.timeline_modes.split(","):
        quant, _ = _mode_quant(mode)
        build = bench.default_bench_build("throughput", 128, 128, args.max_batch)
        engine = bench.random_engine("llama-3.1-8b", "bfloat16", build, quant_config=quant)
        waits = []
        host_tokens = model_runner.Launch.host_tokens

        def timed_host_tokens(self, _orig=host_tokens):
            start = time.perf_counter()
            value = _orig(self)
            waits.append(time.perf_counter() - start)
            return value
        model_runner.Launch.host_tokens = timed_host_tokens
        with LLM(engine, kv_cache_config=bench.default_kv_config(), device="cuda", quiet=True,
                 enable_trt_overlap=True) as llm:
            bench.warm_up(llm, 128, 128, 128000, args.max_batch)
            core, steps = llm.core, []
            step = core.step

            def timed_step(_orig=step):
                start = time.perf_counter()
                waits_before = len(waits)
                advanced = _orig()
                sched = core.scheduler.stats
                steps.append((sched.last_step_tokens, len(core.scheduler.running), time.perf_counter() - start,
                              sum(waits[waits_before:])))
                return advanced
            core.step = timed_step
            with _stall_watch() as stalls:
                outputs, elapsed = bench.run_requests(llm, bench.random_prompts(args.requests, 128, 128000), 128)
            core.step = step
        model_runner.Launch.host_tokens = host_tokens
        prompt_steps = [s for s in steps if s[0] > s[1]]
        decode_steps = [s for s in steps if s[0] <= s[1] and s[1] >= args.max_batch * 0.9]
        total = sum(len(o.token_ids) for o in outputs)
        summary = {"out_tok_s": round(total / elapsed, 1), "elapsed_s": round(elapsed, 2), "steps": len(steps),
                   "prompt_steps": len(prompt_steps),
                   "prompt_steps_s": round(sum(s[2] for s in prompt_steps), 2),
                   "prompt_step_tokens_mean": round(sum(s[0] for s in prompt_steps) / max(1, len(prompt_steps))),
                   "full_decode_steps": len(decode_steps),
                   "full_decode_step_ms_median": _median_ms([s[2] for s in decode_steps]),
                   "full_decode_wait_ms_median": _median_ms([s[3] for s in decode_steps]),
                   "other_steps_s": round(sum(s[2] for s in steps) - sum(s[2] for s in prompt_steps)
                                          - sum(s[2] for s in decode_steps), 2), **stalls}
        log(f"timeline_{mode}", summary)
        with open(os.path.join(OUT, f"timeline_{mode.replace('+', '_')}.json"), "w") as f:
            json.dump(steps, f)
        del engine
        torch.cuda.empty_cache()


def quant(args):
    """All quantized measurements (each its own phase, so that one failing leaves the others)."""
    for step in (quant_kernels, quant_latency, quant_fp8_kernels, quant_fp8_throughput):
        step(args)


def _profile_fp8_decode(llm):
    """GPU time by kernel over decode steps at the full batch."""
    from torch.profiler import ProfilerActivity, profile
    results = [llm.generate_async(p, SamplingConfig(max_new_tokens=48, min_tokens=48, end_id=-1))
               for p in bench.random_prompts(512, 128, 128000, seed=7)]
    while llm.stats()["running_requests"] < len(results) and not all(r.finished for r in results):
        time.sleep(0.005)
    time.sleep(0.05)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        time.sleep(0.2)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60)
    with open(os.path.join(OUT, "profile_fp8_decode.txt"), "w") as f:
        f.write(table)
    print(table[:4000])
    [r.result() for r in results]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--phases", default="tests,latency,throughput")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--requests", type=int, default=1024)
    p.add_argument("--max_batch", type=int, default=512)
    p.add_argument("--max_batch_sweep", action="store_true")
    p.add_argument("--test_timeout", type=int, default=400)
    p.add_argument("--latency_modes", default="W4A16_AWQ,W8A16", help="modes of quant_latency (+lm_head)")
    p.add_argument("--fusion_labels", default="", help="decode_fusions' variants to run (off, silu, ..., all, "
                   "all_but_mma, default, default_but_mma, ...: its docstring; empty: every one)")
    p.add_argument("--doubling_labels", default="", help="decode_doubling's kernels to repeat (qkv, o, gate_up, "
                   "down, lm_head, norm, silu, attention; empty: every one)")
    p.add_argument("--attn_dtypes", default="float8_e4m3fn,int8", help="cache dtypes of attn_sweep")
    p.add_argument("--timeline_modes", default="FP8_PER_CHANNEL_PER_TOKEN,FP8_PER_CHANNEL_PER_TOKEN+FP8,bf16")
    p.add_argument("--test_paths", default="tests/test_gpu.py", help="comma-separated pytest paths of the tests phase")
    args = p.parse_args()
    env(args)
    for name in args.phases.split(","):
        if name:
            globals()[name](args)
    with open(os.path.join(OUT, "suite.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


if __name__ == "__main__":
    main()
