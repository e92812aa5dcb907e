"""An OpenAI request's sampling fields → Kiln's SamplingConfig (OpenAI's defaults: temperature 1, top_p 1)."""
from __future__ import annotations

from kiln.runtime.sampling import SamplingConfig

from .errors import invalid
from .protocol import SamplingFields


def sampling_config(req: SamplingFields, max_new_tokens: int, logprobs: int | None) -> SamplingConfig:
    """temperature 0 decodes greedily; `logprobs` is the number of top alternatives (None: no logprobs)."""
    try:
        return SamplingConfig(
            max_new_tokens=max_new_tokens, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=req.top_p, n=req.n or 1, stop=req.stop or [], random_seed=req.seed, logprobs=logprobs,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0)
    except ValueError as err:
        raise invalid(str(err)) from None
