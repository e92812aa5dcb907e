"""Speculative decoding's drafters: before a step is scheduled, each generating sequence that may speculate gets up
to k draft tokens (Sequence.draft_ids) to follow its last token; the step computes them all, the sampler keeps
what the model agrees with (sampler.verify_drafts) and the scheduler takes back the KV of the rest.

    NgramDrafter       prompt lookup: the tokens after the latest earlier occurrence of the sequence's last n-gram
    DraftModelDrafter  a smaller model of the same vocabulary, run k one-token steps over its own paged KV cache
"""
from __future__ import annotations

import torch

from kiln.builder import Engine
from kiln.config import SpeculativeConfig

from . import sampler
from .kv_cache import KVCacheManager
from .model_runner import ModelRunner
from .request import Request, Sequence
from .scheduler import SchedulerOutput
from .step import Step

DRAFT_SAMPLES = 1 << 20     # the sample index of a request's drafting generator: seeded apart from its samples'
                            # (ModelRunner._generator)


def draft_room(request: Request, seq: Sequence, max_draft_len: int) -> int:
    """Draft tokens worth proposing: a step emits at most the drafts and one token more, within max_new_tokens."""
    return min(max_draft_len, request.sampling.max_new_tokens - seq.num_output_tokens - 1)


class NgramDrafter:
    """Prompt lookup: the longest suffix n-gram (max_matching_ngram_size down to min_matching_ngram_size tokens)
    that occurred earlier in the prompt or output proposes the tokens that followed its latest occurrence."""

    def __init__(self, config: SpeculativeConfig):
        self.max_draft_len = config.max_draft_len
        self.sizes = range(config.max_matching_ngram_size, config.min_matching_ngram_size - 1, -1)

    def propose(self, batch: list[tuple[Request, Sequence, int]]) -> None:
        for _, seq, k in batch:
            seq.draft_ids, seq.draft_probs = lookup(seq.token_ids, self.sizes, k), None

    def release(self, request: Request) -> None:
        pass


def lookup(tokens: list[int], sizes, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of tokens' last n tokens, for the first size n
    in `sizes` that has one; [] when none does."""
    for n in sizes:
        if n >= len(tokens):
            continue
        pattern, last = tokens[-n:], tokens[-1]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start + n - 1] == last and tokens[start:start + n] == pattern:
                return tokens[start + n:start + n + k]
    return []


class DraftModelDrafter:
    """A draft model's engine with its own KV cache: each sequence has a mirror there holding the tokens the draft
    model has computed; a proposal catches the mirror up with the sequence's accepted tokens (what the last
    verification rejected is dropped), then runs k one-token steps (CUDA graphs on a GPU) over all sequences,
    greedy for greedy requests, else sampled from the draft's distribution after the request's temperature,
    top-k and top-p (kept in seq.draft_probs for the rejection sampling)."""

    def __init__(self, config: SpeculativeConfig, engine: Engine, device: torch.device, plan_blocks):
        """plan_blocks(KV bytes per token) → the blocks of the draft model's KV cache."""
        self.max_draft_len = config.max_draft_len
        self.runner = ModelRunner(engine, device)
        num_blocks = plan_blocks(self.runner.kv_bytes_per_token)
        self.runner.allocate_kv(num_blocks)
        self.runner.capture_graphs()
        self.kv = KVCacheManager(num_blocks, self.runner.tokens_per_block)
        self.max_num_tokens = engine.build_config.max_num_tokens
        self.mirrors: dict[int, Sequence] = {}          # target seq id → the draft model's copy

    def propose(self, batch: list[tuple[Request, Sequence, int]]) -> None:
        ready = []
        for request, seq, k in batch:
            seq.draft_ids, seq.draft_probs = [], None
            mirror = self._catch_up(seq, k)
            if mirror is not None:
                ready.append((request, seq, mirror, k))
        self._fill([(mirror, len(mirror.token_ids) - 1 - mirror.num_computed_tokens) for _, _, mirror, _ in ready])
        probs: dict[int, list[torch.Tensor]] = {}
        for step in range(max((k for *_, k in ready), default=0)):
            going = [(r, s, m) for r, s, m, k in ready if k > step]
            rows = self._forward([(m, 1) for _, _, m in going], logits=True)
            for (request, seq, mirror), row in zip(going, rows):
                token, q = draw(request, row, self.runner._generator(request, DRAFT_SAMPLES))
                seq.draft_ids.append(token)
                mirror.token_ids.append(token)
                if q is not None:
                    probs.setdefault(seq.seq_id, []).append(q)
        for _, seq, _, _ in ready:
            if seq.seq_id in probs:
                seq.draft_probs = torch.stack(probs[seq.seq_id])

    def _catch_up(self, seq: Sequence, k: int) -> Sequence | None:
        """The sequence's mirror holding its tokens, all but the last computed, with blocks for k drafts; None
        when the draft cache has no room (the sequence then goes without drafts this step)."""
        mirror = self.mirrors.get(seq.seq_id)
        if mirror is None:
            mirror = self.mirrors[seq.seq_id] = Sequence([], 0)
        same = 0
        limit = min(mirror.num_computed_tokens, len(seq.token_ids) - 1)
        while same < limit and mirror.token_ids[same] == seq.token_ids[same]:
            same += 1
        mirror.num_computed_tokens, mirror.token_ids = same, list(seq.token_ids)
        self.kv.trim(mirror, same)
        if not self.kv.allocate(mirror, len(seq.token_ids) + k - 1):
            return None
        return mirror

    def _fill(self, pending: list[tuple[Sequence, int]]) -> None:
        """Compute the given number of tokens of each mirror, in steps of at most max_num_tokens tokens."""
        pending = [(m, n) for m, n in pending if n > 0]
        while pending:
            chunk, budget = [], self.max_num_tokens
            for mirror, n in pending:
                take = min(n, budget)
                if take:
                    chunk.append((mirror, take))
                    budget -= take
            self._forward(chunk, logits=False)
            done = dict((id(m), n) for m, n in chunk)
            pending = [(m, n - done.get(id(m), 0)) for m, n in pending if n - done.get(id(m), 0) > 0]

    def _forward(self, chunk: list[tuple[Sequence, int]], logits: bool) -> torch.Tensor | None:
        """One step of the draft model over `chunk` ((mirror, tokens) each); the logits of each mirror's last
        token when asked."""
        runner = self.runner
        ids, positions, slots, starts, seq_lens, tables = runner._prepare(
            SchedulerOutput(scheduled=[(None, mirror, n) for mirror, n in chunk]))
        rows = [starts[i + 1] - 1 for i in range(len(chunk))] if logits else []
        step = Step([], ids, positions, slots, starts, seq_lens, tables, max(n for _, n in chunk), max(seq_lens),
                    rows)
        out = runner.run_step(step)
        for mirror, n in chunk:
            mirror.num_computed_tokens += n
        return out.float() if logits else None

    def release(self, request: Request) -> None:
        for seq in request.all_seqs():
            mirror = self.mirrors.pop(seq.seq_id, None)
            if mirror is not None:
                self.kv.free_seq(mirror)

    def close(self) -> None:
        self.runner.close()


