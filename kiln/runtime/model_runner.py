"""The only place the runtime touches tensors: copies KV blocks, packs a step's inputs, runs the network (a CUDA
graph for one-token steps on a GPU), keeps each finished sequence's last logits until its siblings are done,
and samples — greedy requests in one batched argmax, with one device-to-host copy per step."""
from __future__ import annotations

import gc

import sys
from dataclasses import dataclass, field

import torch

from kiln.builder import Engine
from kiln.config import LoraCacheConfig
from kiln.kernels import AttentionMetadata, TritonOptions, select_ops
from kiln.models import model_class

from . import sampler
from .beam_search import beams_to_keep
from .kernel_cache import count_entries, install
from .lora import LoraManager
from .prompt_table import take_table_rows
from .request import PENDING_TOKEN, Request, Sequence, may_speculate
from .scheduler import ModelStepOutput, SampledToken, SchedulerOutput
from .step import Step, leading_decodes, split_step

@dataclass
class StepLogits:
    """Logits the engine was asked to gather: prompt positions (per request) and sampled positions."""

    context: dict[int, torch.Tensor] = field(default_factory=dict)      # request id → (chunk, V) on the CPU
    generation: dict[int, torch.Tensor] = field(default_factory=dict)   # request id → (V,) on the CPU


class Launch:
    """A step started on the device: what `finish` needs to produce its tokens."""

    def __init__(self, out: SchedulerOutput, done: list[Sequence], context, logits, drafted=()):
        self.out, self.done, self.context, self.logits = out, done, context, logits
        self.row_of = {seq.seq_id: i for i, seq in enumerate(done)}        # logits row of each finished sequence
        first = len(done) + sum(len(rows) for _, rows in context)
        self.draft_rows = {}                  # seq id → logits after its last token and each draft but the last
        for seq in drafted:
            self.draft_rows[seq.seq_id] = (first, first + len(seq.draft_ids))
            first += len(seq.draft_ids)
        self.tokens = self.request_of = self._host = self._copied = None

    @property
    def rows(self) -> torch.Tensor | None:
        """Logits of the sequences whose tokens are all computed, in `done` order."""
        return self.logits[:len(self.done)] if self.done else None

    def defer(self, tokens: torch.Tensor) -> None:
        """Keep the greedy tokens on the device (the next step reads them there) and copy them to the host
        in the background."""
        self.tokens = tokens
        self.request_of = {seq.seq_id: r for r, seq, _ in self.out.scheduled}
        if tokens.device.type == "cuda":
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            self._host = tokens

    def host_tokens(self) -> list[int]:
        if self._copied is not None:
            self._copied.synchronize()
        return self._host.tolist()


