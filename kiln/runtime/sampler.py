"""Token selection from logits: penalties, greedy, temperature, top-k, top-p, min-p, log-probabilities, and
the beam-search candidates. Each sample has its own generator, so results do not depend on the batch."""
from __future__ import annotations

import torch

from .beam_search import Candidate
from .request import Request, Sequence, TokenLogprob
from .sampling import SamplingConfig


def apply_penalties(logits: torch.Tensor, seq: Sequence, sampling: SamplingConfig) -> torch.Tensor:
    """(V,) logits of one sequence with repetition (prompt + output), presence and frequency (output) penalties."""
    if not sampling.has_penalties:
        return logits
    logits = logits.clone()
    device = logits.device
    if sampling.repetition_penalty != 1.0:
        vocab = logits.shape[-1]
        ids = torch.tensor(sorted(t for t in set(seq.token_ids) if t < vocab), device=device)  # not prompt-table ids
        seen = logits[ids]
        logits[ids] = torch.where(seen > 0, seen / sampling.repetition_penalty, seen * sampling.repetition_penalty)
    if (sampling.presence_penalty or sampling.frequency_penalty) and seq.num_output_tokens:
        ids, counts = torch.tensor(seq.output_token_ids, device=device).unique(return_counts=True)
        logits[ids] -= sampling.frequency_penalty * counts.to(logits.dtype) + sampling.presence_penalty
    return logits


def suppress_stop_tokens(logits: torch.Tensor, request: Request, seq: Sequence) -> torch.Tensor:
    """Forbid stop tokens while the sequence is shorter than min_tokens."""
    if seq.num_output_tokens >= request.sampling.min_tokens or not request.stop_ids:
        return logits
    logits = logits.clone()
    logits[torch.tensor(sorted(request.stop_ids), device=logits.device)] = float("-inf")
    return logits


NO_TOKEN = -2
"""Sampled in place of a token when a row has no finite logit (NaN or -inf everywhere): the request fails."""


class NoFiniteLogit(ValueError):
    def __init__(self):
        super().__init__("no token can be sampled: every logit is NaN or -inf")


def finite_logits(logits: torch.Tensor) -> torch.Tensor:
    """NaN → -inf (never chosen); +inf → the dtype's largest value (chosen, and softmax stays a distribution).
    Penalties and small temperatures can overflow float32; a broken model can give NaN."""
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max, neginf=float("-inf"))


