"""Decode steps in CUDA graphs (runtime/cuda_graphs.py) on the GPU (`pytest -m gpu`, skipped without one) give the
greedy tokens of the same engine run eagerly: a SmolLM2-shaped model and a tiny Mixtral (the fused MoE)."""
from __future__ import annotations

import pytest
import torch

from conftest import random_smollm2, tiny_mixtral
from kiln import LLM, BuildConfig, SamplingConfig

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


@pytest.mark.parametrize("name", ["smollm2-135m", "tiny-mixtral"])
def test_cuda_graph_steps_equal_eager_steps(name):
    model = tiny_mixtral("bfloat16") if name == "tiny-mixtral" else random_smollm2("bfloat16", 2)
    build = BuildConfig(max_batch_size=8, max_input_len=256, max_seq_len=512)
    prompts = [list(range(5, 5 + n)) for n in (3, 50, 100, 7, 129)]
    with LLM(model, build_config=build, device=CUDA, quiet=True) as llm:
        assert llm.core.runner.graphs is not None
        graphed = [o.token_ids for o in llm.generate(prompts, SamplingConfig(max_new_tokens=20, end_id=-1))]
        llm.core.runner.graphs = None
        eager = [o.token_ids for o in llm.generate(prompts, SamplingConfig(max_new_tokens=20, end_id=-1))]
    assert graphed == eager
