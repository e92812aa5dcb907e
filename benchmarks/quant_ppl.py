"""SmolLM2-135M-Instruct perplexity on tests/data/eval.txt: float32 against every quantization mode (CPU), and on a
held-out text that no calibration draws from (the docstrings of some standard-library modules: Python's bundled
documentation, disjoint from the pydoc_data passages and Kiln's text that calibration uses).

    python benchmarks/quant_ppl.py [--calib_size 32]     # prints a markdown table for docs/quantization.md
"""
from __future__ import annotations

import argparse
import importlib
import time

from kiln import BuildConfig, build
from kiln.config import QuantConfig
from kiln.evaluate import perplexity
from kiln.models import LlamaForCausalLM
from kiln.quantization import quantize_model
from kiln.tokenizer import load_tokenizer
from kiln.utils.default_model import default_model_path

MODES = [("W8A16", None, {}), ("W4A16", None, {}), ("W4A16_GPTQ", None, {}),
         ("W4A16_GPTQ", None, {"has_zero_point": True}), ("W4A16_AWQ", None, {}), ("W8A8_SQ_PER_CHANNEL", None, {}),
         ("W8A8_SQ_PER_CHANNEL_PER_TOKEN", None, {}), ("FP8", None, {}), ("FP8_PER_CHANNEL_PER_TOKEN", None, {}),
         (None, "INT8", {}), (None, "FP8", {})]
HELD_OUT_MODULES = ["re", "statistics", "json", "argparse", "ssl", "csv", "socket", "unittest", "io", "heapq",
                    "itertools", "inspect", "doctest", "subprocess", "os", "typing"]


def held_out_text() -> str:
    return "\n\n".join(importlib.import_module(name).__doc__ for name in HELD_OUT_MODULES)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--calib_size", type=int, default=32)
    p.add_argument("--modes", help="comma-separated indices into MODES (default: all)")
    p.add_argument("--group_size", type=int, default=128)
    args = p.parse_args()
    model = LlamaForCausalLM.from_hugging_face(default_model_path(), quiet=True)
    tokenizer = load_tokenizer(model.tokenizer_files)
    texts = [tokenizer.encode(open("tests/data/eval.txt").read()), tokenizer.encode(held_out_text())]
    config = BuildConfig(max_batch_size=1, max_input_len=512, max_seq_len=1024)

    def perplexities(engine_model):
        engine = build(engine_model, config, quiet=True)
        return [perplexity(engine, ids) for ids in texts]

    base = perplexities(model)
    print("| mode | perplexity | Δ vs float32 | held-out perplexity | held-out Δ | quantize s |\n|---|---|---|---|---|---|")
    print(f"| float32 | {base[0][0]:.4f} | — | {base[1][0]:.4f} | — | — |")
    chosen = [MODES[int(i)] for i in args.modes.split(",")] if args.modes else MODES
    for algo, kv, extra in chosen:
        start = time.perf_counter()
        quantized = quantize_model(model, QuantConfig(quant_algo=algo, kv_cache_quant_algo=kv,
                                                      group_size=args.group_size, **extra), args.calib_size, quiet=True)
        seconds = time.perf_counter() - start
        (ppl, _), (held, _) = perplexities(quantized)
        name = algo if kv is None else f"KV {kv}" if algo is None else f"{algo} + KV {kv}"
        name += "".join(f" {k}={v}" for k, v in extra.items())
        print(f"| {name} | {ppl:.4f} | {100 * (ppl / base[0][0] - 1):+.2f}% | {held:.4f} | "
              f"{100 * (held / base[1][0] - 1):+.2f}% | {seconds:.0f} |", flush=True)
    print(f"\n{base[0][1]} / {base[1][1]} predicted tokens (eval.txt / held-out), calib_size={args.calib_size}, "
          f"group_size={args.group_size}")


if __name__ == "__main__":
    main()
