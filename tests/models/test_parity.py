"""Acceptance 1: logits and greedy tokens equal transformers on tiny random models, through all three paths
(HF dir → LLM, checkpoint → LLM, engine → LLM)."""
from __future__ import annotations

import pytest
import torch

from conftest import hf_greedy, hf_logits, tiny_hf_configs
from kiln import LLM, BuildConfig, SamplingConfig, build
from kiln.models import LlamaForCausalLM

BUILD = dict(max_batch_size=4, max_input_len=96, max_seq_len=160, gather_context_logits=True)
PROMPTS = [torch.randint(0, 256, (67,), generator=torch.Generator().manual_seed(1)).tolist(),
           torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(2)).tolist()]


def _llm_for(path_kind: str, hf_dir, tmp_path) -> LLM:
    build_config = BuildConfig(**BUILD)
    if path_kind == "hf":
        return LLM(hf_dir, build_config=build_config, quiet=True)
    LlamaForCausalLM.from_hugging_face(hf_dir, quiet=True).save_checkpoint(tmp_path / "ckpt")
    if path_kind == "checkpoint":
        return LLM(tmp_path / "ckpt", build_config=build_config, quiet=True)
    build(LlamaForCausalLM.from_checkpoint(tmp_path / "ckpt"), build_config, quiet=True).save(tmp_path / "engine")
    return LLM(tmp_path / "engine", quiet=True)


@pytest.mark.parametrize("path_kind", ["hf", "checkpoint", "engine"])
@pytest.mark.parametrize("name", list(tiny_hf_configs()))
def test_logits_and_greedy_match_transformers(name, path_kind, tiny_models, tmp_path):
    hf_dir, hf_model = tiny_models[name]
    llm = _llm_for(path_kind, hf_dir, tmp_path)
    outputs = llm.generate(PROMPTS, SamplingConfig(max_new_tokens=32, end_id=-1))
    for prompt, out in zip(PROMPTS, outputs):
        ref = hf_logits(hf_model, prompt)
        assert out.context_logits.shape == ref.shape
        assert (out.context_logits - ref).abs().max() <= 1e-4 * ref.abs().max()
        assert out.token_ids == hf_greedy(hf_model, prompt, 32)
        assert out.finish_reason == "length"


def test_sliding_window_is_exercised(tiny_models):
    """The Mistral model's window (24) is shorter than the long prompt, so the window path is really tested."""
    _, hf_model = tiny_models["mistral"]
    assert hf_model.config.sliding_window < len(PROMPTS[0])


def test_mixtral_routes_to_several_experts(tiny_models):
    """Each token goes to top_k=2 of 4 experts, and every expert gets tokens in the long prompt."""
    _, hf_model = tiny_models["mixtral"]
    with torch.no_grad():
        out = hf_model(torch.tensor([PROMPTS[0]]), output_router_logits=True)
    chosen = out.router_logits[0].topk(2, dim=-1).indices.unique()
    assert chosen.numel() == 4
