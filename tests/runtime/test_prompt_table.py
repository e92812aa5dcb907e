"""Prompt tables (TensorRT-LLM's prompt tuning): prompt token id vocab_size + i is row i of the request's table.
Checked against transformers fed the same embeddings (inputs_embeds), and against the real tokens whose embeddings
a table repeats; tables key the prefix cache apart, work in chunked prompts and in a batch beside plain requests."""
from __future__ import annotations

import pytest
import torch

from kiln import LLM, BuildConfig, KvCacheConfig, SamplingConfig
from kiln.config import PluginConfig
from conftest import VOCAB, end_token_unset

GREEDY = SamplingConfig(max_new_tokens=8, end_id=-1)
BUILD = BuildConfig(max_input_len=64, max_seq_len=96, max_prompt_embedding_table_size=8,
                    plugin_config=PluginConfig(tokens_per_block=16))


def _hf_greedy_from_embeds(model, embeds: torch.Tensor, max_new_tokens: int) -> list[int]:
    with end_token_unset(model), torch.no_grad():
        out = model.generate(inputs_embeds=embeds[None], attention_mask=torch.ones(1, len(embeds), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, -max_new_tokens:].tolist()


@pytest.fixture(scope="module")
def llama(tiny_models):
    hf_dir, model = tiny_models["llama"]
    llm = LLM(str(hf_dir), build_config=BUILD, enable_chunked_context=True, quiet=True,
              kv_cache_config=KvCacheConfig(enable_block_reuse=True))
    yield llm, model
    llm.shutdown()


def test_rows_of_real_embeddings_give_those_tokens_output(llama):
    llm, model = llama
    real = [40, 41, 42, 43]
    table = model.get_input_embeddings().weight[real].detach()
    prompt = [5, 6, VOCAB, VOCAB + 1, VOCAB + 2, VOCAB + 3, 7]
    assert llm.generate(prompt, GREEDY, prompt_table=table).token_ids == \
        llm.generate([5, 6, *real, 7], GREEDY).token_ids


def test_a_table_equals_transformers_fed_its_embeddings(llama):
    llm, model = llama
    torch.manual_seed(1)
    tables = [torch.randn(3, 64) * 0.05 for _ in range(2)]
    prompt = [9, VOCAB + 2, VOCAB, 10, VOCAB + 1, 11]
    outs = [llm.generate(prompt, GREEDY, prompt_table=t).token_ids for t in tables]
    for table, out in zip(tables, outs):
        embeds = model.get_input_embeddings().weight[[9, 0, 0, 10, 0, 11]].detach().clone()
        embeds[[1, 2, 4]] = table[[2, 0, 1]]
        assert out == _hf_greedy_from_embeds(model, embeds, 8)
    assert outs[0] != outs[1]                                       # a different table changes the output


def test_tables_key_the_prefix_cache_and_chunk_with_the_prompt(llama):
    llm, model = llama
    torch.manual_seed(2)
    stacked = torch.randn(2, 4, 64) * 0.05                          # two tasks of 4 rows
    prompt = [VOCAB + i % 4 for i in range(40)] + [12, 13]          # over two 16-token blocks
    alone = [llm.generate(prompt, GREEDY, prompt_table=stacked, prompt_tasks=task).token_ids for task in (0, 1)]
    assert alone[0] != alone[1]
    again = llm.generate([prompt, prompt, [5, 6, 7]], GREEDY, prompt_table=[stacked, stacked, None],
                         prompt_tasks=[1, 0, None])
    assert [o.token_ids for o in again[:2]] == alone[::-1]          # nothing reused across tables
    assert all(o.num_cached_prompt_tokens >= 32 for o in again[:2])  # but reused within a table
    stats = llm.generate(prompt, SamplingConfig(max_new_tokens=8, end_id=-1, repetition_penalty=1.3),
                         prompt_table=stacked[0])                  # penalties skip the table's ids
    assert len(stats.token_ids) == 8 and isinstance(stats.text, str)


def test_chunked_prompt_with_table_rows_in_every_chunk(tiny_models):
    hf_dir, model = tiny_models["llama"]
    torch.manual_seed(3)
    table = torch.randn(8, 64) * 0.05
    prompt = [VOCAB + i % 8 if i % 3 else 20 + i for i in range(50)]
    embeds = model.get_input_embeddings().weight[[t if t < VOCAB else 0 for t in prompt]].detach().clone()
    rows = [i for i, t in enumerate(prompt) if t >= VOCAB]
    embeds[rows] = table[[prompt[i] - VOCAB for i in rows]]
    build = BuildConfig(max_input_len=64, max_seq_len=96, max_num_tokens=16, max_prompt_embedding_table_size=8)
    with LLM(str(hf_dir), build_config=build, enable_chunked_context=True, quiet=True) as llm:
        assert llm.generate(prompt, GREEDY, prompt_table=table).token_ids == _hf_greedy_from_embeds(model, embeds, 8)


def test_prompt_table_misuse_is_refused(llama, tiny_models):
    llm, _ = llama
    table = torch.zeros(4, 64)
    with pytest.raises(ValueError, match=rf"prompt token id {VOCAB + 4} is not in the vocabulary \[0, {VOCAB}\) or "
                                         rf"the prompt table's ids \[{VOCAB}, {VOCAB + 4}\)"):
        llm.generate([VOCAB + 4], GREEDY, prompt_table=table)
    with pytest.raises(ValueError, match=f"prompt token id {VOCAB} is not in the vocabulary"):
        llm.generate([VOCAB], GREEDY)
    with pytest.raises(ValueError, match="the model's hidden_size is 64"):
        llm.generate([VOCAB], GREEDY, prompt_table=torch.zeros(4, 32))
    with pytest.raises(ValueError, match="takes 1 to max_prompt_embedding_table_size=8"):
        llm.generate([VOCAB], GREEDY, prompt_table=torch.zeros(9, 64))
    with pytest.raises(ValueError, match="must pick one of the table's 2 tasks"):
        llm.generate([VOCAB], GREEDY, prompt_table=torch.zeros(2, 4, 64), prompt_tasks=2)
    with pytest.raises(ValueError, match="no prompt_table was given"):
        llm.generate([5], GREEDY, prompt_tasks=1)
    with pytest.raises(ValueError, match="not finite"):
        llm.generate([VOCAB], GREEDY, prompt_table=torch.full((4, 64), float("nan")))
    with pytest.raises(ValueError, match="2 prompt tables and 2 prompt tasks for 3 prompts"):
        llm.generate([[5], [6], [7]], GREEDY, prompt_table=[table, table], prompt_tasks=[0, 0])
    with LLM(str(tiny_models["llama"][0]), build_config=BuildConfig(max_input_len=16, max_seq_len=32),
             quiet=True) as plain:
        with pytest.raises(ValueError, match="built with max_prompt_embedding_table_size=0"):
            plain.generate([VOCAB], GREEDY, prompt_table=table)


def test_short_table_prompts_beside_drafting_requests(tiny_models):
    """On an engine sized for drafts (on a GPU: verify graphs for steps of 2..k+1 tokens a sequence), a 3-token
    prompt of table ids still embeds its rows, and its request decodes without drafts beside one that drafts."""
    from kiln.config import SpeculativeConfig

    hf_dir, model = tiny_models["llama"]
    torch.manual_seed(4)
    table = torch.randn(3, 64) * 0.05
    embeds = table[[0, 1, 2]]
    with LLM(str(hf_dir), build_config=BUILD, quiet=True,
             speculative_config=SpeculativeConfig(method="ngram", max_draft_len=2)) as llm:
        alone = llm.generate([VOCAB, VOCAB + 1, VOCAB + 2], GREEDY, prompt_table=table)
        both = llm.generate([[VOCAB, VOCAB + 1, VOCAB + 2], [5, 6, 5, 6, 5, 6]], GREEDY, prompt_table=[table, None])
    assert alone.token_ids == both[0].token_ids == _hf_greedy_from_embeds(model, embeds, 8)
    assert alone.metrics.num_speculative_steps == 0
