"""`kiln eval ppl`: perplexity of an engine on a text, in non-overlapping windows of at most `window` tokens."""
from __future__ import annotations

import math
from typing import Iterator

import torch

from kiln.builder import Engine
from kiln.kernels import AttentionMetadata


def window_size(engine: Engine, window: int | None) -> int:
    """Tokens per scored window: `window` (default 512) within what the engine takes in one step."""
    return min(window or 512, engine.build_config.max_input_len, engine.build_config.max_num_tokens)


@torch.inference_mode()
def window_log_probs(engine: Engine, token_ids: list[int], device: torch.device | str = "cpu",
                     window: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Per window: (log-probabilities (n, vocab) of each next token, the n tokens that follow); each window
    predicts its tokens 2..n+1 from the ones before."""
    from kiln.runtime.model_runner import ModelRunner

    window = window_size(engine, window)
    if len(token_ids) < 2:
        raise ValueError("perplexity needs a text of at least two tokens")
    runner = ModelRunner(engine, torch.device(device))
    bs = runner.tokens_per_block
    runner.allocate_kv(-(-window // bs))
    t = lambda values: torch.tensor(values, dtype=torch.int64, device=runner.device)  # noqa: E731
    for start in range(0, len(token_ids) - 1, window):
        chunk = token_ids[start:start + window + 1]
        inputs, targets = chunk[:-1], chunk[1:]
        n = len(inputs)
        meta = AttentionMetadata(t(list(range(n))), t([0, n]), t([n]), t([list(range(-(-n // bs)))]), n, n, bs)
        logits = runner.net.compute_logits(runner.net(t(inputs), t(list(range(n))), meta, runner.kv_caches))
        yield torch.log_softmax(logits, dim=-1), t(targets)


def perplexity(engine: Engine, token_ids: list[int], device: torch.device | str = "cpu",
               window: int | None = None, quiet: bool = True) -> tuple[float, int]:
    """(perplexity, number of predicted tokens); a progress bar over the windows unless quiet."""
    from kiln.utils.steps import progress

    total, count = 0.0, 0
    windows = -(-(len(token_ids) - 1) // window_size(engine, window))
    for log_probs, targets in progress(window_log_probs(engine, token_ids, device, window), "Scoring windows",
                                       total=windows, quiet=quiet):
        total -= log_probs.gather(1, targets[:, None]).sum().item()
        count += len(targets)
    return math.exp(total / count), count