def filtered_logits(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks (-inf) on (V,) logits."""
    logits = finite_logits(logits / (sampling.temperature if sampling.temperature is not None else 1.0))
    if sampling.top_k:
        kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p is not None and sampling.top_p < 1:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > sampling.top_p     # keep tokens until their mass reaches top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if sampling.min_p:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < sampling.min_p * probs.max(), float("-inf"))
    return logits


def sample(kept: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """A 0-d token drawn from softmax(kept), without a host sync; NO_TOKEN when no logit is finite (a uniform
    stand-in is drawn from then, so torch.multinomial never sees NaN)."""
    usable = torch.isfinite(kept).any()
    probs = torch.where(usable, kept, 0.0).softmax(-1)
    token = torch.multinomial(probs, 1, generator=generator)[0]
    return torch.where(usable, token, NO_TOKEN)


def choose(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None,
           normalize_log_probs: bool) -> tuple[torch.Tensor | int, TokenLogprob | None]:
    """Pick one token from (V,) processed logits; with its log-probability when the request asks for them.

    Without log-probabilities the token stays on the device (a 0-d tensor, NO_TOKEN if the row had no finite
    logit), so a step's samples reach the host in one copy. Log-probabilities are of the distribution sampled
    from (after temperature): over the whole vocabulary, or, with normalize_log_probs, renormalised over the
    tokens top-k/top-p/min-p kept."""
    logits = finite_logits(logits)
    if sampling.greedy:
        token = logits.argmax()
        kept = logits
    else:
        kept = filtered_logits(logits, sampling)
        token = sample(kept, generator)
    if sampling.logprobs is None:
        return token, None
    token = int(token)
    if token == NO_TOKEN:
        raise NoFiniteLogit()
    dist = kept if (normalize_log_probs or sampling.greedy) else finite_logits(logits / (sampling.temperature or 1.0))
    logprobs = torch.log_softmax(dist.float(), dim=-1)
    return token, _logprob_entry(logprobs, token, sampling.logprobs)


def _logprob_entry(logprobs: torch.Tensor, token: int, top_n: int) -> TokenLogprob:
    top = {}
    if top_n:
        values, ids = torch.topk(logprobs, top_n)
        top = dict(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(logprobs[token]), top)


def beam_candidates(rows: torch.Tensor, request: Request, keep: int) -> list[Candidate]:
    """The best `keep` (beam, token) continuations by cumulative log-probability; rows is (beams, V)."""
    logprobs = torch.log_softmax(rows.float(), dim=-1)
    seqs = request.seqs
    if seqs[0].num_output_tokens < request.sampling.min_tokens and request.stop_ids:
        logprobs[:, torch.tensor(sorted(request.stop_ids), device=rows.device)] = float("-inf")
    cumulative = torch.tensor([s.cumulative_logprob for s in seqs], device=rows.device, dtype=torch.float32)
    total = (logprobs + cumulative[:, None]).flatten()
    values, flat = torch.topk(total, min(keep, total.numel()))
    vocab = rows.shape[-1]
    return [Candidate(int(i) // vocab, int(i) % vocab, float(v), float(logprobs.flatten()[i]))
            for v, i in zip(values.tolist(), flat.tolist())]


def plain_greedy(request: Request, seq: Sequence) -> bool:
    """Whether verifying a sequence's drafts needs only each row's argmax: greedy, no log-probabilities, and no
    stop token to suppress (min_tokens) at any of its positions."""
    sampling = request.sampling
    return (sampling.greedy and sampling.logprobs is None
            and (seq.num_output_tokens >= sampling.min_tokens or not request.stop_ids))


def greedy_accept(drafts: list[int], picks: list[int]) -> list[int]:
    """The tokens a greedy speculative step emits: the drafts while each equals the model's pick (argmax) before
    it, then the model's own pick (picks: one per draft and one after the last)."""
    accepted = next((i for i, (d, t) in enumerate(zip(drafts, picks)) if d != t), len(drafts))
    return drafts[:accepted] + [picks[accepted]]


def verify_drafts(rows: torch.Tensor, request: Request, seq: Sequence, generator: torch.Generator | None,
                  normalize_log_probs: bool) -> list[tuple[int, TokenLogprob | None]]:
    """The tokens a speculative step emits for `seq`: rows (k+1, V) are the model's logits after its last token
    and after each of its k draft tokens (seq.draft_ids). Greedy: the drafts while they equal the model's argmax,
    then the model's own token — the tokens decoding without drafts gives. Sampled: draft i is accepted with
    probability min(1, p(d)/q(d)) (p: the model's distribution after temperature/top-k/top-p, q: the drafter's,
    one-hot where seq.draft_probs is None), a rejected one replaced by a sample of the residual max(0, p − q),
    and after k accepted drafts one more token is sampled from p: the emitted tokens follow p exactly."""
    sampling, drafts = request.sampling, seq.draft_ids
    rows = finite_logits(rows.float())
    if seq.num_output_tokens + len(drafts) < sampling.min_tokens and request.stop_ids:
        rows = rows.clone()
        for i in range(rows.shape[0]):
            if seq.num_output_tokens + i < sampling.min_tokens:
                rows[i, torch.tensor(sorted(request.stop_ids), device=rows.device)] = float("-inf")
    if sampling.greedy:
        tokens, kept = greedy_accept(drafts, rows.argmax(-1).tolist()), rows
    else:
        kept = torch.stack([filtered_logits(row, sampling) for row in rows])
        if not torch.isfinite(kept).any(-1).all():
            raise NoFiniteLogit()
        tokens = _rejection_sample(kept.softmax(-1), drafts, seq.draft_probs, generator)
    if any(t == NO_TOKEN for t in tokens) or not torch.isfinite(kept[len(tokens) - 1]).any():
        raise NoFiniteLogit()
    if sampling.logprobs is None:
        return [(t, None) for t in tokens]
    scale = sampling.temperature or 1.0
    dist = kept if (normalize_log_probs or sampling.greedy) else finite_logits(rows / scale)
    logprobs = torch.log_softmax(dist[:len(tokens)].float(), dim=-1)
    return [(t, _logprob_entry(logprobs[i], t, sampling.logprobs)) for i, t in enumerate(tokens)]


def _rejection_sample(p: torch.Tensor, drafts: list[int], q: torch.Tensor | None,
                      generator: torch.Generator | None) -> list[int]:
    """Speculative sampling over p (k+1, V) of k drafts with the drafter's q (k, V), None: one-hot drafts."""
    k = len(drafts)
    index = torch.tensor(drafts, device=p.device)
    p_d = p[torch.arange(k, device=p.device), index]
    q_d = q[torch.arange(k, device=p.device), index] if q is not None else torch.ones_like(p_d)
    u = torch.rand(k, generator=generator, device=p.device)
    accept = (u * q_d <= p_d).tolist()
    accepted = next((i for i, ok in enumerate(accept) if not ok), k)
    if accepted == k:
        final = p[k]
    else:
        draft_q = q[accepted] if q is not None else torch.nn.functional.one_hot(index[accepted], p.shape[-1]).to(p)
        residual = (p[accepted] - draft_q).clamp_min(0)
        final = residual if residual.sum() > 0 else p[accepted]
    token = int(torch.multinomial(final, 1, generator=generator)[0]) if final.sum() > 0 else NO_TOKEN
    return drafts[:accepted] + [token]
