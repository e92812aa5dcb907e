"""Acceptance 2: the embedded SmolLM2-135M-Instruct gives the same 48 greedy tokens as transformers loading the
same GGUF file, for three prompts, with and without the chat template."""
from __future__ import annotations

import random

import pytest
import torch

from conftest import hf_greedy
from kiln import LLM, BuildConfig, KvCacheConfig, SamplingConfig

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


@pytest.fixture(scope="module")
def hf(smollm2_hf):
    return smollm2_hf


@pytest.fixture(scope="module")
def llm(smollm2_model):
    with LLM(smollm2_model, build_config=BuildConfig(max_batch_size=8, max_input_len=256, max_seq_len=512),
             quiet=True) as llm:
        yield llm


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


TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a wooden screw press. Within decades, printing shops spread from "
        "Mainz to Venice, Paris and London, and the cost of books fell sharply. Scholars could compare identical "
        "copies, merchants printed price lists, and reformers spread pamphlets faster than authorities could "
        "suppress them. ") * 4


@pytest.fixture(scope="module")
def shared_prefix_requests(hf):
    """16 requests (prompt, new tokens) on prefixes of one text (1-300 tokens), twice max_batch_size, and each one's
    transformers output when it runs alone."""
    model, tokenizer = hf
    ids = tokenizer(TEXT).input_ids
    rng = random.Random(0)
    requests = [(ids[:rng.randint(1, 300)], rng.randint(1, 10)) for _ in range(16)]
    return requests, [hf_greedy(model, p, n) for p, n in requests]


@pytest.mark.parametrize("chunked, reuse, tokens_per_block", [(False, False, 16), (False, True, 64),
                                                               (True, False, 64), (True, True, 16)])
def test_batching_invariance_on_smollm2(smollm2_model, shared_prefix_requests, chunked, reuse, tokens_per_block):
    """Every request gives its solo transformers output, submitted together or staggered, with chunked context
    on/off, block reuse on/off and tokens_per_block 16/64: the four builds hold every pair of those three choices
    (the whole grid runs on a tiny model in tests/test_runtime.py)."""
    requests, expected = shared_prefix_requests
    build = BuildConfig(max_batch_size=8, max_input_len=300, max_seq_len=512, max_num_tokens=128 if chunked else 600,
                        plugin_config={"tokens_per_block": tokens_per_block})
    with LLM(smollm2_model, build_config=build, kv_cache_config=KvCacheConfig(enable_block_reuse=reuse),
             enable_chunked_context=chunked, quiet=True) as llm:
        for staggered in (False, True):
            assert _submit(llm, requests, staggered) == expected
        if reuse:
            assert llm.stats()["prefix_cache_hit_tokens"] > 0


def _submit(llm, requests, staggered: bool) -> list[list[int]]:
    """The requests' tokens, all submitted at once, or in a shuffled order waiting for every sixth one."""
    order = list(range(len(requests)))
    if staggered:
        random.Random(1).shuffle(order)
    results = {}
    for k, i in enumerate(order):
        results[i] = llm.generate_async(requests[i][0], SamplingConfig(max_new_tokens=requests[i][1], end_id=-1))
        if staggered and k % 6 == 5:
            results[i].result()
    return [results[i].result().token_ids for i in range(len(requests))]


def test_streaming_non_ascii_on_smollm2(llm):
    import asyncio

    prompts = ["Translate 'thank you very much' into Japanese, Chinese and Korean.",
               "Write the French words for 'coffee', 'summer' and 'Christmas tree' with their accents.",
               "Spell 'naïve café' and 'Straße' exactly."]

    async def main():
        async def one(i):
            ids = llm.apply_chat_template([{"role": "user", "content": prompts[i % 3]}])
            result = llm.generate_async(ids, SamplingConfig(max_new_tokens=24, temperature=0.7, random_seed=i),
                                        streaming=True)
            deltas = [o.text_diff async for o in result]
            return "".join(deltas), await result
        return await asyncio.gather(*(one(i) for i in range(20)))

    results = asyncio.run(main())
    for joined, final in results:
        assert joined == final.text
        assert "\ufffd" not in final.text or final.finish_reason == "length"
    assert sum(any(ord(c) > 127 for c in final.text) for _, final in results) >= 3
