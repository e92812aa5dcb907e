"""What a finished request gives back to the user."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GenerationOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    """Generated tokens, including the end token when generation stopped on one."""
    text: str
    """Generated text (special tokens skipped)."""
    finish_reason: str | None
    """"stop" (an end token), "length" (max_new_tokens reached)."""
    padded_token_ids: list[int] | None = None
    """token_ids padded to max_new_tokens with pad_id (end_id when pad_id is None), as in a batch tensor."""
    context_logits: torch.Tensor | None = None
    """(prompt_len, vocab) float32 when the engine was built with gather_context_logits."""
    generation_logits: torch.Tensor | None = None
    """(len(token_ids), vocab) float32 when the engine was built with gather_generation_logits."""
