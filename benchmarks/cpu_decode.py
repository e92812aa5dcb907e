"""Batch-1 decode speed on the CPU, SmolLM2-135M-Instruct (the embedded default), Kiln beside transformers.

Decode rate = 128 / (time(129 new tokens) - time(1 new token)), best of --repeats, same prompt, greedy.
    python benchmarks/cpu_decode.py [--dtype float32] [--repeats 3] [--skip-hf]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from kiln import LLM, BuildConfig, SamplingConfig
from kiln.utils.default_model import default_model_path

PROMPT = [{"role": "user", "content": "Tell me a long story about a dragon."}]


def best_decode_rate(generate, repeats: int) -> float:
    generate(4)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter(); generate(1); t1 = time.perf_counter(); generate(129); t2 = time.perf_counter()
        rates.append(128 / ((t2 - t1) - (t1 - t0)))
    return max(rates)


def kiln_rate(dtype: str, repeats: int) -> float:
    llm = LLM(default_model_path(), dtype=dtype, quiet=True,
              build_config=BuildConfig(max_batch_size=8, max_input_len=256, max_seq_len=512))
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
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-hf", action="store_true")
    args = p.parse_args()
    result = {"threads": torch.get_num_threads(), "dtype": args.dtype,
              "kiln_decode_tok_s": round(kiln_rate(args.dtype, args.repeats), 1)}
    if not args.skip_hf:
        result["transformers_decode_tok_s"] = round(hf_rate(args.dtype, args.repeats), 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
