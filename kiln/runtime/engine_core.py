"""EngineCore: owns the scheduler, the KV cache and the model runner; step() = schedule → execute → update."""
from __future__ import annotations

import sys

import torch

from kiln.builder import Engine
from kiln.config import KvCacheConfig

from .kv_cache import KVCacheManager
from .model_runner import ModelRunner
from .request import Request
from .scheduler import Scheduler


def plan_kv_blocks(engine: Engine, kv_config: KvCacheConfig, device: torch.device) -> tuple[int, str]:
    """Number of KV-cache blocks, and a one-line account of how it was chosen."""
    config, build = engine.pretrained_config, engine.build_config
    tpb = build.plugin_config.tokens_per_block
    bytes_per_token = (2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
                       * getattr(torch, config.dtype).itemsize)
    want = build.max_batch_size * build.max_seq_len
    if kv_config.max_tokens is not None:
        want = min(want, kv_config.max_tokens)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget, where = int(free * kv_config.free_gpu_memory_fraction), f"{kv_config.free_gpu_memory_fraction:.0%} of free GPU memory"
    else:
        budget, where = kv_config.host_cache_bytes, "host_cache_bytes"
    tokens = min(want, budget // bytes_per_token)
    blocks = tokens // tpb
    need = -(-build.max_seq_len // tpb)
    if blocks < need:
        raise ValueError(f"the KV cache fits {blocks} blocks ({where}: {budget / 2**20:.0f} MiB), but one "
                         f"max_seq_len={build.max_seq_len} request needs {need}; give it more memory or lower max_seq_len")
    line = (f"KV cache: {blocks} blocks × {tpb} tokens = {blocks * tpb} tokens, "
            f"{blocks * tpb * bytes_per_token / 2**20:.0f} MiB (limit: {where}, {want} tokens wanted)")
    return blocks, line


class EngineCore:
    """Runs requests to completion, many at once (in-flight batching over a paged KV cache)."""

    def __init__(self, engine: Engine, device: torch.device, kv_cache_config: KvCacheConfig | None = None,
                 quiet: bool = False):
        build = engine.build_config
        num_blocks, line = plan_kv_blocks(engine, kv_cache_config or KvCacheConfig(), device)
        if not quiet:
            print(line, file=sys.stderr)
        self.kv = KVCacheManager(num_blocks, build.plugin_config.tokens_per_block)
        self.scheduler = Scheduler(self.kv, build.max_batch_size, build.max_num_tokens)
        self.runner = ModelRunner(engine, num_blocks, device)

    def add_request(self, request: Request) -> None:
        if self.kv.blocks_for(request.max_tokens) > self.kv.num_blocks:
            raise ValueError(f"request {request.request_id} needs {request.max_tokens} tokens of KV cache; "
                             f"the cache holds {self.kv.num_blocks * self.kv.tokens_per_block}")
        self.scheduler.add_request(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Request]:
        """One forward over the scheduled tokens; returns the requests that finished."""
        out = self.scheduler.schedule()
        if not out:
            return []
        result = self.runner.execute(out)
        for request, _ in out.scheduled:
            if request.request_id in result.context_logits:
                request.context_logits = result.context_logits[request.request_id]
            if request.request_id in result.generation_logits:
                request.generation_logits.append(result.generation_logits[request.request_id])
        finished = self.scheduler.update(out, result.sampled)
        for request in finished:
            self.runner.release(request.request_id)
        return finished
