"""Speculative decoding on the CPU: SmolLM2-135M-Instruct (the embedded default), batch 1, greedy, an
input-grounded task (correct the spelling of a ~300-token text), plain decoding against n-gram lookup in the same
run: the speculative table of docs/performance.md. Prints one JSON line.

    OMP_NUM_THREADS=2 python benchmarks/cpu_speculative.py [--max_draft_len 4] [--new_tokens 256] [--repeats 3]

Decode rate = generated tokens / (time of the whole request − time of a one-token request), best of --repeats; the
two texts must be identical (speculation is lossless).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from kiln import LLM, BuildConfig, SamplingConfig, SpeculativeConfig
from kiln.models import LlamaForCausalLM
from kiln.utils.default_model import default_model_path

TEXT = ("The river Thames flows thrugh the heart of London, past the Houses of Parliment, the Tower of London and "
        "the old docks that once made the city the busiest port in the world. For centuries it was the main road "
        "of the capital: kings travelled on it in painted barges, merchants unloaded spices, tea and timber on its "
        "banks, and ferrymen carried passengers from one shore to the other for a penny. In the nineteenth century "
        "the river became so polluted that the summer of 1858 was remembered as the Great Stink, and Parliament "
        "finally agreed to build a system of sewers designed by the engineer Joseph Bazalgette. His embankments "
        "still line the river today, carrying roads, gardens and an underground railway. Today the Thames is "
        "cleaner than it has been for two hundred years; seals and porpoises have been seen near the bridges, and "
        "thousands of people walk along its paths every weekend, stopping at pubs, markets and theatres on the way. "
        "Boats take visitors from Westminster to Greenwich, where the old Royal Naval Colege and the observatory "
        "look down over the water.")
TASK = "Rewrite the following text with its spelling mistakes corrected. Change nothing else.\n\n"


def timed(llm, prompt: str, new_tokens: int) -> tuple[float, object]:
    start = time.perf_counter()
    out = llm.generate(prompt, SamplingConfig(max_new_tokens=new_tokens))
    return time.perf_counter() - start, out


def decode_rate(llm, prompt: str, new_tokens: int, repeats: int) -> tuple[float, object]:
    timed(llm, prompt, 4)
    best, out = 0.0, None
    for _ in range(repeats):
        first, _ = timed(llm, prompt, 1)
        whole, out = timed(llm, prompt, new_tokens)
        best = max(best, (len(out.token_ids) - 1) / (whole - first))
    return best, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max_draft_len", type=int, default=4)
    p.add_argument("--new_tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    model = LlamaForCausalLM.from_hugging_face(default_model_path(), quiet=True)
    build = BuildConfig(max_batch_size=1, max_input_len=512, max_seq_len=1024)
    result = {"threads": torch.get_num_threads(), "max_draft_len": args.max_draft_len}
    texts = {}
    for name, config in (("plain", None), ("ngram", SpeculativeConfig(max_draft_len=args.max_draft_len))):
        with LLM(model, build_config=build, quiet=True, device="cpu", speculative_config=config) as llm:
            prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": TASK + TEXT}], tokenize=False,
                                                       add_generation_prompt=True)
            rate, out = decode_rate(llm, prompt, args.new_tokens, args.repeats)
            result.update({f"{name}_tok_s": round(rate, 1), "prompt_tokens": len(out.prompt_token_ids),
                           f"{name}_new_tokens": len(out.token_ids)})
            if config is not None:
                result["mean_accepted_length"] = round(out.metrics.mean_accepted_length, 2)
                result["draft_acceptance_rate"] = round(out.metrics.draft_acceptance_rate, 3)
            texts[name] = out.text
    result["speedup"] = round(result["ngram_tok_s"] / result["plain_tok_s"], 2)
    result["identical_text"] = texts["plain"] == texts["ngram"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
