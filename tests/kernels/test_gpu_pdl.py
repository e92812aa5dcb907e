"""Programmatic dependent launch (on sm_90+ each Triton kernel starts while the one before it finishes, and waits
for its inputs before reading them; PluginConfig.programmatic_dependent_launch turns it off) must not race:
decoding the same prompts again and again through the CUDA graphs gives the same greedy tokens every time (a race
shows as a run that differs), with it on as without it."""
from __future__ import annotations

import pytest

from kiln import LLM, BuildConfig, SamplingConfig
from kiln.benchmark import shape_config
from kiln.config import PluginConfig, QuantConfig
from kiln.models import LlamaForCausalLM
from kiln.quantization import quantize_model

pytestmark = pytest.mark.gpu
RUNS = 15


@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("algo", [None, "W8A16", "W4A16_AWQ"])
def test_repeated_graph_decode_gives_the_same_tokens(algo, pdl):
    model = LlamaForCausalLM.random(shape_config("smollm2-135m", "float32"), seed=3, std=0.05)
    if algo:
        model = quantize_model(model, QuantConfig(quant_algo=algo), calib_size=2, quiet=True)
    build = BuildConfig(max_batch_size=4, max_input_len=128, max_seq_len=256,
                        plugin_config=PluginConfig(programmatic_dependent_launch=pdl))
    prompts = [list(range(3, 3 + n)) for n in (1, 40, 100)]
    sampling = SamplingConfig(max_new_tokens=16, end_id=-1)
    with LLM(model, build_config=build, device="cuda", quiet=True) as llm:
        assert llm.core.runner.graphs is not None
        runs = [[o.token_ids for o in llm.generate(prompts, sampling)] for _ in range(RUNS)]
    differing = [i for i, run in enumerate(runs) if run != runs[0]]
    assert not differing, f"{algo or 'float32'}, pdl={pdl}: runs {differing} of {RUNS} differ from the first"
