"""One request cannot stop the engine (issue 26): SamplingConfig refuses non-finite and denormal floats, the
sampler never hands torch.multinomial a bad distribution, a request whose sampling or text processing fails
fails alone (its blocks freed, the loop and the other requests going on), and prefix-cache keys cannot be made
to collide."""
from __future__ import annotations

import math

import pytest
import torch

import kiln.runtime.executor as executor
import kiln.runtime.kv_cache as kv_cache
import kiln.runtime.sampler as sampler
from conftest import MARKER, save_tiny_model
from kiln import LLM, BuildConfig, SamplingConfig
from kiln.runtime.request import Sequence

FLOATS = ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
          "length_penalty"]


# --- SamplingConfig -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", FLOATS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e-40, -1e-40, 5e-324, True])
def test_float_fields_must_be_finite_and_normal(name, value):
    with pytest.raises(ValueError, match=f"SamplingConfig.{name}="):
        SamplingConfig(**{name: value})


def test_the_issue_s_configs_are_refused():
    for fields in ({"temperature": 1e-40}, {"temperature": math.inf, "min_tokens": 2},
                   {"repetition_penalty": 1e-40, "temperature": 1.0}, {"length_penalty": 1e3}):
        with pytest.raises(ValueError):
            SamplingConfig(**fields)


def test_tiny_temperatures_decode_greedily():
    assert SamplingConfig(temperature=1e-6).greedy and SamplingConfig(temperature=0.0).greedy
    assert not SamplingConfig(temperature=1e-4).greedy


# --- the sampler -------------------------------------------------------------------------------------

def _logits(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


@pytest.mark.parametrize("logits, sampling, allowed", [
    (_logits(1.0, math.inf, 2.0, math.inf), SamplingConfig(temperature=1.0), {1, 3}),
    (_logits(1.0, math.nan, 3.0, 2.0), SamplingConfig(temperature=1.0, top_p=0.9, min_p=0.1), {0, 2, 3}),
    (_logits(3e38, -3e38, 1.0), SamplingConfig(temperature=1e-4), {0}),
    (_logits(1.0, 50.0, -50.0), SamplingConfig(temperature=2.0, repetition_penalty=1e-37), {0, 1, 2}),
    (_logits(math.nan, 1.0, math.nan), SamplingConfig(temperature=1.0, top_k=2), {1}),
], ids=["+inf", "nan", "overflowing temperature", "overflowing penalty", "nan with top_k"])
@pytest.mark.parametrize("logprobs", [None, 2])
def test_extreme_logits_sample_a_real_token(logits, sampling, allowed, logprobs):
    sampling.logprobs = logprobs
    seq = Sequence([0, 1, 2], 3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        token, entry = sampler.choose(sampler.apply_penalties(logits, seq, sampling), sampling, generator, False)
        assert int(token) in allowed
        assert entry is None or math.isfinite(entry.logprob)


@pytest.mark.parametrize("row", [_logits(math.nan, math.nan), _logits(-math.inf, -math.inf)], ids=["nan", "-inf"])
def test_a_row_without_finite_logits_is_reported(row):
    sampling = SamplingConfig(temperature=1.0)
    token, _ = sampler.choose(row, sampling, torch.Generator().manual_seed(0), False)
    assert int(token) == sampler.NO_TOKEN
    sampling.logprobs = 0
    with pytest.raises(sampler.NoFiniteLogit):
        sampler.choose(row, sampling, torch.Generator().manual_seed(0), False)


# --- a failing request fails alone ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("safety") / "tiny"
    save_tiny_model("llama", path)
    with LLM(path, build_config=BuildConfig(max_batch_size=4, max_input_len=64, max_seq_len=128), quiet=True) as llm:
        yield llm


def _run_beside_others(llm, sampling: SamplingConfig):
    """MARKER among other requests: (its error, the others' outputs)."""
    results = [llm.generate_async(p, sampling) for p in ([1, 2, 3], MARKER, [4, 5], [6])]
    with pytest.raises(RuntimeError) as failure:
        results[1].result(timeout=60)
    others = [r.result(timeout=60) for r in results[:1] + results[2:]]
    return failure.value, results[1].request_id, others


def _check_engine_goes_on(llm, others, sampling: SamplingConfig):
    assert all(len(o.outputs[0].token_ids) == sampling.max_new_tokens for o in others)
    assert llm.healthy() and llm.stats()["kv_blocks_used"] == 0
    assert llm.generate([9, 8], sampling).outputs[0].finish_reason == "length"


@pytest.mark.parametrize("n", [1, 3])
def test_a_request_whose_sampling_raises_fails_alone(llm, failing_sampler, n):
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, end_id=-1, n=n, random_seed=3)
    error, request_id, others = _run_beside_others(llm, sampling)
    assert f"request {request_id} failed" in str(error) and "injected sampling failure" in str(error)
    _check_engine_goes_on(llm, others, sampling)


def test_a_request_with_nan_logits_fails_alone(llm, monkeypatch):
    original = sampler.apply_penalties

    def poisoned(logits, seq, sampling):
        return torch.full_like(logits, math.nan) if seq.token_ids[:4] == MARKER else original(logits, seq, sampling)

    monkeypatch.setattr(sampler, "apply_penalties", poisoned)
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.7, end_id=-1)
    error, request_id, others = _run_beside_others(llm, sampling)
    assert f"request {request_id} failed" in str(error) and "NaN or -inf" in str(error)
    _check_engine_goes_on(llm, others, sampling)


@pytest.mark.parametrize("stop", [[], ["@@@"]], ids=["at the end", "every step"])
def test_a_request_whose_text_processing_raises_fails_alone(llm, monkeypatch, stop):
    original = executor.GenerationExecutor._detokenize

    def failing(self, state, request, seq):
        if request.prompt_token_ids == MARKER:
            raise UnicodeError("injected text failure")
        return original(self, state, request, seq)

    monkeypatch.setattr(executor.GenerationExecutor, "_detokenize", failing)
    sampling = SamplingConfig(max_new_tokens=6, temperature=0, end_id=-1, stop=stop)
    error, request_id, others = _run_beside_others(llm, sampling)
    assert f"request {request_id} failed" in str(error) and "injected text failure" in str(error)
    _check_engine_goes_on(llm, others, sampling)


# --- prefix-cache keys ---------------------------------------------------------------------------------

def test_prefix_keys_do_not_trust_python_hash(monkeypatch):
    """With hash() colliding everywhere (as crafted inputs can make it), a prompt must still reuse only blocks
    computed after its own prefix."""
    monkeypatch.setattr(kv_cache, "hash", lambda _: 0, raising=False)
    kv = kv_cache.KVCacheManager(16, 4, enable_reuse=True)
    a, b, c = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]

    def computed(tokens: list[int]) -> Sequence:
        seq = Sequence(tokens, len(tokens))
        kv.allocate(seq, len(tokens))
        seq.num_computed_tokens = len(tokens)
        kv.register_full_blocks(seq)
        return seq

    computed(b + c + [9])                 # c's block computed after b
    computed(a + [8])                     # a's block
    victim = Sequence(a + c + [5], 9)     # c after a: only a's block may be reused
    assert len(kv.find_cached_prefix(victim)) == 1
    assert all(isinstance(key, bytes) and len(key) == 32 for key in kv.cached)
