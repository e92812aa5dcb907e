"""The in-flight batching runtime end to end on tiny models (issue 3 acceptance 1-5) against transformers."""
from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch

from conftest import end_token_unset, hf_greedy, make_tokenizer
from kiln import LLM, BuildConfig, KvCacheConfig, SamplingConfig, SchedulerPolicy
from kiln.models import LlamaForCausalLM
from kiln.runtime.detokenizer import IncrementalDetokenizer

MAX_SEQ = 512


def _requests(count: int, seed: int, max_prompt: int = 300, max_new: int = 24):
    rng = random.Random(seed)
    return [([rng.randrange(0, 256) for _ in range(rng.randint(1, max_prompt))], rng.randint(1, max_new))
            for _ in range(count)]


@pytest.fixture(scope="module")
def llama(tiny_models):
    hf_dir, hf_model = tiny_models["llama"]
    return LlamaForCausalLM.from_hugging_face(hf_dir, quiet=True), hf_model


@pytest.fixture(scope="module")
def reference(llama):
    """transformers greedy output of every request, each run alone."""
    _, hf_model = llama
    return [hf_greedy(hf_model, prompt, n) for prompt, n in _requests(24, seed=0)]


def _llm(model, tokens_per_block=32, chunked=False, reuse=False, max_num_tokens=None, **kwargs) -> LLM:
    build = BuildConfig(max_batch_size=8, max_input_len=300, max_seq_len=MAX_SEQ,
                        max_num_tokens=max_num_tokens or (64 if chunked else 300),
                        plugin_config={"tokens_per_block": tokens_per_block})
    kv = kwargs.pop("kv_cache_config", KvCacheConfig(enable_block_reuse=reuse))
    return LLM(model, build_config=build, kv_cache_config=kv, enable_chunked_context=chunked, quiet=True, **kwargs)


def _submit(llm: LLM, requests, staggered: bool) -> list:
    """All at once, or in a shuffled order with pauses so that requests join a running batch."""
    order = list(range(len(requests)))
    if staggered:
        random.Random(1).shuffle(order)
    results = [None] * len(requests)
    for k, i in enumerate(order):
        prompt, n = requests[i]
        results[i] = llm.generate_async(prompt, SamplingConfig(max_new_tokens=n, end_id=-1))
        if staggered and k % 4 == 3:
            time.sleep(0.02)
    return [r.result(timeout=300).token_ids for r in results]


@pytest.mark.parametrize("tokens_per_block", [16, 64])
@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
@pytest.mark.parametrize("reuse", [False, True], ids=["noreuse", "reuse"])
def test_batching_invariance(llama, reference, tokens_per_block, chunked, reuse):
    model, _ = llama
    requests = _requests(24, seed=0)
    with _llm(model, tokens_per_block, chunked, reuse) as llm:
        for staggered in (False, True):
            assert _submit(llm, requests, staggered) == reference
        stats = llm.stats()
        assert stats["kv_blocks_used"] == 0 and stats["running_requests"] == 0
        if chunked:
            assert stats["tokens_per_step"] <= 64


