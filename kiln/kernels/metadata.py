"""The attention metadata of one step: how packed tokens map onto sequences and KV-cache slots."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LoraBatch:
    """Which packed tokens of a step run under which LoRA adapter: one (slot, rows) group per adapter slot in use,
    rows a slice of the packed tokens where they are contiguous, else an index tensor on the device. Tokens in no
    group run on the base model alone."""

    groups: list[tuple[int, slice | torch.Tensor]]


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
    part_tokens: int | None = None  # keys per partition (None: the whole block table)
    scratch: dict = field(default_factory=dict)  # per-step values shared by all layers (built on first use)
    lora: LoraBatch | None = None   # the step's LoRA adapters per token; None: the base model for every token

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
