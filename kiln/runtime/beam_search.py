"""One beam-search step over the best candidates, with transformers' rules for finished beams, the length
penalty and early stopping. Plain Python: the model runner supplies the candidates.

Each step the runner returns the top `beams_to_keep` (parent beam, token, cumulative log-prob) continuations.
Candidates that end (a stop token, or the length limit) among the best `num_beams` become finished hypotheses,
scored cumulative log-prob / generated_length ** length_penalty; the best `num_beams` other candidates run on.
"""
from __future__ import annotations

from dataclasses import dataclass

from .request import BeamHypothesis, Request

DROPPED = -1.0e9  # transformers' "impossible" score, kept so that ties and ordering behave the same


@dataclass
class Candidate:
    parent: int              # index into request.seqs
    token: int
    cumulative_logprob: float
    logprob: float


def beams_to_keep(request: Request) -> int:
    return max(2, 1 + len(request.stop_ids)) * request.sampling.num_beams


def beam_step(request: Request, candidates: list[Candidate]) -> tuple[list[Candidate], bool]:
    """Record finished hypotheses; return the candidates that run on and whether the search is done."""
    sampling, beams = request.sampling, request.sampling.num_beams
    generated = request.seqs[0].num_output_tokens + 1           # length after this step
    at_limit = generated >= sampling.max_new_tokens
    ends = [at_limit or c.token in request.stop_ids for c in candidates]
    if request.beam_improvable and not _full_and_early(request):
        for candidate, end in zip(candidates[:beams], ends[:beams]):
            if end:
                score = candidate.cumulative_logprob / (generated ** sampling.length_penalty)
                _add_hypothesis(request, candidate, score)
    ranked = sorted(zip(candidates, ends), key=lambda ce: ce[0].cumulative_logprob + (DROPPED if ce[1] else 0.0),
                    reverse=True)
    running = [c for c, _ in ranked[:beams]]
    best_running = running[0].cumulative_logprob + (DROPPED if ranked[0][1] else 0.0)
    request.beam_improvable = request.beam_improvable and _improvable(request, best_running, generated)
    done = not request.beam_improvable or _full_and_early(request) or all(ends)
    return running, done


def _full_and_early(request: Request) -> bool:
    return request.sampling.early_stopping is True and len(request.beam_hypotheses) >= request.sampling.num_beams


def _add_hypothesis(request: Request, candidate: Candidate, score: float) -> None:
    seq = request.seqs[candidate.parent].fork()
    seq.token_ids.append(candidate.token)
    seq.cumulative_logprob = candidate.cumulative_logprob
    seq.finish_reason = "stop" if candidate.token in request.stop_ids else "length"
    hyps = request.beam_hypotheses + [BeamHypothesis(score, seq)]
    request.beam_hypotheses = sorted(hyps, key=lambda h: h.score, reverse=True)[:request.sampling.num_beams]


def _improvable(request: Request, best_running: float, generated: int) -> bool:
    """Could a running beam still beat the worst finished one? (transformers' early-stop heuristic)"""
    sampling = request.sampling
    if len(request.beam_hypotheses) < sampling.num_beams:
        return True
    length = generated
    if sampling.early_stopping == "never" and sampling.length_penalty > 0:
        length = sampling.max_new_tokens
    best_possible = best_running / (length ** sampling.length_penalty)
    return best_possible > min(h.score for h in request.beam_hypotheses)