@pytest.mark.parametrize("chunked, reuse", [(False, False), (True, True)], ids=["whole", "chunked-reuse"])
def test_overlapped_steps_change_nothing(llama, reference, chunked, reuse):
    """enable_trt_overlap: step N+1 is scheduled and launched before step N's tokens are read; greedy outputs,
    stop tokens, stop strings, streaming, sampling mixed in, aborts and the KV pool all end as without it."""
    model, _ = llama
    requests = _requests(24, seed=0)
    with _llm(model, 16, chunked, reuse, enable_trt_overlap=True) as llm:
        for staggered in (False, True):
            assert _submit(llm, requests, staggered) == reference
        mixed = [SamplingConfig(max_new_tokens=12, end_id=7), SamplingConfig(max_new_tokens=12, stop_token_ids=[3]),
                 SamplingConfig(max_new_tokens=12, temperature=0.8, random_seed=2),
                 SamplingConfig(max_new_tokens=12, n=2, temperature=0.8, random_seed=3),
                 SamplingConfig(max_new_tokens=12, min_tokens=4, end_id=7)]
        prompts = [prompt for prompt, _ in requests[:len(mixed)]]
        overlapped = [r.result(timeout=300) for r in [llm.generate_async(p, c) for p, c in zip(prompts, mixed)]]
        streamed = [out.token_ids_diff for out in llm.generate_async(prompts[0], mixed[0], streaming=True)]
        aborted = llm.generate_async(prompts[1], SamplingConfig(max_new_tokens=200, end_id=-1))
        aborted.abort()
        assert aborted.result(timeout=60).outputs[0].finish_reason == "abort"
        stats = llm.stats()
        assert stats["kv_blocks_used"] == 0 and stats["overlapped_steps"] > 0.5 * stats["steps"], stats
    with _llm(model, 16, chunked, reuse) as llm:
        plain = [r.result(timeout=300) for r in [llm.generate_async(p, c) for p, c in zip(prompts, mixed)]]
    for a, b in zip(overlapped, plain):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        assert [o.finish_reason for o in a.outputs] == [o.finish_reason for o in b.outputs]
    assert [t for diff in streamed for t in diff] == plain[0].token_ids


@pytest.mark.parametrize("policy, overlap", [(SchedulerPolicy.GUARANTEED_NO_EVICT, False),
                                             (SchedulerPolicy.MAX_UTILIZATION, False),
                                             (SchedulerPolicy.GUARANTEED_NO_EVICT, True)])
def test_small_pool_completes_every_request(llama, reference, policy, overlap):
    """Also with overlapped steps: a sequence holding its last token is not scheduled again, so the pool the
    reservation counted on is never exceeded (a preemption there would recompute a token not read yet)."""
    model, _ = llama
    requests = _requests(24, seed=0)
    small = KvCacheConfig(max_tokens=640)              # 20 blocks of 32: a few requests at a time
    with _llm(model, kv_cache_config=small, scheduling_policy=policy, enable_trt_overlap=overlap) as llm:
        assert _submit(llm, requests, staggered=False) == reference
        preemptions = llm.stats()["preemptions"]
    if policy is SchedulerPolicy.MAX_UTILIZATION:
        assert preemptions > 0
    else:
        assert preemptions == 0


def test_block_reuse_computes_only_new_tokens(llama):
    model, hf_model = llama
    prefix = [random.Random(5).randrange(256) for _ in range(200)]
    with _llm(model, tokens_per_block=16, reuse=True) as llm:
        first = llm.generate(prefix + [1, 2, 3], SamplingConfig(max_new_tokens=8, end_id=-1))
        before = llm.stats()["scheduled_tokens"]
        second = llm.generate(prefix + [4, 5], SamplingConfig(max_new_tokens=8, end_id=-1))
        computed = llm.stats()["scheduled_tokens"] - before
        assert second.num_cached_prompt_tokens == 192 and first.num_cached_prompt_tokens == 0
        assert computed == (202 - 192) + 7          # the new prompt tokens, then one token per step
        assert second.token_ids == hf_greedy(hf_model, prefix + [4, 5], 8)
        assert llm.stats()["prefix_cache_hit_rate"] > 0.4 and llm.stats()["kv_blocks_used"] == 0


def test_random_500_request_run_with_aborts_frees_every_block(llama):
    model, _ = llama
    rng = random.Random(6)
    with _llm(model, tokens_per_block=16, reuse=True, chunked=True, kv_cache_config=KvCacheConfig(
            max_tokens=2048, enable_block_reuse=True), scheduling_policy=SchedulerPolicy.MAX_UTILIZATION) as llm:
        results = []
        for prompt, n in _requests(500, seed=7, max_prompt=100, max_new=8):
            sampling = SamplingConfig(max_new_tokens=n, n=rng.choice([1, 1, 2]), temperature=0.9, random_seed=1)
            results.append(llm.generate_async(prompt, sampling))
            if rng.random() < 0.3:
                results[rng.randrange(len(results))].abort()
        outputs = [r.result(timeout=300) for r in results]
        assert any(o.finish_reason == "abort" for o in outputs)
        assert all(o.finished for o in outputs)
        stats = llm.stats()
        assert stats["kv_blocks_used"] == 0 and stats["running_requests"] == 0 and stats["waiting_requests"] == 0


