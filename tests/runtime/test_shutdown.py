"""Shutting an LLM down frees what its engine held on the device (weights, KV cache, graphs), also while the LLM
object lives on: a second model can be loaded after the first in one process. Its statistics stay readable; a later
request, or saving its engine, fails with a clear error."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from kiln import LLM, SamplingConfig


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_shutdown_frees_the_engine(tiny_models, device, tmp_path):
    hf_dir, _ = tiny_models["llama"]
    with LLM(hf_dir, device=device, quiet=True) as llm:
        assert len(llm.generate([1, 2, 3], SamplingConfig(max_new_tokens=4, end_id=-1)).outputs[0].token_ids) == 4
        weights = [weakref.ref(p) for p in llm.core.runner.net.parameters()] + \
            [weakref.ref(t) for t in llm.core.runner.kv_caches] + \
            [weakref.ref(t) for t in llm.engine.weights[0].values()]
        used = torch.cuda.memory_allocated() if device == "cuda" else 0
    gc.collect()
    assert weights and all(ref() is None for ref in weights)
    if device == "cuda":
        assert torch.cuda.memory_allocated() < used
    assert llm.stats()["steps"] > 0
    with pytest.raises(RuntimeError, match="shut down|stopped"):
        llm.generate([1, 2, 3], SamplingConfig(max_new_tokens=4, end_id=-1))
    with pytest.raises(RuntimeError, match="shut down"):
        llm.save(tmp_path / "engine")
    assert not (tmp_path / "engine").exists()
