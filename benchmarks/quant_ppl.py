"""SmolLM2-135M-Instruct perplexity on tests/data/eval.txt: float32 against every quantization mode (CPU).

    python benchmarks/quant_ppl.py [--calib_size 32]     # prints a markdown table for docs/quantization.md
"""
from __future__ import annotations

import argparse
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


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--calib_size", type=int, default=32)
    p.add_argument("--modes", help="comma-separated indices into MODES (default: all)")
    p.add_argument("--group_size", type=int, default=128)
    args = p.parse_args()
    model = LlamaForCausalLM.from_hugging_face(default_model_path(), quiet=True)
    ids = load_tokenizer(model.tokenizer_files).encode(open("tests/data/eval.txt").read())
    config = BuildConfig(max_batch_size=1, max_input_len=512, max_seq_len=1024)
    base, count = perplexity(build(model, config, quiet=True), ids)
    print(f"| mode | perplexity | Δ vs float32 | quantize s |\n|---|---|---|---|\n| float32 | {base:.4f} | — | — |")
    chosen = [MODES[int(i)] for i in args.modes.split(",")] if args.modes else MODES
    for algo, kv, extra in chosen:
        start = time.perf_counter()
        quantized = quantize_model(model, QuantConfig(quant_algo=algo, kv_cache_quant_algo=kv,
                                                      group_size=args.group_size, **extra), args.calib_size, quiet=True)
        seconds = time.perf_counter() - start
        ppl, _ = perplexity(build(quantized, config, quiet=True), ids)
        name = algo if kv is None else f"KV {kv}" if algo is None else f"{algo} + KV {kv}"
        name += "".join(f" {k}={v}" for k, v in extra.items())
        print(f"| {name} | {ppl:.4f} | {100 * (ppl / base - 1):+.2f}% | {seconds:.0f} |", flush=True)
    print(f"\n{count} predicted tokens, calib_size={args.calib_size}, group_size={args.group_size}")


if __name__ == "__main__":
    main()