@pytest.mark.parametrize("length_penalty, early_stopping", [(1.0, False), (0.5, True), (2.0, "never")])
def test_beam_search_matches_transformers(tiny_models, length_penalty, early_stopping):
    hf_dir, hf_model = tiny_models["qwen2"]
    prompts = [list(range(40, 60)), [3, 1, 4, 1, 5, 9, 2, 6]]
    # An end token the beams really produce: the third greedy token of the first prompt.
    end_id = hf_greedy(hf_model, prompts[0], 3)[2]
    build = BuildConfig(max_batch_size=4, max_beam_width=4, max_input_len=64, max_seq_len=128)
    with LLM(hf_dir, build_config=build, quiet=True) as llm:
        for prompt in prompts:
            sampling = SamplingConfig(max_new_tokens=12, num_beams=4, end_id=end_id, length_penalty=length_penalty,
                                      early_stopping=early_stopping)
            out = llm.generate(prompt, sampling)
            ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, num_beams=4, do_sample=False,
                                    length_penalty=length_penalty, early_stopping=early_stopping,
                                    pad_token_id=end_id, eos_token_id=end_id)[0, len(prompt):].tolist()
            while ref and ref[-1] == end_id and ref.count(end_id) > 1:   # drop transformers' right padding
                ref.pop()
            assert out.token_ids == ref
            assert len(out.outputs) == 4


def test_sampling_seeds_top_k_and_n(llama):
    model, _ = llama
    prompt = list(range(10, 30))
    with _llm(model) as llm:
        greedy = llm.generate(prompt, SamplingConfig(max_new_tokens=16, end_id=-1)).token_ids
        top1 = llm.generate(prompt, SamplingConfig(max_new_tokens=16, end_id=-1, temperature=1.3, top_k=1))
        assert top1.token_ids == greedy
        seeded = lambda seed: llm.generate(prompt, SamplingConfig(  # noqa: E731
            max_new_tokens=16, end_id=-1, temperature=1.5, top_p=0.95, random_seed=seed)).token_ids
        assert seeded(3) == seeded(3)
        assert len({tuple(seeded(s)) for s in range(4)}) == 4
        batch = llm.generate([prompt] * 3, [SamplingConfig(max_new_tokens=16, end_id=-1, temperature=1.5,
                                                           top_p=0.95, random_seed=3)] * 3)
        assert all(o.token_ids == seeded(3) for o in batch)      # same seed, same tokens, whatever the batch
        many = llm.generate(prompt, SamplingConfig(max_new_tokens=16, end_id=-1, temperature=1.5, random_seed=3, n=3))
        assert [o.index for o in many.outputs] == [0, 1, 2]
        assert len({tuple(o.token_ids) for o in many.outputs}) == 3


def test_seeded_sampling_does_not_depend_on_the_batch(llama):
    model, _ = llama
    prompt = list(range(10, 30))
    sampling = SamplingConfig(max_new_tokens=16, end_id=-1, temperature=1.2, top_k=50, random_seed=11)
    with _llm(model) as llm:
        alone = llm.generate(prompt, sampling).token_ids
        others = [llm.generate_async(p, SamplingConfig(max_new_tokens=n, temperature=1.0))
                  for p, n in _requests(6, seed=2, max_prompt=50)]
        mixed = llm.generate(prompt, sampling).token_ids
        [o.result() for o in others]
    assert mixed == alone


