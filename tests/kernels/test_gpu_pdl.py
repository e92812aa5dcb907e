"""Programmatic dependent launch (on sm_90+ each Triton kernel starts while the one before it finishes, and waits
for its inputs before reading them; PluginConfig.programmatic_dependent_launch turns it off) must not race:
decoding the same prompts again and again through the CUDA graphs gives the same greedy tokens every time (a race
shows as a run that differs), with it on (`pytest -m gpu`) as without it (the sweep, `-m gpu_slow`)."""
from __future__ import annotations

import pytest

from conftest import gpu_cases, random_smollm2
from kiln import LLM, BuildConfig, SamplingConfig
from kiln.config import PluginConfig

RUNS = 15


@pytest.mark.parametrize("algo, pdl", gpu_cases([(algo, pdl) for pdl in (True, False)
                                                 for algo in (None, "W8A16", "W4A16_AWQ")],
                                                default=[(None, True)]))
def test_repeated_graph_decode_gives_the_same_tokens(algo, pdl):
    model = random_smollm2("float32", 3, algo)
    build = BuildConfig(max_batch_size=4, max_input_len=128, max_seq_len=256,
                        plugin_config=PluginConfig(programmatic_dependent_launch=pdl))
    prompts = [list(range(3, 3 + n)) for n in (1, 40, 100)]
    sampling = SamplingConfig(max_new_tokens=16, end_id=-1)
    with LLM(model, build_config=build, device="cuda", quiet=True) as llm:
        assert llm.core.runner.graphs is not None
        runs = [[o.token_ids for o in llm.generate(prompts, sampling)] for _ in range(RUNS)]
    differing = [i for i, run in enumerate(runs) if run != runs[0]]
    assert not differing, f"{algo or 'float32'}, pdl={pdl}: runs {differing} of {RUNS} differ from the first"
