"""Prompt tables (TensorRT-LLM's prompt tuning): a request may bring its own embedding rows; prompt token id
vocab_size + i stands for row i of the request's table. Used for p-tuning's virtual tokens and for embeddings made
elsewhere (a vision encoder's image features, say). A table changes what a prompt's KV holds, so its digest keys the
prefix cache (Request.cache_salt)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class PromptTable:
    """A request's table: `rows` (R, hidden) on the CPU in the model's dtype; prompt id first_id + i is row i."""

    rows: torch.Tensor
    first_id: int
    digest: bytes
    """SHA-256 of the rows' shape, dtype and bytes."""


def make_prompt_table(table, task: int | None, *, hidden_size: int, dtype: torch.dtype, max_rows: int,
                      vocab_size: int) -> PromptTable:
    """A checked PromptTable from a user's (rows, hidden) tensor, or (tasks, rows, hidden) with `task` picking one
    (task 0 when None)."""
    if max_rows == 0:
        raise ValueError("prompt_table: this engine was built with max_prompt_embedding_table_size=0, which refuses "
                         "prompt tables; rebuild it with --max_prompt_embedding_table_size N (the most rows a "
                         "request's table may have)")
    if not isinstance(table, torch.Tensor) or not table.is_floating_point() or table.dim() not in (2, 3):
        raise ValueError("prompt_table must be a floating-point tensor of shape (rows, hidden_size) or (tasks, rows, "
                         f"hidden_size), got {_describe(table)}")
    if table.dim() == 3:
        task = 0 if task is None else task
        if not isinstance(task, int) or isinstance(task, bool) or not 0 <= task < table.shape[0]:
            raise ValueError(f"prompt_tasks={task!r} must pick one of the table's {table.shape[0]} tasks [0, "
                             f"{table.shape[0]})")
        table = table[task]
    elif task not in (None, 0):
        raise ValueError(f"prompt_tasks={task!r} picks a task, but the prompt_table {tuple(table.shape)} has one "
                         "(give a (tasks, rows, hidden_size) table)")
    rows, width = table.shape
    if width != hidden_size:
        raise ValueError(f"prompt_table rows have {width} values; the model's hidden_size is {hidden_size}")
    if not 0 < rows <= max_rows:
        raise ValueError(f"prompt_table has {rows} rows; the engine takes 1 to max_prompt_embedding_table_size="
                         f"{max_rows}")
    rows_tensor = table.detach().to("cpu", dtype).contiguous()
    if not torch.isfinite(rows_tensor).all():
        raise ValueError(f"prompt_table has values that are not finite in {dtype} (NaN, inf or out of range)")
    head = f"{tuple(rows_tensor.shape)} {dtype}".encode()
    digest = hashlib.sha256(head + rows_tensor.view(torch.uint8).numpy().tobytes()).digest()
    return PromptTable(rows_tensor, vocab_size, digest)


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def take_table_rows(scheduled, ids: list[int], starts: list[int]) -> tuple[list[int], torch.Tensor] | None:
    """The packed positions of a step's prompt-table ids and their rows (ids there replaced by 0 in `ids`, a valid
    token for the embedding lookup the rows then overwrite); None when no scheduled request has a table."""
    positions, parts = [], []
    for i, (request, _, _) in enumerate(scheduled):
        table = request.prompt_table
        if table is None:
            continue
        found = [p for p in range(starts[i], starts[i + 1]) if ids[p] >= table.first_id]
        if found:
            parts.append(table.rows[torch.tensor([ids[p] - table.first_id for p in found])])
            positions += found
            for p in found:
                ids[p] = 0
    return (positions, torch.cat(parts)) if positions else None
