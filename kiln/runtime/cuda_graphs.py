"""CUDA graphs for generation steps: one graph per batch-size bucket, all sharing one memory pool.

A step qualifies when every scheduled sequence computes exactly one token. Its inputs are copied into static
buffers (padded rows write nowhere: slot -1, length 0) and the bucket's graph is replayed; the graph covers the
whole network and the LM head, so a step costs one launch instead of hundreds. When the engine allows long
sequences, each bucket has a second graph whose attention splits long sequences over several programs. When the
engine reserved LoRA adapter slots, each bucket also has graphs with the batched LoRA products, whose grouping of
rows by adapter slot is read from the same input buffer; steps where some sequence runs an adapter replay those.
"""
from __future__ import annotations

import torch

from kiln.kernels import AttentionMetadata, LoraBatch, sort_by_slot

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512,
           640, 768, 896, 1024)


def bucket_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in BUCKETS if b < max_batch]
    return sizes + [max_batch]


def bucket_of(sizes: list[int], batch: int) -> int:
    """The bucket a batch of `batch` sequences replays (itself past the largest)."""
    return next((s for s in sizes if s >= batch), batch)


def bucket_keys(max_keys: int, long_context: int, long: bool) -> int:
    """The keys a bucket's graph is captured for: its short graph covers sequences up to long_context keys."""
    return max_keys if long else min(max_keys, long_context)


