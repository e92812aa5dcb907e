"""The only place the runtime touches tensors: copies KV blocks, packs a step's inputs, runs the network,
keeps each finished sequence's last logits until its siblings are done, and samples."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kiln.builder import Engine
from kiln.kernels import AttentionMetadata
from kiln.models import model_class

from . import sampler
from .beam_search import beams_to_keep
from .request import Request
from .scheduler import ModelStepOutput, SampledToken, SchedulerOutput


@dataclass
class StepLogits:
    """Logits the engine was asked to gather: prompt positions (per request) and sampled positions."""

    context: dict[int, torch.Tensor] = field(default_factory=dict)      # request id → (chunk, V) on the CPU
    generation: dict[int, torch.Tensor] = field(default_factory=dict)   # request id → (V,) on the CPU


class ModelRunner:
    def __init__(self, engine: Engine, num_blocks: int, device: torch.device, normalize_log_probs: bool = False,
                 rank: int = 0):
        config, build = engine.pretrained_config, engine.build_config
        self.device, self.normalize_log_probs = device, normalize_log_probs
        self.net = model_class(config.architecture).network_class.load(config, engine.weights[rank],
                                                                      build.max_seq_len, device)
        self.tokens_per_block = build.plugin_config.tokens_per_block
        self.gather_context_logits = build.gather_context_logits
        self.gather_generation_logits = build.gather_generation_logits
        shape = (2, num_blocks, self.tokens_per_block, config.num_key_value_heads, config.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=getattr(torch, config.dtype), device=device)
                          for _ in range(config.num_hidden_layers)]
        self.generators: dict[tuple[int, int], torch.Generator] = {}
        self.last_logits: dict[int, torch.Tensor] = {}     # seq id → (V,) logits of its last computed token

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _prepare(self, out: SchedulerOutput):
        ids, positions, slots, starts, seq_lens, tables = [], [], [], [0], [], []
        bs = self.tokens_per_block
        for _, seq, n in out.scheduled:
            begin, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids += seq.token_ids[begin:end]
            positions += range(begin, end)
            blocks = seq.block_ids
            slots += [blocks[i // bs] * bs + i % bs for i in range(begin, end)]
            starts.append(starts[-1] + n)
            seq_lens.append(end)
            tables.append(blocks)
        width = max(len(t) for t in tables)
        meta = AttentionMetadata(slot_mapping=self._tensor(slots), query_start_loc=self._tensor(starts),
                                 seq_lens=self._tensor(seq_lens),
                                 block_tables=self._tensor([t + [0] * (width - len(t)) for t in tables]),
                                 max_query_len=max(n for _, _, n in out.scheduled), max_seq_len=max(seq_lens),
                                 tokens_per_block=bs)
        return self._tensor(ids), self._tensor(positions), meta, starts

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            src, dst = self._tensor([s for s, _ in copies]), self._tensor([d for _, d in copies])
            for cache in self.kv_caches:
                cache[:, dst] = cache[:, src]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[ModelStepOutput, StepLogits]:
        self._copy_blocks(out.block_copies)
        input_ids, positions, meta, starts = self._prepare(out)
        hidden = self.net(input_ids, positions, meta, self.kv_caches)                   # (T, hidden)
        gathered = StepLogits()
        done = [(i, seq) for i, (_, seq, n) in enumerate(out.scheduled) if seq.num_computed_tokens + n == seq.num_tokens]
        if done:
            rows = self.net.compute_logits(hidden[self._tensor([starts[i + 1] - 1 for i, _ in done])])  # (B, V)
            for (_, seq), row in zip(done, rows):
                self.last_logits[seq.seq_id] = row
        if self.gather_context_logits:
            self._gather_context(out, hidden, starts, gathered)
        return self._sample(out, gathered), gathered

    def _gather_context(self, out, hidden, starts, gathered: StepLogits) -> None:
        for i, (request, seq, n) in enumerate(out.scheduled):
            prompt_left = request.num_prompt_tokens - seq.num_computed_tokens
            if seq is request.seqs[0] and request.context_logits is None and prompt_left > 0:
                count = min(n, prompt_left)
                gathered.context[request.request_id] = self.net.compute_logits(hidden[starts[i]:starts[i] + count]).cpu()

    def _sample(self, out: SchedulerOutput, gathered: StepLogits) -> ModelStepOutput:
        result = ModelStepOutput()
        for request in {id(r): r for r, _, _ in out.scheduled}.values():
            if not all(seq.seq_id in self.last_logits for seq in request.seqs):
                continue                                   # a sibling is still being computed
            rows = torch.stack([self.last_logits.pop(seq.seq_id) for seq in request.seqs])
            if request.sampling.use_beam_search:
                result.beam_candidates[request.request_id] = sampler.beam_candidates(rows, request, beams_to_keep(request))
                continue
            if self.gather_generation_logits:
                gathered.generation[request.request_id] = rows[0].cpu()
            result.tokens[request.request_id] = self._choose(request, rows)
        return result

    def _choose(self, request: Request, rows: torch.Tensor) -> list[SampledToken]:
        sampling, seqs = request.sampling, request.seqs
        fan_out = len(seqs) == 1 and seqs[0].num_output_tokens == 0 and sampling.n > 1
        picks = [(0, i) for i in range(sampling.n)] if fan_out else [(j, s.sample_index) for j, s in enumerate(seqs)]
        tokens = []
        for parent, sample_index in picks:
            seq = seqs[parent]
            logits = sampler.suppress_stop_tokens(sampler.apply_penalties(rows[parent], seq, sampling), request, seq)
            token, logprob = sampler.choose(logits, sampling, self._generator(request, sample_index),
                                            self.normalize_log_probs)
            tokens.append(SampledToken(parent, token, logprob, sample_index if fan_out else None))
        return tokens

    def _generator(self, request: Request, sample_index: int) -> torch.Generator | None:
        if request.sampling.greedy:
            return None
        key = (request.request_id, sample_index)
        if key not in self.generators:
            generator = torch.Generator(device=self.device)
            seed = request.sampling.random_seed
            if seed is None:
                generator.seed()
            else:
                generator.manual_seed(seed + sample_index)
            self.generators[key] = generator
        return self.generators[key]

    def forget_logits(self, request: Request) -> None:
        for seq in request.all_seqs():
            self.last_logits.pop(seq.seq_id, None)

    def release(self, request: Request) -> None:
        """Forget a finished or aborted request's generators and pending logits."""
        self.forget_logits(request)
        for key in [k for k in self.generators if k[0] == request.request_id]:
            del self.generators[key]
