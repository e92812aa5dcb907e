"""One run on a host with several GPUs: tensor-parallel correctness, then the multi-GPU timings.

    python benchmarks/multi_gpu.py --phases check,latency,throughput70b [--quick]

Needs Kiln installed (`pip install -e .`) and two GPUs of one host.

check: a random-weight Llama-3.1-8B (the whole model made from one seed on every rank, then sharded) run with
TP=1 and TP=2: prompt logits compared, greedy tokens compared. latency: batch-1 decode of the 8B shape, TP=1 and
TP=2 (`kiln bench latency`). throughput70b: Llama-3.1-70B shape bf16 TP=2 at 128/128 (`kiln bench throughput`).
Results print as they come and go to $OUT/multi_gpu.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import subprocess
import sys
import time
import traceback

import torch

from kiln import LLM, BuildConfig, Engine, SamplingConfig, build
from kiln import benchmark as bench
from kiln.config import KvCacheConfig, Mapping
from kiln.models import LlamaForCausalLM

RESULTS: dict = {}
OUT = os.environ.get("OUT", "/tmp")
CHECK_BUILD = BuildConfig(max_batch_size=8, max_input_len=256, max_seq_len=512, gather_context_logits=True)


def log(key, value):
    RESULTS[key] = value
    print(f"{key:44s} {json.dumps(value)}", flush=True)
    with open(os.path.join(OUT, "multi_gpu.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)


def sharded_8b(custom_all_reduce: bool, rank: int, device) -> Engine:
    """Rank `rank` of TP=2 over the 8B model every rank makes from seed 0 (identical weights to TP=1's)."""
    model = LlamaForCausalLM.random(bench.shape_config("llama-3.1-8b", "bfloat16"), seed=0, device=device)
    shard = model.shard(Mapping(2, rank, 2, 1))
    del model
    torch.cuda.empty_cache()
    build_config = dataclasses.replace(CHECK_BUILD, plugin_config=dataclasses.replace(
        CHECK_BUILD.plugin_config, use_custom_all_reduce=custom_all_reduce))
    return build(shard, build_config, quiet=True)


def check(args):
    prompts = bench.random_prompts(4, 100, 128256, seed=3)
    sampling = SamplingConfig(max_new_tokens=32, end_id=-1)
    full = LlamaForCausalLM.random(bench.shape_config("llama-3.1-8b", "bfloat16"), seed=0, device="cuda")
    with LLM(build(full, CHECK_BUILD, quiet=True), quiet=True, kv_cache_config=KvCacheConfig(max_tokens=8192)) as llm:
        reference = llm.generate(prompts, sampling)
    del full, llm
    torch.cuda.empty_cache()
    for custom in (False, True):
        key = "tp2_custom_all_reduce" if custom else "tp2_nccl"
        try:
            engine = sharded_8b(custom, 0, torch.device("cuda", 0))
            engine.rank_loader = functools.partial(sharded_8b, custom)
            with LLM(engine, quiet=True, kv_cache_config=KvCacheConfig(max_tokens=8192)) as llm:
                outputs = llm.generate(prompts, sampling)
        except Exception:  # noqa: BLE001 - report and go on to the other variant
            log(f"{key}_error", traceback.format_exc()[-3000:])
            continue
        errors = [((o.context_logits - r.context_logits).norm() / r.context_logits.norm()).item()
                  for o, r in zip(outputs, reference)]
        same_prefix = [next((i for i, (a, b) in enumerate(zip(o.token_ids, r.token_ids)) if a != b),
                            len(o.token_ids)) for o, r in zip(outputs, reference)]
        log(f"{key}_vs_tp1_prompt_logits_rel_error", [round(e, 5) for e in errors])
        log(f"{key}_vs_tp1_greedy_tokens_equal_prefix", same_prefix)
        log(f"{key}_vs_tp1_ok", max(errors) < 2e-2 and min(same_prefix) >= 8)
        del engine, llm
        torch.cuda.empty_cache()


def kiln_bench(key: str, *flags: str, timeout: int = 400):
    cmd = [sys.executable, "-m", "kiln.cli.main", "bench", *flags, "--json"]
    start = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        log(f"{key}_error", (done.stderr or done.stdout)[-3000:])
        return
    result = json.loads(lines[-1])
    log(key, {k: result[k] for k in ("output_tok_s", "tpot_ms", "ttft_ms", "hardware_limit_pct", "limit_note",
                                     "elapsed_s", "num_requests") if k in result})
    log(f"{key}_wall_s", round(time.time() - start, 1))


def latency(args):
    n = "3" if args.quick else "10"
    kiln_bench("latency_8b_tp1", "latency", "--model", "llama-3.1-8b", "--num_requests", n)
    kiln_bench("latency_8b_tp2", "latency", "--model", "llama-3.1-8b", "--num_requests", n, "--tp_size", "2")
    kiln_bench("latency_8b_tp2_custom_all_reduce", "latency", "--model", "llama-3.1-8b", "--num_requests", n,
               "--tp_size", "2", "--use_custom_all_reduce")


def throughput70b(args):
    n = "512" if args.quick else "1536"
    kiln_bench("throughput_70b_tp2_128_128", "throughput", "--model", "llama-3.1-70b", "--tp_size", "2",
               "--num_requests", n, "--input_len", "128", "--output_len", "128", timeout=500)


def throughput8b(args):
    kiln_bench("throughput_8b_tp2_128_128", "throughput", "--model", "llama-3.1-8b", "--tp_size", "2",
               "--num_requests", "2048", "--input_len", "128", "--output_len", "128")


PHASES = {"check": check, "latency": latency, "throughput70b": throughput70b, "throughput8b": throughput8b}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phases", default="check,latency,throughput70b")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    log("gpus", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
    for name in args.phases.split(","):
        start = time.time()
        try:
            PHASES[name](args)
        except Exception:  # noqa: BLE001 - one failing phase must not hide the others
            log(f"{name}_error", traceback.format_exc()[-3000:])
        log(f"{name}_seconds", round(time.time() - start, 1))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
