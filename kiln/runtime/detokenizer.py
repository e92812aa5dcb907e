"""Incremental detokenization: text deltas that never end inside a multi-byte character, and stop strings."""
from __future__ import annotations

CONTEXT_TOKENS = 6  # prompt tokens decoded with the output so a first token keeps its leading space


class IncrementalDetokenizer:
    """Turns a growing list of output tokens into text pieces. Decoding restarts from a small window of recent
    tokens, and a piece is released only when it does not end in U+FFFD (an incomplete UTF-8 sequence)."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset, self.read_offset = 0, len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the text they complete (possibly empty)."""
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        """At the end: whatever is still held back (an incomplete character decodes as U+FFFD)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):] if len(full) > len(prefix) else ""


def find_stop(text: str, start: int, stops: list[str]) -> int | None:
    """Index of the earliest stop string in text that ends after `start` (new text), or None."""
    best = None
    for stop in stops:
        index = text.find(stop, max(0, start - len(stop) + 1))
        if index != -1 and (best is None or index < best):
            best = index
    return best