def test_stop_strings_end_the_text_exactly(tiny_models):
    hf_dir, _ = tiny_models["llama"]
    with LLM(hf_dir, build_config=BuildConfig(max_input_len=64, max_seq_len=128), quiet=True) as llm:
        sampling = dict(max_new_tokens=30, end_id=-1, temperature=1.0, random_seed=0)
        full = llm.generate("abcdefgh", SamplingConfig(**sampling))
        text = full.text
        start = next(i for i in range(3, len(text) - 2) if "\ufffd" not in text[i:i + 2]
                     and text.find(text[i:i + 2]) == i)
        stop = text[start:start + 2]
        cut = llm.generate("abcdefgh", SamplingConfig(**sampling, stop=["never-there", stop]))
        assert cut.text == text[:start] and len(cut.text) < len(text)
        assert cut.finish_reason == "stop" and cut.outputs[0].stop_reason == stop
        stop_id = full.token_ids[5]
        by_id = llm.generate("abcdefgh", SamplingConfig(**sampling, stop_token_ids=[stop_id]))
        assert by_id.token_ids == full.token_ids[:full.token_ids.index(stop_id) + 1]
        assert by_id.finish_reason == "stop" and by_id.outputs[0].stop_reason == stop_id


def test_chat_applies_the_chat_template(tiny_models):
    hf_dir, _ = tiny_models["llama"]
    greedy = SamplingConfig(max_new_tokens=8, end_id=-1)
    hello = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    bye = [{"role": "user", "content": "Bye"}]
    with LLM(hf_dir, build_config=BuildConfig(max_input_len=64, max_seq_len=128), quiet=True) as llm:
        one = llm.chat(hello, greedy)
        assert one.token_ids == llm.generate(llm.apply_chat_template(hello), greedy).token_ids
        assert llm.tokenizer.decode(one.prompt_token_ids) == "<|system|>Be brief.</s><|user|>Hello</s><|assistant|>"
        both = llm.chat([hello, bye], greedy)
        assert [o.token_ids for o in both] == [one.token_ids, llm.chat(bye, greedy).token_ids]
        for bad in ([], [{"role": "user"}], "Hello", [[]]):
            with pytest.raises(ValueError, match="chat takes a conversation"):
                llm.chat(bad, greedy)


def test_default_sampling_comes_from_generation_config(tiny_models, tmp_path):
    import json
    import shutil

    hf_dir = tmp_path / "model"
    shutil.copytree(tiny_models["llama"][0], hf_dir)
    build = BuildConfig(max_input_len=64, max_seq_len=128)
    with LLM(hf_dir, build_config=build, quiet=True) as llm:
        assert llm.get_default_sampling_config() == SamplingConfig()          # bos/eos/pad only: greedy
    config_file = hf_dir / "generation_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "do_sample": False, "temperature": 0.6, "repetition_penalty": 1.3}))
    with LLM(hf_dir, build_config=build, quiet=True) as llm:
        assert llm.get_default_sampling_config() == SamplingConfig(repetition_penalty=1.3)   # greedy, penalised
        penalised = SamplingConfig(repetition_penalty=1.3)
        assert llm.generate("abc").token_ids == llm.generate("abc", penalised).token_ids
        assert llm.chat([{"role": "user", "content": "hi"}]).token_ids == \
            llm.chat([{"role": "user", "content": "hi"}], penalised).token_ids
    config_file.write_text(json.dumps({**config, "do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 0}))
    with LLM(hf_dir, build_config=build, quiet=True) as llm:
        assert llm.get_default_sampling_config() == SamplingConfig(temperature=0.6, top_p=0.9)


def test_min_tokens_and_logprobs(llama):
    model, hf_model = llama
    prompt = list(range(50, 70))
    greedy = hf_greedy(hf_model, prompt, 10)
    with _llm(model) as llm:
        early = llm.generate(prompt, SamplingConfig(max_new_tokens=10, end_id=greedy[1]))
        assert early.token_ids == greedy[:2] and early.finish_reason == "stop"
        held = llm.generate(prompt, SamplingConfig(max_new_tokens=10, end_id=greedy[1], min_tokens=5))
        assert len(held.token_ids) >= 5 and greedy[1] not in held.token_ids[:4]
        scored = llm.generate(prompt, SamplingConfig(max_new_tokens=4, end_id=-1, logprobs=3))
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + greedy[:3]])).logits[0, len(prompt) - 1:].float()
    ref = torch.log_softmax(logits, -1)
    for i, entry in enumerate(scored.logprobs):
        assert entry.token_id == greedy[i] and abs(entry.logprob - ref[i, greedy[i]].item()) < 1e-4
        assert len(entry.top) == 3 and entry.token_id in entry.top
    assert abs(scored.cumulative_logprob - sum(e.logprob for e in scored.logprobs)) < 1e-5


