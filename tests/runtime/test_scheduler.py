"""Scheduler and KV-cache unit tests in plain Python: no torch, no weights.

A fake model picks each next token from the sequence so far, and a fake KV cache stores the token written
at every slot, so every step also checks that each sequence's cached tokens are exactly its own (prefix reuse,
forks with copy-on-write, preemption and recompute included). Run as a script, this file also proves that
the scheduler stack imports no torch: `python tests/runtime/test_scheduler.py`.
"""
from __future__ import annotations

import random
import sys

from kiln.config.runtime import SchedulerPolicy
from kiln.runtime.beam_search import Candidate, beams_to_keep
from kiln.runtime.kv_cache import KVCacheManager
from kiln.runtime.request import Request
from kiln.runtime.sampling import SamplingConfig
from kiln.runtime.scheduler import ModelStepOutput, SampledToken, Scheduler

VOCAB, EOS = 100, 7  # a small vocabulary so that EOS (1 in 100) really ends sequences


def next_token(tokens: list[int], salt: int = 0) -> int:
    tail = tokens[-8:]
    return (sum(t * (i + 3) for i, t in enumerate(tail)) * 2654435761 + len(tokens) * 97 + salt * 7919) % VOCAB


def expected_output(prompt: list[int], sampling: SamplingConfig, salt: int = 0) -> list[int]:
    """What the fake model generates for a request run alone."""
    tokens = list(prompt)
    while True:
        token = next_token(tokens, salt)
        tokens.append(token)
        out = len(tokens) - len(prompt)
        if (token == EOS and out >= sampling.min_tokens) or out >= sampling.max_new_tokens:
            return tokens[len(prompt):]


