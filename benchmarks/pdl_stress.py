"""Repeat CUDA-graph decode of a SmolLM2-shaped float32 model (plain, W8A16, W4A16_AWQ) with programmatic dependent
launch on and off, and count the runs whose greedy tokens differ from the first run's (a race shows as a
sometimes-different run). Usage: python3 benchmarks/pdl_stress.py [--repeats 15]"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kiln import LLM, BuildConfig, SamplingConfig  # noqa: E402
from kiln.benchmark import shape_config  # noqa: E402
from kiln.config import QuantConfig  # noqa: E402
from kiln.kernels import triton_kernels as tk  # noqa: E402
from kiln.models import LlamaForCausalLM  # noqa: E402
from kiln.quantization import quantize_model  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    build = BuildConfig(max_batch_size=4, max_input_len=128, max_seq_len=256)
    prompts = [list(range(3, 3 + n)) for n in (1, 40, 100)]
    sampling = SamplingConfig(max_new_tokens=16, end_id=-1)
    for algo in (None, "W8A16", "W4A16_AWQ"):
        model = LlamaForCausalLM.random(shape_config("smollm2-135m", "float32"), seed=3, std=0.05)
        if algo:
            model = quantize_model(model, QuantConfig(quant_algo=algo), calib_size=2, quiet=True)
        with LLM(model, build_config=build, device="cpu", quiet=True) as llm:
            cpu = [o.outputs[0].token_ids for o in llm.generate(prompts, sampling)]
        for pdl in (True, False):
            tk.PDL_ENABLED = pdl
            with LLM(model, build_config=build, device="cuda", quiet=True) as llm:
                runs = [[o.outputs[0].token_ids for o in llm.generate(prompts, sampling)] for _ in range(args.repeats)]
            distinct = {str(r) for r in runs}
            first_part = [next((i for i, (a, b) in enumerate(zip(c, g)) if a != b), None) for c, g in zip(cpu, runs[0])]
            print(f"{algo or 'float32'} pdl={pdl}: {len(distinct)} distinct outputs over {args.repeats} runs; "
                  f"runs differing from the first: {sum(r != runs[0] for r in runs)}; first run vs CPU parts at "
                  f"{first_part}", flush=True)


if __name__ == "__main__":
    main()
