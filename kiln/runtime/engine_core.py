"""EngineCore: owns the scheduler, the KV cache and the model runner; step() = schedule → launch + finish (model runner) → update."""
from __future__ import annotations

import torch

from kiln.builder import Engine
from kiln.config import KvCacheConfig, LoraCacheConfig, SchedulerPolicy, SpeculativeConfig

from .kv_cache import KVCacheManager
from .model_runner import ModelRunner, StepLogits
from .request import PENDING_TOKEN, Request
from .scheduler import Scheduler
from .speculative import DraftModelDrafter, EagleDrafter, NgramDrafter, draft_room
from .step import Refit


def activation_bytes(engine: Engine) -> int:
    """A generous estimate of the largest step's temporaries: hidden states, q/k/v, the MLP, and logits."""
    c, b = engine.pretrained_config, engine.build_config
    per_token = 8 * c.hidden_size + 4 * c.intermediate_size * max(1, c.moe_top_k) + 2 * c.num_attention_heads * c.head_dim
    logits = max(b.max_num_tokens if b.gather_context_logits else 0, b.max_batch_size * b.max_beam_width) * c.vocab_size
    return b.max_num_tokens * per_token * getattr(torch, c.dtype).itemsize + 3 * logits * 4


def plan_kv_blocks(engine: Engine, kv_config: KvCacheConfig, device: torch.device, bytes_per_token: int) -> tuple[int, str]:
    """Number of KV-cache blocks (on a GPU: after the weights are loaded), and a one-line account of it."""
    build = engine.build_config
    tpb = build.plugin_config.tokens_per_block
    need = -(-build.max_seq_len // tpb)
    want = build.max_batch_size * build.max_beam_width * need * tpb
    if kv_config.max_tokens is not None:
        want = min(want, kv_config.max_tokens)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        activations = activation_bytes(engine)
        budget = int(max(0, free - activations) * kv_config.free_gpu_memory_fraction)
        where = (f"{kv_config.free_gpu_memory_fraction:.0%} of the {free / 2**30:.1f} GiB free after weights, "
                 f"less {activations / 2**30:.1f} GiB for activations")
    else:
        budget, where = kv_config.host_cache_bytes, "host_cache_bytes"
    blocks = min(want, budget // bytes_per_token) // tpb
    if blocks < need:
        raise ValueError(f"the KV cache fits {blocks} blocks ({where}: {budget / 2**20:.0f} MiB, "
                         f"max_tokens={kv_config.max_tokens}), but one max_seq_len={build.max_seq_len} sequence "
                         f"needs {need}; give it more memory or lower max_seq_len")
    line = (f"KV cache: {blocks} blocks × {tpb} tokens = {blocks * tpb} tokens, "
            f"{blocks * tpb * bytes_per_token / 2**20:.0f} MiB (limit: {where}; {want} tokens wanted)")
    return blocks, line


class EngineCore:
    """Runs many requests at once: in-flight batching over a paged KV cache."""

    def __init__(self, engine: Engine, device: torch.device, kv_cache_config: KvCacheConfig | None = None,
                 scheduler_policy: SchedulerPolicy = SchedulerPolicy.GUARANTEED_NO_EVICT,
                 enable_chunked_context: bool = False, normalize_log_probs: bool = False, parallel=None,
                 overlap: bool = False, lora_cache_config: LoraCacheConfig | None = None,
                 speculative_config: SpeculativeConfig | None = None, draft_engine: Engine | None = None):
        """overlap: schedule and launch step N+1 before reading step N's greedy tokens (see step_overlapped);
        speculative_config: draft tokens to verify each step (with draft_engine, the draft model's engine, for
        method "draft_model")."""
        build, kv_config = engine.build_config, kv_cache_config or KvCacheConfig()
        lora_cache = lora_cache_config or LoraCacheConfig()
        self.runner = ModelRunner(engine, device, normalize_log_probs, parallel=parallel, lora_cache=lora_cache)
        self.drafter = self._drafter(speculative_config, draft_engine, kv_config, device)
        num_blocks, self.memory_line = plan_kv_blocks(engine, kv_config, device, self.runner.kv_bytes_per_token)
        if parallel is not None:                         # every rank's pool has the same blocks: the smallest fits
            num_blocks = parallel.min_over_ranks(num_blocks)
            self.memory_line += f"; {num_blocks} blocks on each of {parallel.mapping.world_size} ranks"
        self.runner.allocate_kv(num_blocks)
        self.runner.capture_graphs()
        self.kv = KVCacheManager(num_blocks, build.plugin_config.tokens_per_block, kv_config.enable_block_reuse)
        self.scheduler = Scheduler(self.kv, build.max_batch_size, build.max_num_tokens, scheduler_policy,
                                   enable_chunked_context, lora_cache.max_loras)
        self.overlap, self.pending = overlap, None      # pending: a launched step whose tokens are not read yet
        self.overlapped_steps = 0
        self.refits = 0                                 # weight updates applied (refit)

    def _drafter(self, config: SpeculativeConfig | None, draft_engine: Engine | None, kv_config: KvCacheConfig,
                 device: torch.device):
        """The drafter of `config` (its draft model loaded with its own KV cache, before this engine's is sized),
        or None."""
        if config is None:
            return None
        self.runner.speculating = True
        if config.method == "ngram":
            return NgramDrafter(config)
        if config.method == "eagle":
            self.runner.keep_hidden = True
            return EagleDrafter(config, self.runner, device)
        draft, target = draft_engine.pretrained_config, self.runner.config
        if draft.vocab_size != target.vocab_size:
            raise ValueError(f"the draft model's vocabulary has {draft.vocab_size} tokens, the model's "
                             f"{target.vocab_size}: a draft model must share the model's tokenizer")
        return DraftModelDrafter(config, draft_engine, device,
                                 lambda bytes_per_token: plan_kv_blocks(draft_engine, kv_config, device,
                                                                        bytes_per_token)[0])

    def set_drafter(self, drafter) -> None:
        """Propose draft tokens with `drafter` (an object with max_draft_len, propose(batch), release(request))
        from now on; None: no speculation."""
        self.drafter, self.runner.speculating = drafter, drafter is not None

    def _draft(self) -> None:
        """Give each generating sequence that may speculate its draft tokens for the next step."""
        batch = []
        for request in self.scheduler.running:
            for seq in request.seqs:
                seq.draft_ids, seq.draft_probs = [], None
            if not self.runner.may_speculate(request):
                continue
            seq = request.seqs[0]
            k = draft_room(request, seq, min(self.drafter.max_draft_len, self.runner.max_draft_len))
            if k > 0 and seq.num_pending_tokens == 1 and seq.token_ids[-1] != PENDING_TOKEN:
                batch.append((request, seq, k))
        if batch:
            self.drafter.propose(batch)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.pending is not None

    def step(self) -> list[Request]:
        """One forward over the scheduled tokens; returns the requests that advanced (or finished)."""
        if self.overlap:
            return self.step_overlapped()
        if self.drafter is not None:
            self._draft()
        out, failed = self._schedule()
        return _unique(failed + (self._complete(out, self.runner.launch(out)) if out else []))

    def step_overlapped(self) -> list[Request]:
        """Schedule and launch step N+1 while step N's greedy tokens are still on the device (they feed N+1's
        inputs there and reach the host in the background), then read step N's tokens. The host's work of
        one step overlaps the device's work of the next; sequences that step N finished have their share of
        step N+1 computed for nothing (and dropped). Steps with other sampling run as usual, in order."""
        if self.drafter is not None:
            self._draft()
        out, failed = self._schedule()
        launch = self.runner.launch(out, self.pending, defer=True) if out else None
        advanced = failed + (self._read(self.pending) if self.pending is not None else [])
        self.pending = None
        if launch is not None and launch.tokens is not None:
            self.scheduler.advance(out, pending=True)
            self.pending = launch
            self.overlapped_steps += 1
        elif launch is not None:
            advanced += self._complete(out, launch)
        return _unique(advanced)

    def _schedule(self):
        """(the next step, the requests ended because their LoRA adapter could not be read: not in the step)."""
        out = self.scheduler.schedule()
        for request in out.preempted:
            self.runner.forget_logits(request)
            request.context_logit_chunks = []
        failed = []
        for request, err in self.runner.place_adapters(out, self.scheduler.running):
            request.error = err
            self.scheduler.finish_request(request, "error")
            self.runner.release(request)
            failed.append(request)
        if failed:
            out.scheduled = [entry for entry in out.scheduled if not entry[0].finished]
        return out, failed

    def _complete(self, out, launch) -> list[Request]:
        """Sample a launched step's tokens and apply them (in order)."""
        if hasattr(self.drafter, "observe"):
            self.drafter.observe(out.scheduled, self.runner.last_hidden)
        result, gathered = self.runner.finish(launch)
        self._attach_logits(gathered)
        self._end_failed(out)
        self._release(self.scheduler.update(out, result))
        return [r for r, _, _ in out.scheduled]

    def _end_failed(self, out) -> None:
        """End the requests whose sampling failed (request.error), freeing their blocks; the others go on."""
        for request, _, _ in out.scheduled:
            if request.error is not None and not request.finished:
                self.scheduler.finish_request(request, "error")
                self.runner.release(request)

    def _read(self, launch) -> list[Request]:
        """Put a deferred step's tokens in place of its sequences' pending tokens."""
        result, _ = self.runner.finish(launch)
        self._release(self.scheduler.apply(launch.out, result, fill=True))
        return [r for r, _, _ in launch.out.scheduled]

    def _release(self, finished: list[Request]) -> None:
        for request in finished:
            self.runner.release(request)
            if self.drafter is not None:
                self.drafter.release(request)

    def _attach_logits(self, gathered: StepLogits) -> None:
        requests = {r.request_id: r for r in self.scheduler.running}
        for request_id, chunk in gathered.context.items():
            request = requests[request_id]
            request.context_logit_chunks.append(chunk)
            if sum(c.shape[0] for c in request.context_logit_chunks) == request.num_prompt_tokens:
                request.context_logits = torch.cat(request.context_logit_chunks)
                request.context_logit_chunks = []
        for request_id, row in gathered.generation.items():
            requests[request_id].generation_logits.append(row)

    def finish_seq(self, request: Request, seq, reason: str) -> None:
        self.scheduler.finish_seq(request, seq, reason)
        if request.finished:
            self._release([request])

    def abort(self, request: Request) -> None:
        self.scheduler.abort(request)
        self._release([request])

    def refit(self, engine: Engine, weights, source=None) -> None:
        """Copy new weights (engine.refit_source's, checked) into the engine's tensors and the network's, a layer at
        a time, with no request in flight (GenerationExecutor.run_when_idle); with several ranks, each reads its own
        share of `source` (a directory) and copies it once every rank has opened its share. Then every cached prefix
        is forgotten: the old weights computed its KV."""
        if self.has_unfinished():
            raise RuntimeError("refit needs an idle engine: requests are still in flight")
        parallel = self.runner.parallel
        try:
            if parallel is None:
                copy_refit(engine, self.runner, weights)
            else:
                parallel.broadcast(Refit(str(source)))
                refit_ranks(engine, self.runner, weights, parallel)
        finally:
            self.kv.reset_prefix_cache()
        self.refits += 1

    def close(self) -> None:
        """Free the device memory (weights, KV cache, graphs); the statistics stay readable."""
        self.runner.close()
        if hasattr(self.drafter, "close"):
            self.drafter.close()

    def stats(self) -> dict:
        kv, sched = self.kv, self.scheduler
        return {"running_requests": len(sched.running), "waiting_requests": len(sched.waiting),
                "kv_blocks_total": kv.num_blocks, "kv_blocks_used": kv.num_used_blocks,
                "kv_blocks_free": kv.num_free_blocks, "kv_tokens_per_block": kv.tokens_per_block,
                "prefix_cache_hit_rate": kv.stats.hit_rate, "prefix_cache_hit_tokens": kv.stats.hit_tokens,
                "prefix_cache_queried_tokens": kv.stats.queried_tokens, "steps": sched.stats.steps,
                "scheduled_tokens": sched.stats.scheduled_tokens, "last_step_tokens": sched.stats.last_step_tokens,
                "tokens_per_step": sched.stats.scheduled_tokens / sched.stats.steps if sched.stats.steps else 0.0,
                "preemptions": sched.stats.preemptions, "overlapped_steps": self.overlapped_steps,
                "refits": self.refits, **speculation_stats(sched.stats),
                "kernels_compiled_at_load": self.runner.kernels_compiled_at_load}


def speculation_stats(stats) -> dict:
    """Draft tokens verified and accepted, the acceptance rate, and the mean tokens a speculative step emitted
    per sequence (accepted drafts + the model's own)."""
    steps = stats.speculative_steps
    return {"draft_tokens": stats.draft_tokens, "accepted_draft_tokens": stats.accepted_draft_tokens,
            "draft_acceptance_rate": stats.accepted_draft_tokens / stats.draft_tokens if stats.draft_tokens else 0.0,
            "mean_accepted_length": 1 + stats.accepted_draft_tokens / steps if steps else 0.0}


def copy_refit(engine: Engine, runner: ModelRunner, weights) -> None:
    """Copy refit weights into the engine's tensors and the network's, a unit (a layer) at a time. A failure once
    copying began (a file that cannot be read) leaves the weights mixed: the error says so; a refit that succeeds
    mends them."""
    reached = 0                                     # units copied into the engine (and then the network)
    try:
        for unit in engine.refit_units(weights):
            reached += 1
            runner.refit(unit)
    except Exception as err:
        if reached == 0:
            raise                                   # nothing was copied: the old weights are whole
        raise RuntimeError(f"refit failed after {reached} of {len(weights.unit_names())} layers began to be copied; "
                           "the engine now holds a mix of old and new weights: refit again "
                           f"({type(err).__name__}: {err})") from err


def refit_ranks(engine: Engine, runner: ModelRunner, opened, parallel) -> None:
    """One refit on every rank together (each calls this once rank 0 has broadcast the Refit): `opened` is this
    rank's share of the source (Engine.refit_source) or the error opening it. No rank copies unless every rank
    opened its share; rank 0 raises the first rank's failure, the others leave it to rank 0."""
    failed = _first_failure(parallel.all_gather(_failure(opened)))
    if failed is not None:
        if parallel.rank == 0:
            raise ValueError(f"rank {failed[0]} cannot refit: {failed[1]}; nothing changed")
        return
    try:
        copy_refit(engine, runner, opened)
        error = None
    except Exception as err:  # noqa: BLE001 - told to rank 0 below
        error = err
    failed = _first_failure(parallel.all_gather(_failure(error)))
    if failed is not None and parallel.rank == 0:
        raise RuntimeError(f"rank {failed[0]} failed to copy the new weights ({failed[1]}); the engine now holds a "
                           "mix of old and new weights: refit again")


def _failure(value) -> str | None:
    return f"{type(value).__name__}: {value}" if isinstance(value, Exception) else None


def _first_failure(failures: list[str | None]) -> tuple[int, str] | None:
    return next(((rank, failure) for rank, failure in enumerate(failures) if failure), None)


def _unique(requests: list[Request]) -> list[Request]:
    return list({id(r): r for r in requests}.values())