def draw(request: Request, row: torch.Tensor, generator: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
    """A draft token from a drafter's logits `row` and the distribution it was drawn from (None: greedy); drawn
    after the request's temperature/top-k/top-p with `generator`. A row with no finite logit left drafts its argmax,
    certainly (a one-hot distribution)."""
    sampling, row = request.sampling, sampler.finite_logits(row.float())
    kept = row if sampling.greedy else sampler.filtered_logits(row, sampling)
    if sampling.greedy or not torch.isfinite(kept).any():
        token = row.argmax()
        return int(token), None if sampling.greedy else torch.nn.functional.one_hot(token, row.shape[-1]).float()
    q = kept.softmax(-1)
    return int(torch.multinomial(q, 1, generator=generator)[0]), q


class EagleDrafter:
    """EAGLE: a head (kiln.models.eagle) predicts the model's next hidden state from its last one and the next
    token's embedding; the model's LM head reads a draft token off each prediction, which feeds the next. The head
    keeps, per sequence, a KV cache over the positions whose hidden state the model computed (observe() collects
    them after each step); drafting extends it for the moment only."""

    def __init__(self, config: SpeculativeConfig, runner: ModelRunner, device: torch.device):
        """runner: the model's (its network's embedding and LM head; its generators, for sampled drafts)."""
        from kiln.models.eagle import EagleHead

        self.max_draft_len, self.runner, self.net = config.max_draft_len, runner, runner.net
        self.head = EagleHead(config.speculative_model, runner.net.config, device)
        self.states: dict[int, _EagleState] = {}       # seq id → what the head holds of it

    def observe(self, scheduled, hidden: torch.Tensor | None) -> None:
        """Keep the model's hidden states of a step's tokens (`hidden`: the step's rows, packed as `scheduled`),
        by position; called before the step's tokens count as computed."""
        if hidden is None:
            return
        row = 0
        for _, seq, n in scheduled:
            state = self.states.setdefault(seq.seq_id, _EagleState())
            block = hidden[row:row + n].detach().clone()
            for j in range(n):
                state.features[seq.num_computed_tokens + j] = block[j]
            row += n

    def propose(self, batch: list[tuple[Request, Sequence, int]]) -> None:
        for request, seq, k in batch:
            seq.draft_ids, seq.draft_probs = [], None
            state = self.states.get(seq.seq_id)
            if state is not None:
                self._draft(request, seq, state, k)

    def _draft(self, request: Request, seq: Sequence, state: "_EagleState", k: int) -> None:
        tokens, last = seq.token_ids, len(seq.token_ids) - 2        # positions 0..last have their next token
        ready = [p for p in range(state.done, last + 1) if p in state.features]    # (a reused prefix has none)
        prediction = None
        if ready:
            prediction, state.cache = self._step([tokens[p + 1] for p in ready],
                                                 torch.stack([state.features[p] for p in ready]), ready, state.cache)
        for p in [p for p in state.features if p <= last]:
            del state.features[p]
        state.done = max(state.done, last + 1)
        if prediction is None or ready[-1] != last:
            return                                                  # no hidden state of the last position
        prediction, cache, probs = prediction[-1:], state.cache, []
        for j in range(k):
            token, q = draw(request, self.net.compute_logits(prediction)[0],
                            self.runner._generator(request, DRAFT_SAMPLES))
            seq.draft_ids.append(token)
            probs += [q] if q is not None else []
            if j + 1 < k:
                prediction, cache = self._step([token], prediction, [last + 1 + j], cache)
        if probs:
            seq.draft_probs = torch.stack(probs)

    def _step(self, tokens: list[int], features: torch.Tensor, positions: list[int], cache):
        """The head over `positions` (their next tokens and the hidden states there), after `cache`."""
        device = features.device
        ids = torch.tensor(tokens, dtype=torch.int64, device=device)
        return self.head.forward(self.net.embed(ids), features, torch.tensor(positions, device=device), cache)

    def release(self, request: Request) -> None:
        for seq in request.all_seqs():
            self.states.pop(seq.seq_id, None)


class _EagleState:
    """A sequence's share of the head: the model's hidden states not fed to the head yet (by position), and the
    head's KV cache over the positions before `done`."""

    def __init__(self):
        self.features: dict[int, torch.Tensor] = {}
        self.cache = None
        self.done = 0
