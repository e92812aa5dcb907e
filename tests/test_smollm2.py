"""Acceptance 2: the embedded SmolLM2-135M-Instruct gives the same 48 greedy tokens as transformers loading the
same GGUF file, for three prompts, with and without the chat template."""
from __future__ import annotations

import pytest
import torch

from kiln import LLM, BuildConfig, SamplingConfig
from kiln.utils.default_model import default_model_path

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


@pytest.fixture(scope="module")
def gguf():
    try:
        return default_model_path()
    except FileNotFoundError as err:
        pytest.fail(f"{err} (the test suite needs the embedded default model)")


@pytest.fixture(scope="module")
def hf(gguf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    return model, tokenizer


@pytest.fixture(scope="module")
def llm(gguf):
    return LLM(gguf, build_config=BuildConfig(max_batch_size=8, max_input_len=256, max_seq_len=512), quiet=True)


def _hf_generate(model, ids: list[int]) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=48, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("chat", [False, True])
def test_greedy_matches_transformers(hf, llm, chat):
    model, tokenizer = hf
    if chat:
        prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
        ref_prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                          tokenize=True, return_dict=True)["input_ids"]) for p in PROMPTS]
        assert prompts == ref_prompts
    else:
        prompts = PROMPTS
        ref_prompts = [tokenizer(p).input_ids for p in PROMPTS]
    outputs = llm.generate(prompts, SamplingConfig(max_new_tokens=48))
    for ref_ids, out in zip(ref_prompts, outputs):
        assert out.prompt_token_ids == ref_ids
        expected = _hf_generate(model, ref_ids)
        assert out.token_ids == expected
        assert out.text == tokenizer.decode(expected, skip_special_tokens=True)
    if chat:  # the instruct model answers the question, then stops on its end-of-turn token
        assert "Paris" in outputs[0].text
        assert any(o.finish_reason == "stop" for o in outputs)
