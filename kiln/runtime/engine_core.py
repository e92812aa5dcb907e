"""EngineCore: owns the scheduler, the KV cache and the model runner; step() = schedule → execute → update."""
from __future__ import annotations

import torch

from kiln.builder import Engine
from kiln.config import KvCacheConfig, SchedulerPolicy

from .kv_cache import KVCacheManager
from .model_runner import ModelRunner, StepLogits
from .request import Request
from .scheduler import Scheduler


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
                 enable_chunked_context: bool = False, normalize_log_probs: bool = False, parallel=None):
        build, kv_config = engine.build_config, kv_cache_config or KvCacheConfig()
        self.runner = ModelRunner(engine, device, normalize_log_probs, parallel=parallel)
        num_blocks, self.memory_line = plan_kv_blocks(engine, kv_config, device, self.runner.kv_bytes_per_token)
        if parallel is not None:                         # every rank's pool has the same blocks: the smallest fits
            num_blocks = parallel.min_over_ranks(num_blocks)
            self.memory_line += f"; {num_blocks} blocks on each of {parallel.mapping.world_size} ranks"
        self.runner.allocate_kv(num_blocks)
        self.runner.capture_graphs()
        self.kv = KVCacheManager(num_blocks, build.plugin_config.tokens_per_block, kv_config.enable_block_reuse)
        self.scheduler = Scheduler(self.kv, build.max_batch_size, build.max_num_tokens, scheduler_policy,
                                   enable_chunked_context)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Request]:
        """One forward over the scheduled tokens; returns the requests that advanced (or finished)."""
        out = self.scheduler.schedule()
        for request in out.preempted:
            self.runner.forget_logits(request)
            request.context_logit_chunks = []
        if not out:
            return []
        result, gathered = self.runner.execute(out)
        self._attach_logits(gathered)
        finished = self.scheduler.update(out, result)
        for request in finished:
            self.runner.release(request)
        return list({id(r): r for r, _, _ in out.scheduled}.values())

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
            self.runner.release(request)

    def abort(self, request: Request) -> None:
        self.scheduler.abort(request)
        self.runner.release(request)

    def stats(self) -> dict:
        kv, sched = self.kv, self.scheduler
        return {"running_requests": len(sched.running), "waiting_requests": len(sched.waiting),
                "kv_blocks_total": kv.num_blocks, "kv_blocks_used": kv.num_used_blocks,
                "kv_blocks_free": kv.num_free_blocks, "kv_tokens_per_block": kv.tokens_per_block,
                "prefix_cache_hit_rate": kv.stats.hit_rate, "prefix_cache_hit_tokens": kv.stats.hit_tokens,
                "prefix_cache_queried_tokens": kv.stats.queried_tokens, "steps": sched.stats.steps,
                "scheduled_tokens": sched.stats.scheduled_tokens, "last_step_tokens": sched.stats.last_step_tokens,
                "tokens_per_step": sched.stats.scheduled_tokens / sched.stats.steps if sched.stats.steps else 0.0,
                "preemptions": sched.stats.preemptions,
                "kernels_compiled_at_load": self.runner.kernels_compiled_at_load}
