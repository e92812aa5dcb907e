"""Token log-probabilities in OpenAI's two shapes: completions (parallel lists with text offsets) and chat
(one entry per token with its UTF-8 bytes and top alternatives)."""
from __future__ import annotations

from kiln.runtime.outputs import CompletionOutput
from kiln.runtime.request import TokenLogprob


class TokenStrings:
    """The text of single tokens (special tokens included), decoded once each."""

    def __init__(self, tokenizer):
        self.tokenizer, self.cache = tokenizer, {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None and self.tokenizer is None:
            return f"<{token_id}>"
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False,
                                                                clean_up_tokenization_spaces=False)
        return text


def text_logprobs(completion: CompletionOutput) -> list[TokenLogprob]:
    """The entries of the tokens the text shows: without the end/stop token that ended it (it adds no text)."""
    entries = completion.logprobs or []
    stop = completion.stop_reason
    if entries and isinstance(stop, int) and completion.finish_reason == "stop" and entries[-1].token_id == stop:
        return entries[:-1]
    return entries


def _top(entry: TokenLogprob) -> list[tuple[int, float]]:
    return sorted(entry.top.items(), key=lambda item: -item[1])


def completion_logprobs(strings: TokenStrings, entries: list[TokenLogprob], offset: int) -> dict:
    """{"tokens", "token_logprobs", "top_logprobs", "text_offset"}; offsets count from `offset`."""
    tokens, offsets = [], []
    for entry in entries:
        offsets.append(offset)
        tokens.append(strings(entry.token_id))
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{strings(t): lp for t, lp in _top(e)} for e in entries], "text_offset": offsets}


def _chat_token(strings: TokenStrings, token_id: int, logprob: float) -> dict:
    text = strings(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(strings: TokenStrings, entries: list[TokenLogprob]) -> dict:
    return {"content": [{**_chat_token(strings, e.token_id, e.logprob),
                         "top_logprobs": [_chat_token(strings, t, lp) for t, lp in _top(e)]} for e in entries],
            "refusal": None}