def test_repetition_penalty_matches_transformers(llama):
    model, hf_model = llama
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    with _llm(model) as llm:
        out = llm.generate(prompt, SamplingConfig(max_new_tokens=12, end_id=-1, repetition_penalty=1.5))
    with end_token_unset(hf_model):
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, repetition_penalty=1.5,
                                pad_token_id=0)[0, len(prompt):].tolist()
    assert out.token_ids == ref


def test_filters_match_transformers_warpers():
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from kiln.runtime.sampler import filtered_logits
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(1, 300, generator=g) * 3
        for sampling, warper in ((SamplingConfig(top_k=17), TopKLogitsWarper(17)),
                                 (SamplingConfig(top_p=0.8), TopPLogitsWarper(0.8)),
                                 (SamplingConfig(min_p=0.1), MinPLogitsWarper(0.1))):
            ours = torch.isinf(filtered_logits(logits[0], sampling))
            theirs = torch.isinf(warper(None, logits.clone())[0])
            assert torch.equal(ours, theirs)


def test_streaming_deltas_add_up_to_the_text(tiny_models):
    hf_dir, _ = tiny_models["llama"]

    async def main(llm):
        async def one(i):
            result = llm.generate_async(f"prompt {i} é 日本", SamplingConfig(max_new_tokens=40, end_id=-1,
                                                                            temperature=1.0, random_seed=i),
                                        streaming=True)
            deltas, count = [], 0
            async for output in result:
                deltas.append(output.text_diff)
                count += 1
            final = await result
            return "".join(deltas), final, count

        return await asyncio.gather(*(one(i) for i in range(20)))

    with LLM(hf_dir, build_config=BuildConfig(max_batch_size=8, max_input_len=64, max_seq_len=128),
             quiet=True) as llm:
        results = asyncio.run(main(llm))
    non_ascii = 0
    for joined, final, count in results:
        assert joined == final.text and count > 1
        assert final.text == llm.tokenizer.decode(final.token_ids, skip_special_tokens=True)
        non_ascii += any(ord(c) > 127 for c in final.text)
    assert non_ascii > 0


