"""The only place the runtime touches tensors: packs a step's inputs, runs the network, samples."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kiln.builder import Engine
from kiln.kernels import AttentionMetadata
from kiln.models import model_class

from .sampler import sample
from .scheduler import SchedulerOutput


@dataclass
class RunnerOutput:
    sampled: list[int]
    context_logits: dict[int, torch.Tensor] = field(default_factory=dict)     # request id → (prompt_len, V)
    generation_logits: dict[int, torch.Tensor] = field(default_factory=dict)  # request id → (V,)


class ModelRunner:
    def __init__(self, engine: Engine, num_blocks: int, device: torch.device, rank: int = 0):
        config, build = engine.pretrained_config, engine.build_config
        self.device = device
        self.net = model_class(config.architecture).network_class.load(config, engine.weights[rank],
                                                                      build.max_seq_len, device)
        self.tokens_per_block = build.plugin_config.tokens_per_block
        self.gather_context_logits = build.gather_context_logits
        self.gather_generation_logits = build.gather_generation_logits
        shape = (2, num_blocks, self.tokens_per_block, config.num_key_value_heads, config.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=getattr(torch, config.dtype), device=device)
                          for _ in range(config.num_hidden_layers)]
        self.generators: dict[int, torch.Generator] = {}

    def _prepare(self, out: SchedulerOutput):
        ids, positions, slots, starts, seq_lens, tables = [], [], [], [0], [], []
        bs = self.tokens_per_block
        for request, n in out.scheduled:
            begin, end = request.num_computed_tokens, request.num_computed_tokens + n
            ids += request.token_ids(begin, end)
            positions += range(begin, end)
            blocks = request.block_ids
            slots += [blocks[i // bs] * bs + i % bs for i in range(begin, end)]
            starts.append(starts[-1] + n)
            seq_lens.append(end)
            tables.append(blocks)
        width = max(len(t) for t in tables)
        tensor = lambda x: torch.tensor(x, dtype=torch.int64, device=self.device)  # noqa: E731
        meta = AttentionMetadata(slot_mapping=tensor(slots), query_start_loc=tensor(starts), seq_lens=tensor(seq_lens),
                                 block_tables=tensor([t + [0] * (width - len(t)) for t in tables]),
                                 max_query_len=max(n for _, n in out.scheduled), max_seq_len=max(seq_lens),
                                 tokens_per_block=bs)
        return tensor(ids), tensor(positions), meta

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        input_ids, positions, meta = self._prepare(out)
        hidden = self.net(input_ids, positions, meta, self.kv_caches)                  # (T, hidden)
        logits = self.net.compute_logits(hidden[meta.query_start_loc[1:] - 1])           # (B, V)
        requests = [r for r, _ in out.scheduled]
        generators = [self._generator(r) for r in requests]
        result = RunnerOutput(sample(logits, [r.sampling for r in requests], generators).tolist())
        starts = meta.query_start_loc.tolist()
        for b, request in enumerate(requests):
            if self.gather_context_logits and request.num_computed_tokens < request.num_prompt_tokens:
                n_prompt = request.num_prompt_tokens - request.num_computed_tokens
                result.context_logits[request.request_id] = self.net.compute_logits(
                    hidden[starts[b]:starts[b] + n_prompt]).cpu()
            if self.gather_generation_logits:
                result.generation_logits[request.request_id] = logits[b].cpu()
        return result

    def _generator(self, request) -> torch.Generator | None:
        if request.sampling.greedy:
            return None
        if request.request_id not in self.generators:
            generator = torch.Generator(device=self.device)
            if request.sampling.random_seed is None:
                generator.seed()
            else:
                generator.manual_seed(request.sampling.random_seed)
            self.generators[request.request_id] = generator
        return self.generators[request.request_id]

    def release(self, request_id: int) -> None:
        self.generators.pop(request_id, None)