class ModelRunner:
    def __init__(self, engine: Engine, device: torch.device, normalize_log_probs: bool = False, rank: int = 0,
                 parallel=None, lora_cache: LoraCacheConfig | None = None):
        config, build = engine.pretrained_config, engine.build_config
        self.config, self.device, self.normalize_log_probs = config, device, normalize_log_probs
        self.parallel = parallel                       # a kiln.distributed.ParallelContext when world_size > 1
        plugins = build.plugin_config
        self.net = model_class(config.architecture).network_class.load(
            config, engine.weights[rank], build.max_seq_len, device,
            ops=select_ops(device, TritonOptions(context_fmha=plugins.context_fmha,
                                                 fp8_context_fmha=plugins.use_fp8_context_fmha,
                                                 fp8_fast_accumulation=plugins.fp8_fast_accumulation,
                                                 pdl=plugins.programmatic_dependent_launch,
                                                 refittable=build.use_refit), plugins.cpu_kernels),
            comm=parallel.comm if parallel is not None else None)
        if build.weight_sparsity:
            self.net.use_sparse_weights()
        self.tokens_per_block = plugins.tokens_per_block
        self.max_blocks_per_seq = -(-build.max_seq_len // self.tokens_per_block)
        self.multi_block_mode = plugins.multi_block_mode
        self.gather_context_logits = build.gather_context_logits
        self.gather_generation_logits = build.gather_generation_logits
        self.max_decode_batch = build.max_batch_size * build.max_beam_width
        self.kv_caches: list[torch.Tensor] = []
        self.graphs = self.verify_graphs = None    # CUDA graphs of one-token steps, of speculative steps
        self.kernel_dir = None
        if device.type == "cuda" and engine.kernel_cache:
            self.kernel_dir = install(engine.kernel_cache)
            self._kernels_before = count_entries(self.kernel_dir)
        self.kernels_compiled_at_load: int | None = None
        self.generators: dict[tuple[int, int], torch.Generator] = {}
        self.last_logits: dict[int, torch.Tensor] = {}     # seq id → (V,) logits of its last computed token
        reserve = plugins.lora_plugin is not None or bool(build.lora_config.lora_dir)
        self.lora = LoraManager(self.net, config, build.lora_config, lora_cache or LoraCacheConfig(), device, reserve)
        self._adapters: tuple[dict[str, int], list] | None = None    # the next launch's (slots, loads)
        self.max_draft_len = build.max_draft_len          # draft tokens a sequence may have verified per step
        self.speculating = False                          # a drafter proposes: never defer a request it may draft for
        self.keep_hidden = False                          # keep the last step's hidden states (EAGLE drafts from them)
        self.last_hidden: torch.Tensor | None = None      # (the step's packed rows, hidden), where kept

    @property
    def kv_dtype(self) -> torch.dtype:
        kind = self.config.quantization.kv_cache_quant_algo
        return {"INT8": torch.int8, "FP8": torch.float8_e4m3fn}.get(kind, getattr(torch, self.config.dtype))

    @property
    def kv_bytes_per_token(self) -> int:
        dims = self.net.dims
        return 2 * len(dims.layers) * dims.kv_heads * self.config.head_dim * self.kv_dtype.itemsize

    def allocate_kv(self, num_blocks: int) -> None:
        shape = (2, num_blocks, self.tokens_per_block, self.net.dims.kv_heads, self.config.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in self.net.layers]

    def capture_graphs(self) -> None:
        """One CUDA graph per decode batch bucket (GPU with the Triton kernels only; with tensor parallelism every
        rank captures the same buckets in the same order, the NCCL collectives inside the graphs)."""
        pipelined = self.parallel is not None and self.config.mapping.pp_size > 1
        if self.device.type != "cuda" or self.net.ops.name != "triton" or pipelined:
            return
        from .cuda_graphs import CudaGraphs, VerifyGraphs
        try:
            with torch.inference_mode():
                stacks = list(self.lora.stacks.values())
                lora_slots = self.lora.max_loras if stacks and all(map(self.net.ops.lora_in_graphs, stacks)) else 0
                self.graphs = CudaGraphs(self.net, self.kv_caches, self.max_decode_batch, self.max_blocks_per_seq,
                                         self.tokens_per_block, self._parts, self.net.ops.long_context, lora_slots)
                if self.max_draft_len and self.parallel is None:
                    self.verify_graphs = VerifyGraphs(self.net, self.kv_caches, self.max_decode_batch,
                                                      self.max_blocks_per_seq, self.tokens_per_block,
                                                      self.max_draft_len)
        except RuntimeError as err:
            if self.parallel is None:
                raise
            self.graphs, failure = None, f"{type(err).__name__}: {err}"
        else:
            failure = None
        if self.parallel is not None and not self.parallel.all_true(failure is None):
            self.graphs = None                      # every rank replays graphs, or none does
            print(f"note: rank {self.parallel.rank}: decode steps run without CUDA graphs (capturing them with "
                  f"the collectives failed{': ' + failure if failure else ' on another rank'})", file=sys.stderr)
        if self.kernel_dir is not None:
            self.kernels_compiled_at_load = count_entries(self.kernel_dir) - self._kernels_before

    def _graph_parts(self, batch: int, max_seq_len: int) -> tuple[int, int | None]:
        """Split-K partitions of a one-token step run without a graph, as the CUDA graph of its bucket has them (its
        long-sequence graph past the ops' long_context): the same split, so the same roundings, in a graph or not."""
        from .cuda_graphs import bucket_keys, bucket_of, bucket_sizes

        long_context = self.net.ops.long_context
        keys = bucket_keys(self.max_blocks_per_seq * self.tokens_per_block, long_context, max_seq_len > long_context)
        return self._parts(bucket_of(bucket_sizes(self.max_decode_batch), batch), keys)

    def _parts(self, batch: int, max_keys: int) -> tuple[int, int | None]:
        """Split-K partitions for a decode step of `batch` sequences (the ops' decode_partitions)."""
        if not self.multi_block_mode:
            return 1, None
        return self.net.ops.decode_partitions(batch, max_keys, self.net.dims.heads, self.kv_caches[0])

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)

    def _prepare(self, out: SchedulerOutput):
        ids, positions, slots, starts, seq_lens, tables = [], [], [], [0], [], []
        bs = self.tokens_per_block
        for _, seq, n in out.scheduled:
            begin, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            if n == 1:                                     # a generating sequence: its one new token
                blocks = seq.block_ids
                ids.append(seq.token_ids[begin])
                positions.append(begin)
                slots.append(blocks[begin // bs] * bs + begin % bs)
                starts.append(starts[-1] + 1)
                seq_lens.append(end)
                tables.append(blocks)
                continue
            tokens = seq.token_ids + seq.draft_ids if seq.draft_ids else seq.token_ids
            if tokens[end - 1] == PENDING_TOKEN:
                raise RuntimeError(f"sequence {seq.seq_id}: a chunk of {n} tokens ends in a token still on the device")
            ids += tokens[begin:end]
            positions += range(begin, end)
            blocks = seq.block_ids
            slots += [blocks[i // bs] * bs + i % bs for i in range(begin, end)]
            starts.append(starts[-1] + n)
            seq_lens.append(end)
            tables.append(blocks)
        return ids, positions, slots, starts, seq_lens, tables

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            src, dst = self._tensor([s for s, _ in copies]), self._tensor([d for _, d in copies])
            for cache in self.kv_caches:
                cache[:, dst] = cache[:, src]

    def place_adapters(self, out: SchedulerOutput, running: list[Request]) -> list[tuple[Request, Exception]]:
        """Put the LoRA adapters of the step's requests into device slots for the next `launch`; returns the
        requests whose adapter could not be read (with why). Nothing to do while no adapter was ever asked for."""
        self._adapters = None
        if not self.lora.known or all(r.lora_request is None for r, _, _ in out.scheduled):
            return []
        slots, loads, failed = self.lora.assign([r for r, _, _ in out.scheduled], running)
        self._adapters = slots, loads
        return failed

    def _lora_slots(self, out: SchedulerOutput) -> tuple[list[int] | None, list]:
        """(adapter slot of each scheduled sequence, -1 for none; adapters installed for this step)."""
        if self._adapters is None:
            return None, []
        slots, loads = self._adapters
        self._adapters = None
        return [-1 if r.lora_request is None else slots[r.lora_request.name] for r, _, _ in out.scheduled], loads

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, previous: "Launch | None" = None, defer: bool = False) -> "Launch":
        """Start a step on the device. PENDING_TOKEN inputs are taken on the device from `previous`'s sampled
        tokens. With `defer` (and only greedy, one-sequence requests finishing their tokens) the step's tokens
        stay on the device and are copied to the host in the background: `finish` reads them later."""
        ids, positions, slots, starts, seq_lens, tables = self._prepare(out)
        ends = [i for i, (_, seq, n) in enumerate(out.scheduled)
                if seq.num_computed_tokens + n == seq.num_tokens + len(seq.draft_ids)]
        context = self._context_rows(out, starts) if self.gather_context_logits else []
        drafted = [(i, seq) for i, (_, seq, _) in enumerate(out.scheduled) if seq.draft_ids]
        draft_rows = [row for i, seq in drafted for row in range(starts[i + 1] - 1 - len(seq.draft_ids),
                                                                  starts[i + 1] - 1)]
        embeds = take_table_rows(out.scheduled, ids, starts)
        step = Step(out.block_copies, ids, positions, slots, starts, seq_lens, tables,
                    max(n for _, _, n in out.scheduled), max(seq_lens),
                    [starts[i + 1] - 1 for i in ends] + [row for _, rows in context for row in rows] + draft_rows,
                    *self._lora_slots(out), prompt_embeds=embeds)
        if self.parallel is not None:
            self.parallel.broadcast(step)
        fill = self._pending_inputs(out, starts, previous)
        logits = self.run_step(step, fill)                                            # (rows, V)
        launch = Launch(out, [out.scheduled[i][1] for i in ends], context, logits, [seq for _, seq in drafted])
        if defer and ends and not drafted and self._deferrable(out, launch.row_of):
            launch.defer(self.net.ops.argmax_rows(launch.rows))
        return launch

    def finish(self, launch: "Launch") -> tuple[ModelStepOutput, StepLogits]:
        """The step's sampled tokens on the host (sampling them now unless they were deferred)."""
        out, gathered = launch.out, StepLogits()
        if launch.tokens is not None:
            result = ModelStepOutput()
            for seq, token in zip(launch.done, launch.host_tokens()):
                result.tokens[launch.request_of[seq.seq_id].request_id] = [SampledToken(0, token)]
            return result, gathered
        offset = len(launch.done)
        for request_id, context_rows in launch.context:
            gathered.context[request_id] = launch.logits[offset:offset + len(context_rows)].cpu()
            offset += len(context_rows)
        return self._sample(out, launch.rows, launch.done, gathered, launch), gathered

    def _deferrable(self, out: SchedulerOutput, row_of: dict[int, int]) -> bool:
        finishing = {id(r): r for r, seq, _ in out.scheduled if seq.seq_id in row_of}
        return (self.parallel is None and not self.gather_generation_logits and not self.gather_context_logits
                and all(self._simple(r, row_of) for r in finishing.values())
                and not (self.speculating and any(map(self.may_speculate, finishing.values()))))

    def may_speculate(self, request: Request) -> bool:
        """Whether drafts may be verified for the request (speculative.may_speculate; not where the engine returns
        generation logits, one row per step)."""
        return self.max_draft_len > 0 and not self.gather_generation_logits and may_speculate(request)

    def _pending_inputs(self, out: SchedulerOutput, starts: list[int], previous: "Launch | None"):
        """(packed rows, device tokens) for the inputs that are still on the device, or None."""
        waiting = [(starts[i], seq) for i, (_, seq, n) in enumerate(out.scheduled)
                   if n == 1 and seq.token_ids[seq.num_computed_tokens] == PENDING_TOKEN]
        if not waiting:
            return None
        if previous is None or previous.tokens is None:
            raise RuntimeError("a step has pending input tokens but no deferred step to take them from")
        sources = [previous.row_of[seq.seq_id] for _, seq in waiting]
        return self._tensor([row for row, _ in waiting]), previous.tokens[self._tensor(sources)]

    def _context_rows(self, out: SchedulerOutput, starts: list[int]) -> list[tuple[int, list[int]]]:
        """Packed rows whose logits a gather_context_logits engine returns: the prompt positions computed now."""
        context = []
        for i, (request, seq, n) in enumerate(out.scheduled):
            prompt_left = request.num_prompt_tokens - seq.num_computed_tokens
            if seq is request.seqs[0] and request.context_logits is None and prompt_left > 0:
                context.append((request.request_id, list(range(starts[i], starts[i] + min(n, prompt_left)))))
        return context

    def run_step(self, step: Step, fill=None) -> torch.Tensor | None:
        """One forward pass of this rank's stage; on rank 0, the logits of step.logit_rows (float32, or the model's
        dtype from a CUDA graph). Steps where every sequence computes its one next token replay a CUDA graph when
        there is one (with LoRA adapters: when the graphs were captured with them). `fill`: (packed rows, device
        tokens) to put into the input ids on the device (tokens not on the host yet)."""
        n = len(step.input_ids)
        if (self.graphs is not None and step.max_query_len == 1 and len(step.logit_rows) == n
                and self.graphs.fits(n) and (step.lora_slots is None or self.graphs.lora_slots)
                and step.prompt_embeds is None):
            self._copy_blocks(step.block_copies)
            logits = self.graphs.run(step.input_ids, step.positions, step.slot_mapping, step.seq_lens,
                                     step.block_tables, long=step.max_seq_len > self.net.ops.long_context, fill=fill,
                                     lora_slots=step.lora_slots)
            self.last_hidden = self.graphs.last_hidden
            return logits
        self.last_hidden = None
        if (self.verify_graphs is not None and step.max_query_len > 1 and step.prompt_embeds is None
                and self.verify_graphs.takes(step)):
            self._copy_blocks(step.block_copies)
            logits = self.verify_graphs.run(step, fill)
            self.last_hidden = self.verify_graphs.last_hidden
            return logits
        if self.parallel is not None and self.config.mapping.pp_size > 1:
            return self._run_pipelined(step)
        self._copy_blocks(step.block_copies)
        input_ids = self._tensor(step.input_ids)
        if fill is not None:
            input_ids[fill[0]] = fill[1]
        hidden = self.net(input_ids, self._tensor(step.positions), self._metadata(step), self.kv_caches,
                          self._input_embeds(input_ids, step))
        self.last_hidden = hidden if self.keep_hidden else None
        return self._logits(hidden, step)

    def _input_embeds(self, input_ids: torch.Tensor, step: Step) -> torch.Tensor | None:
        """The step's token embeddings with its prompt-table rows put in; None (the network embeds) without."""
        if step.prompt_embeds is None:
            return None
        positions, rows = step.prompt_embeds
        embeds = self.net.embed(input_ids)
        embeds[self._tensor(positions)] = rows.to(self.device, embeds.dtype, non_blocking=True)
        return embeds

    def _metadata(self, step: Step) -> AttentionMetadata:
        width = max(len(t) for t in step.block_tables)
        meta = AttentionMetadata(slot_mapping=self._tensor(step.slot_mapping),
                                 query_start_loc=self._tensor(step.query_start_loc),
                                 seq_lens=self._tensor(step.seq_lens),
                                 block_tables=self._tensor([t + [0] * (width - len(t)) for t in step.block_tables]),
                                 max_query_len=step.max_query_len, max_seq_len=step.max_seq_len,
                                 tokens_per_block=self.tokens_per_block, lora=self.lora.batch(step))
        if step.max_query_len == 1:
            meta.num_parts, meta.part_tokens = self._graph_parts(len(step.seq_lens), step.max_seq_len)
        else:
            meta.decode_seqs = leading_decodes(step.query_start_loc)
        return meta

    def _logits(self, hidden: torch.Tensor, step: Step) -> torch.Tensor:
        if not step.logit_rows:
            return torch.empty((0, self.config.vocab_size), device=self.device)
        return self.net.compute_logits(hidden[self._tensor(step.logit_rows)])

    def _run_pipelined(self, step: Step) -> torch.Tensor | None:
        """This stage's share of a pipelined step: one micro-batch per stage, each sent on as soon as it is
        computed, so stage s works on micro-batch i while stage s+1 works on micro-batch i-1."""
        dims, parallel = self.net.dims, self.parallel
        dtype = getattr(torch, self.config.dtype)
        self._copy_blocks(step.block_copies)
        micro_batches, in_flight = split_step(step, self.config.mapping.pp_size), []
        for sub, _ in micro_batches:
            input_ids = self._tensor(sub.input_ids)
            hidden_in = self._input_embeds(input_ids, sub) if dims.first_stage else parallel.recv_hidden(
                len(sub.input_ids), self.config.hidden_size, dtype)
            hidden = self.net(input_ids, self._tensor(sub.positions), self._metadata(sub), self.kv_caches, hidden_in)
            sent = parallel.send_hidden(hidden) if not dims.last_stage else \
                parallel.send_logits(self._logits(hidden, sub))
            in_flight.append(sent)
        for sent in in_flight:
            if sent is not None:
                sent[1].wait()
        if parallel.rank != 0:
            return None
        logits = torch.empty((len(step.logit_rows), self.config.vocab_size), dtype=torch.float32, device=self.device)
        for sub, owned in micro_batches:
            if owned:
                logits[self._tensor(owned)] = parallel.recv_logits(len(owned), self.config.vocab_size)
        return logits

    # --- sampling -----------------------------------------------------------------------------------------
    def _sample(self, out: SchedulerOutput, rows: torch.Tensor | None, done: list[Sequence],
                gathered: StepLogits, launch: Launch | None = None) -> ModelStepOutput:
        result = ModelStepOutput()
        if rows is None:
            return result
        row_of = {seq.seq_id: i for i, seq in enumerate(done)}
        requests = list({id(r): r for r, _, _ in out.scheduled}.values())
        if launch is not None and launch.draft_rows:
            drafted = [r for r in requests if r.seqs and r.seqs[0].seq_id in launch.draft_rows]
            plain = [r for r in drafted if sampler.plain_greedy(r, r.seqs[0])]
            self._verify_greedy(plain, launch, row_of, result)
            for request in drafted:
                if request not in plain:
                    self._verify(request, launch, row_of, result)
            requests = [r for r in requests if r not in drafted]
        simple = [r for r in requests if self._simple(r, row_of)]
        if simple:                                    # batched greedy: one argmax, one copy to the host
            order = [row_of[r.seqs[0].seq_id] for r in simple]
            chosen = rows if order == list(range(rows.shape[0])) else rows[self._tensor(order)]
            picks = self.net.ops.argmax_rows(chosen).tolist()
            for request, token in zip(simple, picks):
                result.tokens[request.request_id] = [SampledToken(0, token)]
        simple_ids = {id(r) for r in simple}
        for request in requests:
            if id(request) not in simple_ids:
                self._sample_alone(request, rows, row_of, result)
        pending = [(r, t) for r in requests for t in result.tokens.get(r.request_id, ())
                   if isinstance(t.token, torch.Tensor)]
        if pending:                                   # every sampled token to the host in one copy
            for (request, t), value in zip(pending, torch.stack([t.token for _, t in pending]).tolist()):
                t.token = value
                if value == sampler.NO_TOKEN:
                    self._fail(request, sampler.NoFiniteLogit(), result)
        if self.gather_generation_logits:
            for request in requests:
                if request.seqs and request.seqs[0].seq_id in row_of and request.request_id in result.tokens:
                    gathered.generation[request.request_id] = rows[row_of[request.seqs[0].seq_id]].float().cpu()
        return result

    def _sample_alone(self, request: Request, rows: torch.Tensor, row_of: dict[int, int],
                      result: ModelStepOutput) -> None:
        """Sample one request's tokens (beam candidates) once all its sequences are computed. An error fails
        this request only (request.error; the engine ends it), never the step."""
        try:
            for seq in request.seqs:
                if seq.seq_id in row_of:
                    # a float32 copy: rows may be a graph's buffer, in the model's dtype
                    self.last_logits[seq.seq_id] = rows[row_of[seq.seq_id]].to(torch.float32, copy=True)
            if not all(seq.seq_id in self.last_logits for seq in request.seqs):
                return                                # a sibling is still being computed
            own = torch.stack([self.last_logits.pop(seq.seq_id) for seq in request.seqs])
            if request.sampling.use_beam_search:
                result.beam_candidates[request.request_id] = sampler.beam_candidates(own, request,
                                                                                     beams_to_keep(request))
            else:
                result.tokens[request.request_id] = self._choose(request, own)
        except Exception as err:  # noqa: BLE001 - whatever it is, it is this request's alone
            self._fail(request, err, result)

    def _verify_greedy(self, requests: list[Request], launch: Launch, row_of: dict[int, int],
                       result: ModelStepOutput) -> None:
        """verify_drafts for greedy requests that need nothing but the argmax: one argmax over all their rows, one
        copy to the host."""
        if not requests:
            return
        order = []
        for request in requests:
            seq = request.seqs[0]
            first, end = launch.draft_rows[seq.seq_id]
            order += list(range(first, end)) + [row_of[seq.seq_id]]
        picks = self.net.ops.argmax_rows(launch.logits[self._tensor(order)]).tolist()
        at = 0
        for request in requests:
            drafts = request.seqs[0].draft_ids
            mine, at = picks[at:at + len(drafts) + 1], at + len(drafts) + 1
            result.speculated[request.request_id] = [SampledToken(0, t) for t in sampler.greedy_accept(drafts, mine)]

    def _verify(self, request: Request, launch: Launch, row_of: dict[int, int], result: ModelStepOutput) -> None:
        """The tokens a speculative step emits for the request's sequence (sampler.verify_drafts)."""
        seq = request.seqs[0]
        first, end = launch.draft_rows[seq.seq_id]
        rows = torch.cat([launch.logits[first:end], launch.logits[row_of[seq.seq_id]][None]])
        try:
            emitted = sampler.verify_drafts(rows, request, seq, self._generator(request, seq.sample_index),
                                            self.normalize_log_probs)
            result.speculated[request.request_id] = [SampledToken(0, token, logprob) for token, logprob in emitted]
        except Exception as err:  # noqa: BLE001 - whatever it is, it is this request's alone
            self._fail(request, err, result)

    def _fail(self, request: Request, err: Exception, result: ModelStepOutput) -> None:
        """The request gets no token this step; the engine ends it with `err`."""
        request.error = err
        result.tokens.pop(request.request_id, None)
        result.speculated.pop(request.request_id, None)
        result.beam_candidates.pop(request.request_id, None)
        self.forget_logits(request)

    def _simple(self, request: Request, row_of: dict[int, int]) -> bool:
        """Greedy, one sequence computed this step, nothing that looks at the logits but an argmax."""
        sampling, seqs = request.sampling, request.seqs
        return (len(seqs) == 1 and seqs[0].seq_id in row_of and sampling.greedy and sampling.num_sequences == 1
                and not sampling.has_penalties and sampling.logprobs is None
                and (seqs[0].num_output_tokens >= sampling.min_tokens or not request.stop_ids))

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

    def refit(self, unit: dict[str, torch.Tensor]) -> None:
        """Copy one unit (a layer) of new engine-layout weights into the network's tensors on the device (the CUDA
        graphs read them there and need no new capture)."""
        self.net.refit({name: tensor.to(self.device) for name, tensor in unit.items()})

    def close(self) -> None:
        """Give back the device memory: the network's weights, the KV cache, the graphs and their pools."""
        self.graphs, self.verify_graphs, self.net, self.kv_caches = None, None, None, []
        self.lora.close()
        self.generators.clear()
        self.last_logits.clear()
        gc.collect()                           # graphs and the network hold reference cycles
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def release(self, request: Request) -> None:
        """Forget a finished or aborted request's generators and pending logits."""
        self.forget_logits(request)
        for key in [k for k in self.generators if k[0] == request.request_id]:
            del self.generators[key]

