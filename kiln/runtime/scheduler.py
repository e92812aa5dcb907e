"""The scheduler. One rule for every sequence: compute tokens [num_computed_tokens, num_tokens) — a whole
prompt, a chunk of one, or the one token a generating sequence just sampled — under the max_num_tokens and
max_batch_size budgets. Running requests go first (FCFS), then waiting ones. Plain Python, no torch.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kiln.config.runtime import SchedulerPolicy

from .beam_search import Candidate, beam_step
from .kv_cache import KVCacheManager
from .request import PENDING_TOKEN, Request, RequestStatus, Sequence, TokenLogprob


@dataclass
class SchedulerOutput:
    """The work of one step: sequences with their number of new tokens, and KV blocks to copy first."""

    scheduled: list[tuple[Request, Sequence, int]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, _, n in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


@dataclass
class SampledToken:
    """A token chosen for a request: appended to seqs[parent] (forking it if chosen twice)."""

    parent: int
    token: int
    logprob: TokenLogprob | None = None
    sample_index: int | None = None


@dataclass
class ModelStepOutput:
    """What the model runner decided for the requests whose sequences are all computed after a step."""

    tokens: dict[int, list[SampledToken]] = field(default_factory=dict)      # request id → tokens
    speculated: dict[int, list[SampledToken]] = field(default_factory=dict)  # request id → its sequence's accepted
                                                                             # drafts and the model's next token
    beam_candidates: dict[int, list[Candidate]] = field(default_factory=dict)


@dataclass
class SchedulerStats:
    steps: int = 0
    scheduled_tokens: int = 0
    last_step_tokens: int = 0
    preemptions: int = 0
    draft_tokens: int = 0             # speculative decoding: draft tokens verified,
    accepted_draft_tokens: int = 0    # of them accepted,
    speculative_steps: int = 0        # over this many sequence-steps


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_batch_size: int, max_num_tokens: int,
                 policy: SchedulerPolicy = SchedulerPolicy.GUARANTEED_NO_EVICT, chunked_context: bool = False,
                 max_loras: int | None = None):
        """max_loras: the most LoRA adapters the running requests may use at once (the device's adapter slots);
        a request of another adapter waits until one of them is done. None: no limit."""
        self.kv, self.max_batch_size, self.max_num_tokens = kv, max_batch_size, max_num_tokens
        self.policy, self.chunked_context, self.max_loras = policy, chunked_context, max_loras
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.pending_copies: list[tuple[int, int]] = []
        self.stats = SchedulerStats()

    def check_fits(self, request: Request) -> None:
        """A request whose sequences could outgrow the whole KV cache would wait forever: reject it."""
        need = request.max_blocks(self.kv.tokens_per_block)
        if need > self.kv.num_blocks:
            raise ValueError(f"the request may need {need} KV-cache blocks of {self.kv.tokens_per_block} tokens "
                             f"({request.sampling.num_sequences} sequence(s) of up to "
                             f"{request.num_prompt_tokens + request.sampling.max_new_tokens} tokens); the cache has "
                             f"{self.kv.num_blocks}: lower max_new_tokens/n/num_beams or give the cache more memory")

    def add_request(self, request: Request) -> None:
        self.check_fits(request)
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- scheduling ---------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(block_copies=self.pending_copies)
        self.pending_copies = []
        budget = self.max_num_tokens
        index = 0
        while index < len(self.running):
            request = self.running[index]
            budget, preempted_self = self._schedule_running(request, budget, out)
            if not preempted_self:
                index += 1
        reserved = None          # GUARANTEED_NO_EVICT: blocks the running requests may still need, summed once a step
        while not out.preempted and self.waiting and len(self.running) < self.max_batch_size and budget > 0:
            if reserved is None and self.policy is SchedulerPolicy.GUARANTEED_NO_EVICT:
                reserved = sum(self._reservation(r) for r in self.running)
            admitted = self._admit(self.waiting[0], budget, out, reserved)
            if not admitted:
                break
            budget -= admitted
            if reserved is not None:
                reserved += self._reservation(self.running[-1])
        self.stats.steps += bool(out)
        self.stats.last_step_tokens = out.num_tokens
        self.stats.scheduled_tokens += out.num_tokens
        return out

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of `seq` to compute now: all pending ones, or a chunk when chunking applies (0: wait)."""
        pending = seq.num_pending_tokens
        if pending <= budget:
            return pending
        # Without chunked context a sequence is computed whole; one that can never fit (a long sequence
        # recomputed after preemption) is chunked anyway.
        return budget if self.chunked_context or pending > self.max_num_tokens else 0

    def _schedule_running(self, request: Request, budget: int, out: SchedulerOutput) -> tuple[int, bool]:
        seqs = request.seqs
        if seqs and seqs[-1].token_ids[-1] == PENDING_TOKEN:      # overlapped steps: skip sequences whose last
            seqs = [s for s in seqs if s.num_output_tokens < request.sampling.max_new_tokens]   # token is sampled
        if len(seqs) == 1 and seqs[0].draft_ids:
            return self._schedule_drafts(request, seqs[0], budget, out)
        if len(seqs) == 1 and budget > 0:             # the common case: one sequence decoding one token
            seq = seqs[0]
            computed = seq.num_computed_tokens
            if len(seq.token_ids) - computed == 1 and computed < len(seq.block_ids) * self.kv.tokens_per_block:
                out.scheduled.append((request, seq, 1))
                return budget - 1, False
        for seq in seqs:
            n = self._chunk(seq, budget)
            if n == 0:
                continue
            if not self._allocate_or_preempt(request, seq, n, out):
                return self.max_num_tokens - out.num_tokens, True
            out.scheduled.append((request, seq, n))
            budget -= n
        return budget, False

    def _allocate_or_preempt(self, request: Request, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Blocks for n more tokens of `seq`, preempting the newest running requests until they fit; False when
        `request` itself was preempted (the step is then built without it)."""
        while not self.kv.allocate(seq, seq.num_computed_tokens + n):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _schedule_drafts(self, request: Request, seq: Sequence, budget: int, out: SchedulerOutput) -> tuple[int, bool]:
        """A generating sequence with draft tokens: its last token and as many drafts as the budget leaves."""
        keep = max(0, budget - 1)
        if keep < len(seq.draft_ids):
            seq.draft_ids = seq.draft_ids[:keep]
            seq.draft_probs = None if seq.draft_probs is None or not keep else seq.draft_probs[:keep]
        if budget == 0:
            return budget, False
        n = 1 + len(seq.draft_ids)
        if not self._allocate_or_preempt(request, seq, n, out):
            return self.max_num_tokens - out.num_tokens, True
        out.scheduled.append((request, seq, n))
        return budget - n, False

    def _admit(self, request: Request, budget: int, out: SchedulerOutput, reserved: int | None) -> int:
        """Start the first waiting request if it fits: the number of its tokens scheduled now (0: it waits).
        reserved: GUARANTEED_NO_EVICT's blocks the running requests may still need (None under other policies)."""
        if not self._adapter_fits(request):
            return 0
        hits = [self.kv.find_cached_prefix(seq, request.cache_salt) for seq in request.seqs]
        if reserved is not None and not self._fits_reservation(request, hits, reserved):
            return 0
        plan = []
        for seq, blocks in zip(request.seqs, hits):
            self.kv.adopt_prefix(seq, blocks)
            n = self._chunk(seq, budget)
            if n == 0 or not self.kv.allocate(seq, seq.num_computed_tokens + n):
                break
            plan.append((seq, n))
            budget -= n
        if not plan:
            for seq in request.seqs:
                self.kv.free_seq(seq)
                seq.num_computed_tokens = 0
            return 0
        self.waiting.popleft()
        if request.num_preemptions == 0:
            request.num_cached_prompt_tokens = request.seqs[0].num_computed_tokens
            self.kv.stats.queried_tokens += request.num_prompt_tokens
            self.kv.stats.hit_tokens += request.num_cached_prompt_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        out.scheduled += [(request, seq, n) for seq, n in plan]
        return sum(n for _, n in plan)

    def _adapter_fits(self, request: Request) -> bool:
        """Whether the request's LoRA adapter is one the running requests use, or a slot is left for it."""
        if request.lora_request is None or self.max_loras is None:
            return True
        running = {r.lora_request.name for r in self.running if r.lora_request is not None}
        return request.lora_request.name in running or len(running) < self.max_loras

    def _reservation(self, request: Request) -> int:
        """Blocks a running request may still take: its worst case less the distinct blocks it holds."""
        held = len({b for s in request.seqs for b in s.block_ids})
        return request.max_blocks(self.kv.tokens_per_block) - held

    def _fits_reservation(self, request: Request, hits: list[list[int]], reserved: int) -> bool:
        """GUARANTEED_NO_EVICT: every running request can still grow to its worst case after admitting this one."""
        bs = self.kv.tokens_per_block
        distinct_hits = {b for blocks in hits for b in blocks}
        newly_referenced = sum(1 for b in distinct_hits if self.kv.ref_counts[b] == 0)
        free_after = self.kv.num_free_blocks - newly_referenced - reserved
        return free_after >= request.max_blocks(bs) - len(distinct_hits)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Free the request's blocks and queue it first in line, to be recomputed from its tokens."""
        for seq in request.seqs:
            self.kv.free_seq(seq)
            seq.num_computed_tokens = 0
            seq.draft_ids, seq.draft_probs = [], None
        self.running.remove(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        out.scheduled = [entry for entry in out.scheduled if entry[0] is not request]
        out.preempted.append(request)
        self.stats.preemptions += 1

    # --- applying a step's results ------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, result: ModelStepOutput) -> list[Request]:
        """Advance the computed counters, append sampled tokens (forking where needed); return finished requests."""
        self.advance(out)
        return self.apply(out, result)

    def advance(self, out: SchedulerOutput, pending: bool = False) -> None:
        """The step's tokens are computed. With `pending`, each sequence that now needs its next token gets
        PENDING_TOKEN in its place, so the next step can be scheduled before the host reads the sampled tokens
        (apply(..., fill=True) puts them in)."""
        for _, seq, n in out.scheduled:
            if not seq.finished and not seq.draft_ids:       # (a speculative step's: apply, once verified)
                seq.num_computed_tokens += n
                if pending and seq.num_computed_tokens == seq.num_tokens:
                    seq.token_ids.append(PENDING_TOKEN)
        if self.kv.enable_reuse:
            for request, seq, _ in out.scheduled:
                if not seq.finished and not seq.draft_ids:
                    self.kv.register_full_blocks(seq, request.cache_salt)

    def apply(self, out: SchedulerOutput, result: ModelStepOutput, fill: bool = False) -> list[Request]:
        """Append (or, with `fill`, put in place of PENDING_TOKEN) the sampled tokens; return finished requests."""
        finished, seen, now = [], set(), time.monotonic()
        for request, _, _ in out.scheduled:
            rid = request.request_id
            if rid in seen or request.finished:          # finished meanwhile (an overlapped step, an abort)
                continue
            seen.add(rid)
            tokens = result.tokens.get(rid)
            if rid in result.speculated:
                self._accept_drafts(request, result.speculated[rid])
                if request.first_token_time is None:
                    request.first_token_time = now
            elif tokens is not None:
                if fill:
                    self._fill(request.seqs[0], tokens[0])
                elif len(tokens) == 1 and len(request.seqs) == 1 and tokens[0].parent == 0 and tokens[0].sample_index is None:
                    self._append(request.seqs[0], tokens[0])     # the common case, without forking
                else:
                    self._continue(request, tokens)
                if request.first_token_time is None:
                    request.first_token_time = now
                self._finish_ended_seqs(request)
            elif rid in result.beam_candidates:
                running, done = beam_step(request, result.beam_candidates[rid])
                if done:
                    self.finish_request(request, request.beam_hypotheses[0].sequence.finish_reason)
                else:
                    self._continue(request, [SampledToken(c.parent, c.token, TokenLogprob(c.token, c.logprob))
                                             for c in running], cumulative=[c.cumulative_logprob for c in running])
                    if request.first_token_time is None:
                        request.first_token_time = now
            if request.finished:
                finished.append(request)
        return finished

    def _accept_drafts(self, request: Request, tokens: list[SampledToken]) -> None:
        """A speculative step's outcome for the request's sequence: `tokens` are its accepted drafts and the
        model's next token. The last token and the accepted drafts are now in the KV cache; the blocks that held
        only rejected drafts go back to the pool. Tokens after one that ends the sequence are dropped."""
        seq = request.seqs[0]
        drafted, accepted = len(seq.draft_ids), len(tokens) - 1
        seq.num_computed_tokens += 1 + accepted
        seq.draft_ids, seq.draft_probs = [], None
        request.num_draft_tokens += drafted
        request.num_accepted_draft_tokens += accepted
        request.num_speculative_steps += 1
        self.stats.draft_tokens += drafted
        self.stats.accepted_draft_tokens += accepted
        self.stats.speculative_steps += 1
        for t in tokens:
            self._append(seq, t)
            self._finish_ended_seqs(request)
            if seq.finished:
                return
        self.kv.trim(seq, seq.num_tokens)
        if self.kv.enable_reuse:
            self.kv.register_full_blocks(seq, request.cache_salt)

    @staticmethod
    def _fill(seq: Sequence, t: SampledToken) -> None:
        if seq.token_ids[-1] != PENDING_TOKEN:
            raise RuntimeError(f"sequence {seq.seq_id} has no pending token to fill")
        seq.token_ids[-1] = t.token

    @staticmethod
    def _append(seq: Sequence, t: SampledToken, cumulative: float | None = None) -> None:
        seq.token_ids.append(t.token)
        if t.sample_index is not None:
            seq.sample_index = t.sample_index
        if t.logprob is not None:
            seq.logprobs.append(t.logprob)
            seq.cumulative_logprob = cumulative if cumulative is not None else seq.cumulative_logprob + t.logprob.logprob

    def _continue(self, request: Request, tokens: list[SampledToken], cumulative: list[float] | None = None) -> None:
        parents = request.seqs
        chosen = {t.parent for t in tokens}
        for i, parent in enumerate(parents):
            if i not in chosen:
                self.kv.free_seq(parent)          # a beam nobody continues
        children, taken = [], set()
        for t in tokens:                          # fork before any parent changes
            parent = parents[t.parent]
            if t.parent in taken:
                child = parent.fork()
                copy = self.kv.fork(parent, child)
                if copy:
                    self.pending_copies.append(copy)
            else:
                child = parent
                taken.add(t.parent)
            children.append(child)
        for i, (child, t) in enumerate(zip(children, tokens)):
            self._append(child, t, cumulative[i] if cumulative else None)
        request.seqs = children

    def _finish_ended_seqs(self, request: Request) -> None:
        sampling = request.sampling
        for seq in list(request.seqs) if len(request.seqs) > 1 else request.seqs[:1]:
            generated = len(seq.token_ids) - seq.num_prompt_tokens
            if seq.token_ids[-1] in request.stop_ids and generated >= sampling.min_tokens:
                self.finish_seq(request, seq, "stop")
            elif generated >= sampling.max_new_tokens:
                self.finish_seq(request, seq, "length")

    def finish_seq(self, request: Request, seq: Sequence, reason: str) -> None:
        """End one sequence (a stop token, the length limit, a stop string); the request ends with its last."""
        seq.finish_reason = reason
        self.kv.free_seq(seq)
        request.seqs.remove(seq)
        request.finished_seqs.append(seq)
        if not request.seqs:
            self._retire(request, reason)

    def finish_request(self, request: Request, reason: str) -> None:
        """End a whole request now (abort, or beam search done): free its blocks, drop it from the queues."""
        for seq in request.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = reason
            self.kv.free_seq(seq)
        request.finished_seqs += request.seqs
        request.seqs = []
        self._retire(request, reason)

    def _retire(self, request: Request, reason: str) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finish_time = time.monotonic()

    def abort(self, request: Request) -> None:
        if not request.finished:
            self.finish_request(request, "abort")