class FakeRunner:
    """Writes token ids into a fake paged cache, checks what is read back, and samples with next_token."""

    def __init__(self, kv: KVCacheManager):
        self.kv, self.cache, self.max_step_tokens, self.max_running = kv, {}, 0, 0

    def _slot(self, seq, pos):
        return self.cache.setdefault(seq.block_ids[pos // self.kv.tokens_per_block], {}), pos % self.kv.tokens_per_block

    def execute(self, out) -> ModelStepOutput:
        for src, dst in out.block_copies:
            self.cache[dst] = dict(self.cache.get(src, {}))
        new = {}
        for _, seq, n in out.scheduled:
            assert n > 0 and seq.num_computed_tokens + n <= seq.num_tokens
            for pos in range(seq.num_computed_tokens):
                block, offset = self._slot(seq, pos)
                assert block.get(offset) == seq.token_ids[pos], "the KV cache lost a sequence's token"
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                block, offset = self._slot(seq, pos)
                block[offset] = seq.token_ids[pos]
            new[seq.seq_id] = n
        self.max_step_tokens = max(self.max_step_tokens, out.num_tokens)
        result = ModelStepOutput()
        for request in {id(r): r for r, _, _ in out.scheduled}.values():
            if all(s.num_computed_tokens + new.get(s.seq_id, 0) == s.num_tokens for s in request.seqs):
                self._sample(request, result)
        return result

    def _sample(self, request: Request, result: ModelStepOutput) -> None:
        seqs, sampling = request.seqs, request.sampling
        if sampling.use_beam_search:
            cands = []
            for j, seq in enumerate(seqs):
                for t in range(6):
                    token = (next_token(seq.token_ids) + t * 13) % VOCAB
                    logprob = -1.0 - (next_token(seq.token_ids + [token]) % 50) / 10.0
                    cands.append(Candidate(j, token, seq.cumulative_logprob + logprob, logprob))
            cands.sort(key=lambda c: c.cumulative_logprob, reverse=True)
            result.beam_candidates[request.request_id] = cands[:beams_to_keep(request)]
        elif len(seqs) == 1 and seqs[0].num_output_tokens == 0 and sampling.n > 1:
            result.tokens[request.request_id] = [SampledToken(0, next_token(seqs[0].token_ids, i), None, i)
                                                 for i in range(sampling.n)]
        else:
            result.tokens[request.request_id] = [SampledToken(j, next_token(s.token_ids, s.sample_index))
                                                 for j, s in enumerate(seqs)]


def make_engine(num_blocks=400, tokens_per_block=16, max_batch_size=8, max_num_tokens=512, reuse=False,
                chunked=False, policy=SchedulerPolicy.GUARANTEED_NO_EVICT):
    kv = KVCacheManager(num_blocks, tokens_per_block, reuse)
    return Scheduler(kv, max_batch_size, max_num_tokens, policy, chunked), FakeRunner(kv)


def run(scheduler: Scheduler, runner: FakeRunner, arrivals: dict[int, list[Request]] | None = None, max_steps=20000,
        each_step=None):
    """Step until everything finished; `arrivals` adds requests before the given step numbers; each_step(step, out)
    sees every scheduled step before it runs."""
    arrivals = dict(arrivals or {})
    for step in range(max_steps):
        for request in arrivals.pop(step, []):
            scheduler.add_request(request)
        if not scheduler.has_unfinished() and not arrivals:
            return step
        out = scheduler.schedule()
        if each_step is not None:
            each_step(step, out)
        assert len(scheduler.running) <= scheduler.max_batch_size
        assert out.num_tokens <= scheduler.max_num_tokens
        runner.max_running = max(runner.max_running, len(scheduler.running))
        if out:
            scheduler.update(out, runner.execute(out))
    raise AssertionError("the scheduler did not finish")


def assert_no_leak(scheduler: Scheduler) -> None:
    kv = scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks and kv.num_used_blocks == 0
    assert all(count == 0 for count in kv.ref_counts)


def random_requests(count: int, seed: int, max_prompt=300, max_new=40, id_base=0) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        prompt = [rng.randrange(8, VOCAB) for _ in range(rng.randint(1, max_prompt))]
        max_new_tokens = rng.randint(1, max_new)
        sampling = SamplingConfig(max_new_tokens=max_new_tokens, min_tokens=min(max_new_tokens, rng.choice([0, 0, 1, 3])))
        requests.append(Request(id_base + i, prompt, sampling, frozenset({EOS})))
    return requests


def check_outputs(requests: list[Request]) -> None:
    for r in requests:
        assert r.finished
        assert r.finished_seqs[0].output_token_ids == expected_output(r.prompt_token_ids, r.sampling), r.request_id


# --- tests ---------------------------------------------------------------------------------------------------
CONFIGS = [dict(reuse=reuse, chunked=chunked, tokens_per_block=tpb)
           for reuse in (False, True) for chunked in (False, True) for tpb in (16, 64)]


def test_batching_invariance_over_every_configuration():
    for config in CONFIGS:
        max_num_tokens = 128 if config["chunked"] else 512
        for staggered in (False, True):
            scheduler, runner = make_engine(max_num_tokens=max_num_tokens, **config)
            requests = random_requests(24, seed=1)
            arrivals = {i * 3 if staggered else 0: [] for i in range(24)}
            for i, r in enumerate(requests):
                arrivals[i * 3 if staggered else 0].append(r)
            run(scheduler, runner, arrivals)
            check_outputs(requests)
            assert_no_leak(scheduler)
            if config["chunked"]:
                assert runner.max_step_tokens <= 128


def test_chunking_only_when_enabled():
    scheduler, runner = make_engine(max_num_tokens=64, chunked=False)
    long = Request(0, list(range(10, 60)), SamplingConfig(max_new_tokens=3))
    scheduler.add_request(long)
    out = scheduler.schedule()
    assert [(seq.num_tokens, n) for _, seq, n in out.scheduled] == [(50, 50)]
    scheduler, _ = make_engine(max_num_tokens=16, chunked=True)
    scheduler.add_request(Request(0, list(range(10, 60)), SamplingConfig(max_new_tokens=3)))
    assert [n for _, _, n in scheduler.schedule().scheduled] == [16]


def test_max_utilization_preempts_and_recomputes():
    scheduler, runner = make_engine(num_blocks=40, tokens_per_block=16, max_batch_size=16,
                                    policy=SchedulerPolicy.MAX_UTILIZATION)
    requests = random_requests(24, seed=2, max_prompt=200, max_new=60)
    run(scheduler, runner, {0: requests})
    assert scheduler.stats.preemptions > 0
    check_outputs(requests)
    assert_no_leak(scheduler)


def test_guaranteed_no_evict_never_preempts():
    scheduler, runner = make_engine(num_blocks=40, tokens_per_block=16, max_batch_size=16)
    requests = random_requests(24, seed=2, max_prompt=200, max_new=60)
    run(scheduler, runner, {0: requests})
    assert scheduler.stats.preemptions == 0
    check_outputs(requests)
    assert_no_leak(scheduler)


def test_prefix_reuse_computes_only_new_tokens():
    scheduler, runner = make_engine(tokens_per_block=16, reuse=True)
    prefix = [random.Random(3).randrange(8, VOCAB) for _ in range(200)]
    first = Request(0, prefix + [11, 12, 13], SamplingConfig(max_new_tokens=5))
    second = Request(1, prefix + [21, 22], SamplingConfig(max_new_tokens=5))
    run(scheduler, runner, {0: [first]})
    tokens_before = scheduler.stats.scheduled_tokens
    run(scheduler, runner, {0: [second]})
    assert second.num_cached_prompt_tokens == 192                       # 12 full blocks of the shared prefix
    computed = scheduler.stats.scheduled_tokens - tokens_before
    assert computed == (202 - 192) + len(second.finished_seqs[0].output_token_ids) - 1
    check_outputs([first, second])
    assert scheduler.kv.stats.hit_tokens == 192 and scheduler.kv.cached  # freed blocks stay cached
    assert_no_leak(scheduler)


def test_freed_blocks_are_evicted_least_recent_first():
    scheduler, runner = make_engine(num_blocks=12, tokens_per_block=16, reuse=True)
    a = Request(0, list(range(10, 10 + 80)), SamplingConfig(max_new_tokens=1))
    run(scheduler, runner, {0: [a]})
    cached_before = len(scheduler.kv.cached)
    b = Request(1, list(range(500, 500 + 120)), SamplingConfig(max_new_tokens=1))
    run(scheduler, runner, {0: [b]})
    assert scheduler.kv.stats.evictions > 0 and len(scheduler.kv.cached) >= cached_before - scheduler.kv.stats.evictions
    again = Request(2, list(range(500, 500 + 120)), SamplingConfig(max_new_tokens=1))
    run(scheduler, runner, {0: [again]})
    assert again.num_cached_prompt_tokens == 112                        # the most recent prefix survived


def test_randomized_run_with_aborts_leaks_nothing():
    rng = random.Random(4)
    for reuse, policy in ((True, SchedulerPolicy.MAX_UTILIZATION), (True, SchedulerPolicy.GUARANTEED_NO_EVICT),
                          (False, SchedulerPolicy.MAX_UTILIZATION)):
        scheduler, runner = make_engine(num_blocks=120, tokens_per_block=16, max_batch_size=12, reuse=reuse,
                                        chunked=True, max_num_tokens=256, policy=policy)
        base = [rng.randrange(8, VOCAB) for _ in range(64)]
        pending = []
        for i in range(500):
            prompt = base[:rng.randint(0, 64)] + [rng.randrange(8, VOCAB) for _ in range(rng.randint(1, 60))]
            sampling = SamplingConfig(max_new_tokens=rng.randint(1, 30), n=rng.choice([1, 1, 1, 2, 3]))
            pending.append(Request(i, prompt, sampling, frozenset({EOS})))
        live = []
        step = 0
        while pending or scheduler.has_unfinished():
            for _ in range(rng.randint(0, 3)):
                if pending:
                    live.append(pending.pop(0))
                    scheduler.add_request(live[-1])
            if live and rng.random() < 0.15:
                scheduler.abort(live.pop(rng.randrange(len(live))))
            out = scheduler.schedule()
            if out:
                scheduler.update(out, runner.execute(out))
            live = [r for r in live if not r.finished]
            step += 1
            assert step < 50000
        assert_no_leak(scheduler)


def test_n_samples_fork_and_copy_on_write():
    scheduler, runner = make_engine(tokens_per_block=16, reuse=True)
    request = Request(0, list(range(10, 47)), SamplingConfig(max_new_tokens=20, n=3))   # 37 tokens: a partial block
    run(scheduler, runner, {0: [request]})
    outputs = sorted(request.finished_seqs, key=lambda s: s.sample_index)
    assert [s.sample_index for s in outputs] == [0, 1, 2]
    for seq in outputs:
        assert seq.output_token_ids == expected_output(request.prompt_token_ids, request.sampling, seq.sample_index)
    assert_no_leak(scheduler)


def test_beam_search_keeps_the_cache_consistent():
    for early_stopping in (False, True, "never"):
        scheduler, runner = make_engine(tokens_per_block=16, reuse=True)
        requests = [Request(i, list(range(10 + i, 40 + 3 * i)), SamplingConfig(
            max_new_tokens=12, num_beams=4, early_stopping=early_stopping), frozenset({EOS})) for i in range(3)]
        run(scheduler, runner, {0: requests})
        for request in requests:
            assert request.finished and len(request.beam_hypotheses) == 4
            scores = [h.score for h in request.beam_hypotheses]
            assert scores == sorted(scores, reverse=True)
        assert_no_leak(scheduler)


def test_request_that_can_never_fit_is_rejected():
    scheduler, _ = make_engine(num_blocks=4, tokens_per_block=16)
    try:
        scheduler.add_request(Request(0, list(range(10, 70)), SamplingConfig(max_new_tokens=10)))
    except ValueError as err:
        assert "may need 5 KV-cache blocks" in str(err)
    else:
        raise AssertionError("expected a ValueError")


def test_budgets_are_respected():
    scheduler, runner = make_engine(max_batch_size=3, max_num_tokens=100, chunked=True)
    requests = random_requests(10, seed=5, max_prompt=150, max_new=10)
    run(scheduler, runner, {0: requests})
    assert runner.max_running == 3 and runner.max_step_tokens <= 100
    check_outputs(requests)


def test_decodes_lead_every_step():
    """The sequences decoding one token come before every prompt chunk of a step: the runner sends a step's leading
    one-token sequences to the decode attention kernels (AttentionMetadata.decode_seqs), the rest to the prompt
    kernel."""
    for reuse, policy in ((False, SchedulerPolicy.GUARANTEED_NO_EVICT), (True, SchedulerPolicy.MAX_UTILIZATION)):
        scheduler, runner = make_engine(num_blocks=150, max_batch_size=12, max_num_tokens=200, reuse=reuse,
                                        chunked=True, policy=policy)
        requests = random_requests(60, seed=8, max_prompt=250, max_new=30)
        mixed = []

        def check(step, out):
            decodes = [n == 1 and seq.num_output_tokens > 0 for _, seq, n in out.scheduled]
            first_prompt = next((i for i, (_, _, n) in enumerate(out.scheduled) if n > 1), len(decodes))
            assert not any(decodes[first_prompt:]), f"step {step}: a decode after a prompt chunk"
            mixed.append(any(decodes) and first_prompt < len(decodes))

        run(scheduler, runner, {step: requests[i:i + 3] for step, i in enumerate(range(0, len(requests), 3))},
            each_step=check)
        assert sum(mixed) > 10
        check_outputs(requests)


def test_reservations_summed_once_a_step_match_a_fresh_sum():
    """GUARANTEED_NO_EVICT sums the running requests' reserved blocks once a step and adds each admitted request's:
    at every admission that total equals the sum over the running requests at that moment (several admissions a
    step, tight pool, samples sharing blocks)."""
    checked = []

    class Checking(Scheduler):
        def _fits_reservation(self, request, hits, reserved):
            bs = self.kv.tokens_per_block
            fresh = sum(r.max_blocks(bs) - len({b for s in r.seqs for b in s.block_ids}) for r in self.running)
            assert reserved == fresh, (reserved, fresh)
            checked.append(len(self.running))
            return super()._fits_reservation(request, hits, reserved)

    kv = KVCacheManager(40, 16, True)            # room for ~4 worst cases: admissions get refused
    scheduler, runner = Checking(kv, 8, 512, SchedulerPolicy.GUARANTEED_NO_EVICT, False), FakeRunner(kv)
    requests = random_requests(30, seed=11, max_prompt=120, max_new=30)
    requests += [Request(100 + i, list(range(10, 40 + i)), SamplingConfig(max_new_tokens=12, n=2)) for i in range(4)]
    run(scheduler, runner, {0: requests})
    for r in requests:
        assert r.finished
    assert max(checked) > 1 and len(checked) > len(requests)
    assert_no_leak(scheduler)


def test_scheduler_stack_imports_no_torch():
    """Run this whole file as a script in a fresh interpreter: it asserts torch was never imported."""
    import subprocess
    from pathlib import Path

    proc = subprocess.run([sys.executable, str(Path(__file__))], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "passed without torch" in proc.stdout


if __name__ == "__main__":
    tests = [f for name, f in sorted(globals().items())
             if name.startswith("test_") and callable(f) and name != "test_scheduler_stack_imports_no_torch"]
    for test in tests:
        test()
    assert "torch" not in sys.modules, "the scheduler stack imported torch"
    print(f"{len(tests)} scheduler tests passed without torch")
