"""Token selection from logits: greedy, temperature, top-k and top-p, each request with its own generator."""
from __future__ import annotations

import torch

from .sampling import SamplingConfig


def sample(logits: torch.Tensor, configs: list[SamplingConfig], generators: list[torch.Generator | None]) -> torch.Tensor:
    """(N, V) float32 logits → (N,) token ids."""
    tokens = logits.argmax(dim=-1)
    for i, (config, generator) in enumerate(zip(configs, generators)):
        if not config.greedy:
            tokens[i] = _sample_row(logits[i], config, generator)
    return tokens


def _sample_row(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    logits = logits / (config.temperature if config.temperature is not None else 1.0)
    if config.top_k:
        kth = torch.topk(logits, min(config.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p is not None and config.top_p < 1:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > config.top_p      # keep tokens until the mass reaches top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[0]
