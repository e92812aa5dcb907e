"""Requests and their sequences, as the scheduler sees them: token ids, progress counters, blocks. No torch.

A request starts with one sequence (its prompt). When the prompt is computed, a request asking for n samples
or num_beams beams forks into that many sequences, which share the prompt's KV-cache blocks.
"""
from __future__ import annotations

import enum
import functools
import hashlib
import itertools
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .sampling import SamplingConfig

if TYPE_CHECKING:
    from .prompt_table import PromptTable

_seq_ids = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    """The log-probability of a chosen token, and of the most likely tokens at that position."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter to generate with: `name` stands for it in this LLM (one path per name), `path` is its
    Hugging Face PEFT directory (adapter_config.json + adapter_model.safetensors or .bin; None: the adapter of that
    name stored with the engine, LoraConfig.lora_dir), `id` an optional number for it (one name per id)."""

    name: str
    path: str | None = None
    id: int | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"LoRARequest.name must be a non-empty string, got {self.name!r}")
        if self.path is not None and not isinstance(self.path, (str, os.PathLike)):
            raise ValueError(f"LoRARequest.path must be a directory path (or None), got {self.path!r}")
        if self.path is not None:
            object.__setattr__(self, "path", os.fspath(self.path))
        if self.id is not None and (not isinstance(self.id, int) or isinstance(self.id, bool) or self.id < 1):
            raise ValueError(f"LoRARequest.id must be a positive integer or None, got {self.id!r}")

    @property
    def cache_salt(self) -> bytes:
        """32 bytes the prefix cache mixes into the key of a prompt's first block (kv_cache.block_key), so KV
        computed under this adapter is found only by requests of the same adapter."""
        return hashlib.sha256(f"kiln-lora\0{self.name}\0{self.path}".encode()).digest()


PENDING_TOKEN = -1   # stands for a token the device has sampled but the host has not read yet (overlap)


@dataclass(eq=False)
class Sequence:
    """One line of tokens: the prompt plus what this sequence generated. Tokens [0, num_computed_tokens)
    are in the KV cache (in `block_ids`); the rest still need a forward pass."""

    token_ids: list[int]
    num_prompt_tokens: int
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)   # prefix-cache keys of the full blocks registered
    cumulative_logprob: float = 0.0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    sample_index: int = 0          # which of the request's n samples (seeds its generator)
    draft_ids: list[int] = field(default_factory=list)     # speculative tokens to verify after token_ids this step
    draft_probs: object = None     # (len(draft_ids), V) tensor: the draft model's distributions (None: proposed
                                   # deterministically, as by n-gram lookup)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """Generated tokens (without a token still being sampled on the device, see PENDING_TOKEN)."""
        end = len(self.token_ids) - (self.token_ids[-1] == PENDING_TOKEN)
        return self.token_ids[self.num_prompt_tokens:end]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_pending_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def fork(self) -> "Sequence":
        """A copy sharing nothing mutable; its blocks are assigned by the KV cache manager."""
        return Sequence(list(self.token_ids), self.num_prompt_tokens, num_computed_tokens=self.num_computed_tokens,
                        cumulative_logprob=self.cumulative_logprob, logprobs=list(self.logprobs),
                        sample_index=self.sample_index)


@dataclass
class BeamHypothesis:
    """A finished beam: its score (length-penalised), tokens and cumulative log-probability."""

    score: float
    sequence: Sequence


@dataclass(eq=False)
class Request:
    """One generation request: its sampling settings and its live sequences."""

    request_id: int
    prompt_token_ids: list[int]
    sampling: SamplingConfig
    end_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    seqs: list[Sequence] = field(default_factory=list)
    finished_seqs: list[Sequence] = field(default_factory=list)
    beam_hypotheses: list[BeamHypothesis] = field(default_factory=list)
    beam_improvable: bool = True            # beam search: a running beam may still beat the finished ones
    num_cached_prompt_tokens: int = 0       # prompt tokens found in the prefix cache (not computed)
    num_preemptions: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    context_logits: object = None           # (prompt_len, vocab) tensor when the engine gathers them
    context_logit_chunks: list = field(default_factory=list)
    generation_logits: list = field(default_factory=list)
    error: Exception | None = None          # why processing this request failed; the engine ends it alone
    lora_request: LoRARequest | None = None # the adapter it runs under (None: the base model)
    prompt_table: "PromptTable | None" = None  # its prompt embedding table (kiln.runtime.prompt_table)
    num_draft_tokens: int = 0               # speculative decoding: draft tokens verified,
    num_accepted_draft_tokens: int = 0      # of them accepted,
    num_speculative_steps: int = 0          # in this many steps that verified drafts

    def __post_init__(self):
        if not self.seqs:
            self.seqs = [Sequence(list(self.prompt_token_ids), len(self.prompt_token_ids))]
        self.stop_ids = self.end_ids | frozenset(self.sampling.stop_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @functools.cached_property
    def cache_salt(self) -> bytes:
        """What keys this request's prefix blocks apart from others': its adapter's (none for the base model), and
        with a prompt table, that table's digest too."""
        salt = b"" if self.lora_request is None else self.lora_request.cache_salt
        if self.prompt_table is not None:
            salt = hashlib.sha256(b"kiln-prompt-table\0" + salt + self.prompt_table.digest).digest()
        return salt

    @property
    def text_prompt_ids(self) -> list[int]:
        """The prompt's ids that are tokens of the vocabulary (not prompt-table rows), for detokenizing."""
        if self.prompt_table is None:
            return self.prompt_token_ids
        return [t for t in self.prompt_token_ids if t < self.prompt_table.first_id]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def all_seqs(self) -> list[Sequence]:
        return self.seqs + self.finished_seqs

    def max_blocks(self, tokens_per_block: int) -> int:
        """The most KV-cache blocks this request can ever hold at once (its worst case, nothing shared)."""
        per_seq = -(-(self.num_prompt_tokens + self.sampling.max_new_tokens) // tokens_per_block)
        return self.sampling.num_sequences * per_seq


def may_speculate(request: Request) -> bool:
    """Whether a request's decoding can verify draft tokens: one sequence (no beams, n = 1), no penalties (they
    depend on each token before) and no prompt table (drafters would copy or embed its ids)."""
    sampling = request.sampling
    return (len(request.seqs) == 1 and not sampling.use_beam_search and sampling.num_sequences == 1
            and not sampling.has_penalties and request.prompt_table is None)
