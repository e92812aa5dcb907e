"""The attention metadata of one step: how packed tokens map onto sequences and KV-cache slots."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch


@dataclass
class LoraBatch:
    """Which packed tokens of a step run under which LoRA adapter; tokens under no adapter run on the base model
    alone. The GPU kernels (kiln/kernels/triton/lora.py) read `rows`, the packed rows sorted by slot, and `starts`,
    where each slot's run begins in them (slot s: rows[starts[s]:starts[s + 1]]; a slot count + 1 entries), on the
    device. `host` keeps the same two lists on the host for `groups`, which the torch products read; a CUDA graph's
    batch has the device view only (host None)."""

    rows: torch.Tensor
    starts: torch.Tensor
    host: tuple[list[int], list[int]] | None = None

    @staticmethod
    def of(token_slots: list[int], slots: int, device: torch.device) -> "LoraBatch | None":
        """The batch of a step whose packed token i runs under adapter slot token_slots[i] (-1: the base model), on
        `device`; None when no token has an adapter."""
        rows, starts = sort_by_slot(token_slots, slots)
        if not rows:
            return None
        packed = torch.tensor(starts + rows, dtype=torch.int64).to(device, non_blocking=True)   # starts aligned
        return LoraBatch(packed[len(starts):], packed[:len(starts)], (rows, starts))

    @functools.cached_property
    def groups(self) -> list[tuple[int, slice | torch.Tensor]]:
        """One (slot, rows) per adapter slot in use: rows a slice of the packed tokens where they are contiguous,
        else an index tensor on the device."""
        if self.host is None:
            raise ValueError("a CUDA graph's LoRA batch has no host view for the torch products")
        rows, starts = self.host
        groups = []
        for slot, (begin, end) in enumerate(zip(starts, starts[1:])):
            run = rows[begin:end]
            if not run:
                continue
            contiguous = run[-1] - run[0] + 1 == len(run)
            groups.append((slot, slice(run[0], run[-1] + 1) if contiguous else
                           torch.tensor(run, dtype=torch.int64).to(self.rows.device, non_blocking=True)))
        return groups


def sort_by_slot(token_slots: list[int], slots: int) -> tuple[list[int], list[int]]:
    """(rows sorted by adapter slot, where each of the `slots` slots' run starts, and the end) of packed tokens
    under adapter slots token_slots (-1: none; those rows are left out)."""
    counts = [0] * (slots + 1)
    for slot in token_slots:
        if slot >= 0:
            counts[slot + 1] += 1
    for s in range(slots):
        counts[s + 1] += counts[s]
    at, rows = counts[:-1].copy(), [0] * counts[-1]
    for row, slot in enumerate(token_slots):
        if slot >= 0:
            rows[at[slot]] = row
            at[slot] += 1
    return rows, counts


@dataclass
class AttentionMetadata:
    """Inputs are packed without padding: sequence b owns tokens query_start_loc[b] : query_start_loc[b+1]."""

    slot_mapping: torch.Tensor      # (T,) int64: cache slot (block * tokens_per_block + offset) of each new token
    query_start_loc: torch.Tensor   # (B + 1,) int64: offsets of each sequence's new tokens in the packed batch
    seq_lens: torch.Tensor          # (B,) int64: tokens in each sequence after this step (cached + new)
    block_tables: torch.Tensor      # (B, max_blocks) int64: KV-cache blocks of each sequence, padded with 0
    max_query_len: int
    max_seq_len: int
    tokens_per_block: int
    num_parts: int = 1              # split-K partitions per sequence for decode attention (multi_block_mode)
    # In a step with prompt tokens: how many leading sequences compute one token each (decodes). Their attention
    # runs as a decode step's (the decode kernels, 16-bit queries) and the rest as prompts; 0: none split off.
    decode_seqs: int = 0
    part_tokens: int | None = None  # keys per partition (None: the whole block table)
    scratch: dict = field(default_factory=dict)  # per-step values shared by all layers (built on first use)
    lora: LoraBatch | None = None   # the step's LoRA adapters per token; None: the base model for every token

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
