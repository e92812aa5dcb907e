"""Speculative decoding on the GPU (issue 30): an engine built with max_draft_len captures a CUDA graph per batch
bucket and draft count (k = 1..max_draft_len), steps that verify drafts replay them, and the greedy tokens are those
of decoding without drafts on the GPU."""
from __future__ import annotations

import pytest

from kiln import LLM, BuildConfig, SamplingConfig, SpeculativeConfig

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], list(range(40, 90)), list(range(100, 109)),
           [72, 101, 108, 108, 111] * 6]


@pytest.mark.gpu
def test_speculative_steps_replay_their_graphs_and_keep_the_tokens(tiny_models, monkeypatch):
    from kiln.runtime.cuda_graphs import VerifyGraphs

    hf_dir = tiny_models["llama"][0]
    build = BuildConfig(max_batch_size=4, max_input_len=64, max_seq_len=160, max_draft_len=3)
    greedy = SamplingConfig(max_new_tokens=60, end_id=-1)
    with LLM(hf_dir, build_config=build, quiet=True, device="cuda") as llm:
        plain = [o.token_ids for o in llm.generate(PROMPTS, greedy)]
        graphs = llm.core.runner.verify_graphs
        assert set(graphs.graphs) == {(size, q) for size in (1, 2, 4) for q in (2, 3, 4)}
    replays = []
    run = VerifyGraphs.run
    monkeypatch.setattr(VerifyGraphs, "run", lambda self, step, fill=None: replays.append(step.max_query_len) or
                        run(self, step, fill))
    with LLM(hf_dir, build_config=build, quiet=True, device="cuda",
             speculative_config=SpeculativeConfig(max_draft_len=3)) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == plain
        assert [llm.generate(p, greedy).token_ids for p in PROMPTS] == plain
        assert llm.stats()["accepted_draft_tokens"] > 0
    assert replays and set(replays) <= {2, 3, 4}