def test_detokenizer_never_splits_a_character():
    tokenizer = make_tokenizer()
    text = "héllo wörld — 日本語 🎉 done"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text)                     # multi-byte characters span several tokens
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt: "))
    pieces = [detok.push([t]) for t in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_abort_sync_iteration_stats_and_shutdown(llama):
    model, _ = llama
    llm = _llm(model)
    result = llm.generate_async(list(range(10, 20)), SamplingConfig(max_new_tokens=200, end_id=-1), streaming=True)
    first = next(iter(result))
    result.abort()
    final = result.result(timeout=60)
    assert final.finish_reason == "abort" and len(final.token_ids) < 200 and not first.finished
    assert final.metrics.time_to_first_token is not None and final.metrics.e2e_latency is not None
    done = llm.generate(list(range(10, 20)), SamplingConfig(max_new_tokens=5, end_id=-1))
    assert done.metrics.time_per_output_token is not None
    stats = llm.stats()
    assert {"running_requests", "waiting_requests", "kv_blocks_used", "kv_blocks_free", "prefix_cache_hit_rate",
            "tokens_per_step"} <= set(stats) and stats["kv_blocks_used"] == 0
    llm.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([1, 2, 3])


def test_decoding_mode_and_request_limits(llama):
    from kiln import DecodingMode

    model, _ = llama
    with _llm(model, decoding_mode=DecodingMode.top_k) as llm:
        with pytest.raises(ValueError, match="decoding_mode=top_k does not accept top_p"):
            llm.generate([1, 2], SamplingConfig(top_p=0.5))
        with pytest.raises(ValueError, match="num_beams=2 exceeds the engine's max_beam_width=1"):
            llm.generate([1, 2], SamplingConfig(num_beams=2))
        with pytest.raises(ValueError, match="may need .* KV-cache blocks"):
            LLM(model, build_config=BuildConfig(max_input_len=64, max_seq_len=128), quiet=True,
                kv_cache_config=KvCacheConfig(max_tokens=128)).generate([1, 2], SamplingConfig(max_new_tokens=60, n=4))
    with pytest.raises(ValueError, match="enable_chunked_context=True is needed"):
        LLM(model, build_config=BuildConfig(max_input_len=64, max_seq_len=128, max_num_tokens=32), quiet=True)
    with pytest.raises(ValueError, match="enable_trt_overlap=True needs scheduling_policy=GUARANTEED_NO_EVICT"):
        LLM(model, enable_trt_overlap=True, scheduling_policy=SchedulerPolicy.MAX_UTILIZATION, quiet=True)


def test_decode_partitions_fill_the_gpu():
    """Split-K partitions: long sequences split at 512 keys; batches too small to fill the GPU split into
    partitions of ≥ 64 keys so that ~BUSY_PROGRAMS programs of the Triton kernel (four warps a program) or
    ~BUSY_WARPS one-warp programs (mma.sync over an 8-bit cache) run."""
    from kiln.kernels.triton.partitions import decode_partitions

    assert decode_partitions(512 * 8, 256, False) == (1, None)
    assert decode_partitions(8, 4096, False) == (32, 128)          # ceil(4096·8 / 264) = 125 → 128 keys
    assert decode_partitions(8, 256, False) == (4, 64)             # batch 1 of the 8B shape: 32 programs
    assert decode_partitions(256 * 8, 2048, False) == (4, 512)
    assert decode_partitions(8, 64, False) == (1, None)
    assert decode_partitions(512 * 8, 256, True) == (1, None)
    assert decode_partitions(8, 1024, True) == (16, 64)            # one sequence: 16 partitions of 64 keys
    assert decode_partitions(32 * 8, 1024, True) == (8, 128)       # ceil(1024·256 / 2048) = 128 keys
    assert decode_partitions(256 * 8, 2048, True) == (4, 512)
    assert decode_partitions(8, 64, True) == (1, None)
    _partitions_cover_the_keys(one_warp=False)
    _partitions_cover_the_keys(one_warp=True)


def _partitions_cover_the_keys(one_warp: bool) -> None:
    """Every split has whole steps (16 keys for one warp, a 64-key tile otherwise) and no empty last partition."""
    from kiln.kernels.triton.partitions import decode_partitions

    unit = 16 if one_warp else 64
    for programs in (1, 8, 100, 1000, 3000):
        for keys in (1, 63, 65, 700, 5000, 100000):
            parts, part = decode_partitions(programs, keys, one_warp)
            assert parts == 1 or (part % unit == 0 and (parts - 1) * part < keys <= parts * part)


def test_gc_threshold_is_raised_while_serving_and_restored(llama):
    """garbage_collection_gen0_threshold (TensorRT-LLM's option): Python's gen-0 threshold while the LLM serves,
    the previous one back after shutdown; a threshold below 1 is rejected before anything loads."""
    import gc

    model, _ = llama
    before = gc.get_threshold()
    with _llm(model, garbage_collection_gen0_threshold=12345) as llm:
        assert gc.get_threshold() == (12345, *before[1:])
        assert llm.generate([[1, 2, 3]], SamplingConfig(max_new_tokens=2))[0].outputs[0].token_ids
    assert gc.get_threshold() == before
    with _llm(model, garbage_collection_gen0_threshold=None):
        assert gc.get_threshold() == before
    with pytest.raises(ValueError, match="garbage_collection_gen0_threshold=0"):
        _llm(model, garbage_collection_gen0_threshold=0)
    assert gc.get_threshold() == before
