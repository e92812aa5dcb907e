"""Request bodies of /v1/completions, /v1/chat/completions and the LoRA adapter routes: strict types (no "1" for 1,
no true for 1), unknown fields refused, OpenAI fields Kiln does not implement refused by name (see UNSUPPORTED)."""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

MAX_STOP = 4
MAX_N = 128
MAX_TOP_LOGPROBS = 20
MAX_NAME, MAX_PATH = 256, 4096
INT64 = 2**63

UNSUPPORTED_COMMON = {
    "logit_bias": "logit_bias is not supported by Kiln",
    "best_of": "best_of is not supported by Kiln (use n)",
}
UNSUPPORTED_COMPLETION = {**UNSUPPORTED_COMMON, "suffix": "suffix (insertion) is not supported by Kiln"}
UNSUPPORTED_CHAT = {
    **UNSUPPORTED_COMMON,
    **{name: f"{name} is not supported by Kiln (no tool or function calling)"
       for name in ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls")},
    "response_format": "response_format is not supported by Kiln (answers are plain text)",
    "audio": "audio output is not supported by Kiln", "modalities": "modalities is not supported (text only)",
    "prediction": "predicted outputs are not supported by Kiln",
    "reasoning_effort": "reasoning_effort is not supported by Kiln",
    "web_search_options": "web search is not supported by Kiln",
    "store": "store is not supported by Kiln (nothing is stored)",
    "metadata": "metadata is not supported by Kiln (nothing is stored)",
    "service_tier": "service_tier is not supported by Kiln",
}


def checked_text(value: str) -> str:
    """A string that can be encoded (JSON escapes can carry lone surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text contains an unpaired UTF-16 surrogate") from None
    return value


Text = Annotated[str, AfterValidator(checked_text)]
"""A string field: refused if it cannot be encoded (it may be quoted in an answer, a log line, a template)."""
AdapterName = Annotated[str, Field(min_length=1, max_length=MAX_NAME), AfterValidator(checked_text)]


def _is_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def _prompts(value) -> list:
    """prompt: a string, a list of strings, a list of token ids or a list of such lists → a list of prompts."""
    if isinstance(value, str):
        return [checked_text(value)]
    if _is_ids(value):
        return [value]
    if isinstance(value, list) and value and all(isinstance(p, str) or _is_ids(p) for p in value):
        return [checked_text(p) if isinstance(p, str) else p for p in value]
    raise ValueError("must be a non-empty string, list of strings, list of token ids or list of token-id lists")


def _stops(value) -> list[str] | None:
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if not (isinstance(stops, list) and len(stops) <= MAX_STOP and all(isinstance(s, str) and s for s in stops)):
        raise ValueError(f"must be a non-empty string or a list of at most {MAX_STOP} non-empty strings")
    return [checked_text(s) for s in stops]


def _content(value) -> str:
    """Message content: a string or a list of {"type": "text", "text": ...} parts (joined)."""
    if isinstance(value, str):
        return checked_text(value)
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        if any(p.get("type") != "text" or set(p) != {"type", "text"} or not isinstance(p["text"], str) for p in value):
            raise ValueError('only {"type": "text", "text": ...} content parts are supported')
        return checked_text("".join(p["text"] for p in value))
    raise ValueError("must be a string or a list of text parts")


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields(Strict):
    """Fields both endpoints share; None means the OpenAI default."""

    model: Text
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=MAX_N)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Annotated[Union[list[str], None], BeforeValidator(_stops)] = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    user: Text | None = None
    """An end-user id; written in the request's log line."""

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


class CompletionRequest(SamplingFields):
    prompt: Annotated[list[Union[str, list[int]]], BeforeValidator(_prompts)]
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _echo_without_logprobs(self):
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs is not supported (prompt log-probabilities are not computed)")
        return self


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str, BeforeValidator(_content)]
    name: Text | None = None
    """The participant's name, for the chat template (templates that do not use it leave it out)."""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _limits(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_completion_tokens or max_tokens (deprecated), not both")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat(self) -> list[dict]:
        """Messages for the chat template ("developer" is the newer name of "system")."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.content,
                 **({"name": m.name} if m.name is not None else {})} for m in self.messages]


class LoadLoraAdapterRequest(Strict):
    """POST /v1/load_lora_adapter, vLLM's body: serve the PEFT adapter directory lora_path as the model lora_name."""

    lora_name: AdapterName
    lora_path: Annotated[str, Field(min_length=1, max_length=MAX_PATH), AfterValidator(checked_text)]


class UnloadLoraAdapterRequest(Strict):
    """POST /v1/unload_lora_adapter, vLLM's body (its lora_int_id is refused: Kiln's adapters have names only)."""

    lora_name: AdapterName
