"""Step: one forward pass as rank 0 describes it to every rank (plain Python: it is broadcast by pickling), and
its split into pipeline micro-batches."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Step:
    """Everything a rank needs to run one forward pass (plain lists: it is broadcast by pickling)."""

    block_copies: list
    input_ids: list
    positions: list
    slot_mapping: list
    query_start_loc: list
    seq_lens: list
    block_tables: list
    max_query_len: int
    max_seq_len: int
    logit_rows: list
    lora_slots: list | None = None  # LoRA adapter slot of each sequence (-1: none); None: no sequence has one
    lora_loads: list = field(default_factory=list)  # (slot, LoRARequest) installed for this step, every rank alike
    prompt_embeds: tuple | None = None  # (packed positions, (n, hidden) CPU rows) of prompt-table ids; None: none


@dataclass
class Refit:
    """What rank 0 broadcasts instead of a Step to refit every rank: the source directory each reads its share of."""

    source: str


def split_step(step: Step, parts: int) -> list[tuple[Step, list[int]]]:
    """Micro-batches of whole sequences with about equal token counts, each with the positions in
    step.logit_rows its logits fill (block copies go with the first)."""
    starts, count = step.query_start_loc, len(step.seq_lens)
    parts = max(1, min(parts, count))
    bounds, total = [0], starts[-1]
    for k in range(1, parts):                       # cut where k/parts of the tokens are done, one sequence each
        cut = bounds[-1] + 1
        while cut < count - (parts - k) and starts[cut] < total * k / parts:
            cut += 1
        bounds.append(cut)
    bounds.append(count)
    batches = []
    for a, b in zip(bounds, bounds[1:]):
        t0, t1 = starts[a], starts[b]
        owned = [j for j, row in enumerate(step.logit_rows) if t0 <= row < t1]
        embeds = None
        if step.prompt_embeds is not None:
            mine = [j for j, p in enumerate(step.prompt_embeds[0]) if t0 <= p < t1]
            if mine:
                embeds = ([step.prompt_embeds[0][j] - t0 for j in mine], step.prompt_embeds[1][mine])
        batches.append((Step(step.block_copies if a == 0 else [], step.input_ids[t0:t1], step.positions[t0:t1],
                             step.slot_mapping[t0:t1], [s - t0 for s in starts[a:b + 1]], step.seq_lens[a:b],
                             step.block_tables[a:b], max(starts[i + 1] - starts[i] for i in range(a, b)),
                             max(step.seq_lens[a:b]), [step.logit_rows[j] - t0 for j in owned],
                             None if step.lora_slots is None else step.lora_slots[a:b], prompt_embeds=embeds), owned))
    return batches


def leading_decodes(query_start_loc: list) -> int:
    """How many leading sequences of a step compute one token each (AttentionMetadata.decode_seqs)."""
    count = 0
    for start, end in zip(query_start_loc, query_start_loc[1:]):
        if end - start != 1:
            break
        count += 1
    return count