class CudaGraphs:
    def __init__(self, net, kv_caches: list[torch.Tensor], max_batch: int, max_blocks_per_seq: int,
                 tokens_per_block: int, parts_for, long_context: int, lora_slots: int = 0):
        """parts_for(batch, max_keys) → (num_parts, part_tokens) of decode attention for a bucket; batches with a
        sequence past long_context keys replay the bucket's long-sequence graph. lora_slots: the adapter slots of
        the network's LoRA stacks, to capture graphs with adapters too (0: none)."""
        device = kv_caches[0].device
        self.net, self.kv_caches, self.sizes = net, kv_caches, bucket_sizes(max_batch)
        # All inputs live in one device buffer, filled by one copy from one pinned host buffer per step:
        # [input_ids | positions | slots | seq_lens | LoRA rows by slot | LoRA slot starts (lora_slots + 1) |
        #  block_tables (max_batch × max_blocks_per_seq)].
        self.max_batch, self.width, self.lora_slots = max_batch, max_blocks_per_seq, lora_slots
        self.tables_at = 4 * max_batch + ((max_batch + lora_slots + 1) if lora_slots else 0)
        size = self.tables_at + max_batch * max_blocks_per_seq
        self.device_buffer = torch.zeros(size, dtype=torch.int64, device=device)
        # Two host buffers, used in turn: with overlapped steps the host fills the next step's inputs while the
        # device may not have copied the previous ones yet (it has copied the ones before, which the host waited on).
        self.host_buffers = [torch.zeros(size, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self.turn = 0
        self.input_ids, self.positions, self.slots, self.seq_lens = self.device_buffer[:4 * max_batch].view(4, max_batch)
        self.lora_rows = self.device_buffer[4 * max_batch:5 * max_batch]
        self.lora_starts = self.device_buffer[5 * max_batch:self.tables_at]
        self.block_tables = self.device_buffer[self.tables_at:].view(max_batch, max_blocks_per_seq)
        self.slots.fill_(-1)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int64, device=device)
        self.tokens_per_block, self.parts_for = tokens_per_block, parts_for
        self.graphs: dict[tuple[int, bool, bool], torch.cuda.CUDAGraph] = {}     # (size, long, LoRA) → graph
        self.logits: dict[tuple[int, bool, bool], torch.Tensor] = {}
        self.hiddens: dict[tuple[int, bool, bool], torch.Tensor] = {}     # the network's output rows of each graph
        self.last_hidden: torch.Tensor | None = None                      # the last replay's (a view of a buffer)
        self.pool = torch.cuda.graph_pool_handle()
        max_keys = self.width * tokens_per_block
        for size in sorted(self.sizes, reverse=True):      # largest first: later graphs reuse its pool
            short = parts_for(size, bucket_keys(max_keys, long_context, False))
            long = parts_for(size, bucket_keys(max_keys, long_context, True))
            for lora in (False, True) if lora_slots else (False,):
                self._capture((size, False, lora), short)
                if long != short:
                    self._capture((size, True, lora), long)
                else:
                    self.graphs[size, True, lora] = self.graphs[size, False, lora]
                    self.logits[size, True, lora] = self.logits[size, False, lora]
                    self.hiddens[size, True, lora] = self.hiddens[size, False, lora]

    def _meta(self, size: int, parts: tuple[int, int | None], lora: bool) -> AttentionMetadata:
        return AttentionMetadata(self.slots[:size], self.query_start_loc[:size + 1], self.seq_lens[:size],
                                 self.block_tables[:size], max_query_len=1, max_seq_len=self.width * self.tokens_per_block,
                                 tokens_per_block=self.tokens_per_block, num_parts=parts[0], part_tokens=parts[1],
                                 lora=LoraBatch(self.lora_rows[:size], self.lora_starts) if lora else None)

    def _forward(self, size: int, parts, lora: bool) -> torch.Tensor:
        hidden = self.net(self.input_ids[:size], self.positions[:size], self._meta(size, parts, lora), self.kv_caches)
        self.hidden = hidden
        return self.net.compute_logits(hidden, float32=False)      # the runner converts the rows it samples from

    def _capture(self, key: tuple[int, bool, bool], parts) -> None:
        size, _, lora = key
        for _ in range(2):                                  # compile and warm every kernel outside the capture
            self._forward(size, parts, lora)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.logits[key] = self._forward(size, parts, lora)
        self.graphs[key], self.hiddens[key] = graph, self.hidden

    def fits(self, batch: int) -> bool:
        return batch <= self.sizes[-1]

    def run(self, input_ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
            tables: list[list[int]], long: bool = False, fill=None,
            lora_slots: list[int] | None = None) -> torch.Tensor:
        """Logits (n, vocab), in the model's dtype, of n one-token sequences (`long`: some sequence is past
        LONG_CONTEXT keys); `fill` = (rows, device tokens): input ids that are only on the device yet; lora_slots:
        each sequence's adapter slot (-1: none), or None."""
        n, b = len(input_ids), self.max_batch
        size = bucket_of(self.sizes, n)
        self.turn ^= 1
        host_buffer = self.host_buffers[self.turn]
        host = host_buffer.numpy()
        host[0:n], host[b:b + n], host[2 * b:2 * b + n], host[3 * b:3 * b + n] = input_ids, positions, slots, seq_lens
        host[n:size] = 0                                   # padded rows: a real token id (a pending one is -1),
        host[2 * b + n:2 * b + size] = -1                  # written nowhere, attending to nothing
        host[3 * b + n:3 * b + size] = 0
        lora = lora_slots is not None
        if lora:
            rows, starts = sort_by_slot(lora_slots, self.lora_slots)
            host[4 * b:4 * b + len(rows)], host[5 * b:self.tables_at] = rows, starts
        table = host[self.tables_at:].reshape(b, self.width)
        for row, blocks in enumerate(tables):
            table[row, :len(blocks)] = blocks
        used = self.tables_at + size * self.width
        self.device_buffer[:used].copy_(host_buffer[:used], non_blocking=True)
        if fill is not None:
            self.input_ids[fill[0]] = fill[1]
        self.graphs[size, long, lora].replay()
        self.last_hidden = self.hiddens[size, long, lora][:n]
        return self.logits[size, long, lora][:n]


VERIFY_MAX_BATCH = 64   # speculative steps of more sequences run without graphs (their weights are read once anyway)


class VerifyGraphs:
    """CUDA graphs for speculative steps: B sequences that each compute q = k + 1 tokens (their last token and k
    drafts), for each batch bucket B up to VERIFY_MAX_BATCH and each k in 1..max_draft_len; a graph returns the
    logits of every row. Padded sequences compute q tokens written nowhere, over keys of block 0 they only read."""

    def __init__(self, net, kv_caches: list[torch.Tensor], max_batch: int, max_blocks_per_seq: int,
                 tokens_per_block: int, max_draft_len: int):
        device = kv_caches[0].device
        self.net, self.kv_caches = net, kv_caches
        self.sizes = bucket_sizes(min(max_batch, VERIFY_MAX_BATCH))
        self.max_q, self.width, self.tokens_per_block = max_draft_len + 1, max_blocks_per_seq, tokens_per_block
        b, t = self.sizes[-1], self.sizes[-1] * self.max_q
        # [input_ids | positions | slots (t each) | seq_lens (b) | block_tables (b × width)]
        self.tables_at = 3 * t + b
        self.device_buffer = torch.zeros(self.tables_at + b * self.width, dtype=torch.int64, device=device)
        self.host_buffers = [torch.zeros_like(self.device_buffer, device="cpu").pin_memory() for _ in range(2)]
        self.turn = 0
        self.input_ids, self.positions, self.slots = self.device_buffer[:3 * t].view(3, t)
        self.seq_lens = self.device_buffer[3 * t:self.tables_at]
        self.block_tables = self.device_buffer[self.tables_at:].view(b, self.width)
        self.starts = {q: torch.arange(b + 1, dtype=torch.int64, device=device) * q for q in range(2, self.max_q + 1)}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}       # (size, q) → graph
        self.logits: dict[tuple[int, int], torch.Tensor] = {}
        self.hiddens: dict[tuple[int, int], torch.Tensor] = {}
        self.last_hidden: torch.Tensor | None = None
        self.pool = torch.cuda.graph_pool_handle()
        for size in sorted(self.sizes, reverse=True):
            for q in range(2, self.max_q + 1):
                self._capture(size, q)

    def takes(self, step) -> bool:
        """Whether a step is one of the graphs': every sequence computes the same 2..max_q tokens, few enough."""
        starts, count = step.query_start_loc, len(step.seq_lens)
        q = step.max_query_len
        return (1 < q <= self.max_q and count <= self.sizes[-1] and starts[-1] == q * count
                and step.lora_slots is None)

    def _forward(self, size: int, q: int) -> torch.Tensor:
        t = size * q
        meta = AttentionMetadata(self.slots[:t], self.starts[q][:size + 1], self.seq_lens[:size],
                                 self.block_tables[:size], max_query_len=q,
                                 max_seq_len=self.width * self.tokens_per_block, tokens_per_block=self.tokens_per_block)
        hidden = self.net(self.input_ids[:t], self.positions[:t], meta, self.kv_caches)
        self.hidden = hidden
        return self.net.compute_logits(hidden, float32=False)

    def _capture(self, size: int, q: int) -> None:
        self.seq_lens[:size] = q                            # warm-up inputs: q tokens at positions 0..q-1, unwritten
        self.positions[:size * q] = torch.arange(q, device=self.positions.device).repeat(size)
        self.slots[:size * q] = -1
        for _ in range(2):
            self._forward(size, q)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.logits[size, q] = self._forward(size, q)
        self.graphs[size, q], self.hiddens[size, q] = graph, self.hidden

    def run(self, step, fill=None) -> torch.Tensor:
        """The logits of step.logit_rows (in the model's dtype) from the (bucket, q) graph."""
        n, q, t_max = len(step.seq_lens), step.max_query_len, self.sizes[-1] * self.max_q
        size = bucket_of(self.sizes, n)
        tokens, padded = n * q, size * q
        self.turn ^= 1
        host_buffer = self.host_buffers[self.turn]
        host = host_buffer.numpy()
        host[0:tokens], host[t_max:t_max + tokens], host[2 * t_max:2 * t_max + tokens] = (
            step.input_ids, step.positions, step.slot_mapping)
        host[tokens:padded] = 0
        host[t_max + tokens:t_max + padded] = list(range(q)) * (size - n)      # padded sequences: positions 0..q-1,
        host[2 * t_max + tokens:2 * t_max + padded] = -1                       # written nowhere
        host[3 * t_max:3 * t_max + n] = step.seq_lens
        host[3 * t_max + n:3 * t_max + size] = q
        table = host[self.tables_at:].reshape(self.sizes[-1], self.width)
        table[:size] = 0
        for row, blocks in enumerate(step.block_tables):
            table[row, :len(blocks)] = blocks
        used = self.tables_at + size * self.width
        self.device_buffer[:used].copy_(host_buffer[:used], non_blocking=True)
        if fill is not None:
            self.input_ids[fill[0]] = fill[1]
        self.graphs[size, q].replay()
        self.last_hidden = self.hiddens[size, q][:tokens]
        rows = torch.tensor(step.logit_rows, dtype=torch.int64).to(self.device_buffer.device, non_blocking=True)
        return self.logits[size, q][rows]
