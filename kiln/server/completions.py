"""POST /v1/completions: text (or token-id) prompts, echo, logprobs with text offsets, streaming."""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from .body import parse_request
from .errors import invalid
from .generation import Generation
from .logprobs import completion_logprobs, text_logprobs
from .protocol import UNSUPPORTED_COMPLETION, CompletionRequest
from .responses import Delta, DeltaStream, Reply, choices
from .sampling import sampling_config
from .sse import EventStream

DEFAULT_MAX_TOKENS = 16   # OpenAI's default for completions


async def create_completion(request: Request, server) -> JSONResponse | EventStream:
    req = await parse_request(request, CompletionRequest, server.config, UNSUPPORTED_COMPLETION)
    model = server.resolve_model(request, req.model)
    server.note_prompt(request, req.prompt, req.user)
    if len(req.prompt) > server.llm.build_config.max_batch_size:
        raise invalid(f"{len(req.prompt)} prompts in one request: at most the engine's max_batch_size="
                      f"{server.llm.build_config.max_batch_size}", "prompt")
    for prompt in req.prompt:
        server.check_prompt_size(prompt, "prompt")
    sampling = sampling_config(req, req.max_tokens or DEFAULT_MAX_TOKENS, req.logprobs)
    echoes = await server.offload(_echoes, server, req.prompt) if req.echo else [""] * len(req.prompt)
    reply = Reply(request, server, "cmpl", model.name)
    generation = await Generation.start(server, req.prompt, sampling, bool(req.stream), model)
    if req.stream:
        return EventStream(_chunks(DeltaStream(generation, req.n or 1), req, reply, echoes, server.strings),
                           generation, request.state)
    outputs = await generation.outputs(request)
    body = [_choice(i, echoes[p] + c.text, None if req.logprobs is None else
                    completion_logprobs(server.strings, text_logprobs(c), len(echoes[p])), c.finish_reason)
            for i, p, c in choices(outputs, req.n or 1)]
    return JSONResponse(reply.body("text_completion", body, usage=reply.usage(outputs)))


def _echoes(server, prompts: list) -> list[str]:
    """Every prompt as text, for echo (on the worker thread: decoding token ids is CPU work)."""
    return [server.prompt_text(p) for p in prompts]


def _choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


async def _chunks(deltas: DeltaStream, req: CompletionRequest, reply: Reply, echoes: list[str], strings):
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    extra = {"usage": None} if include_usage else {}
    offsets: dict[int, int] = {}
    async for delta in deltas:
        text = (echoes[delta.prompt_index] if delta.first else "") + delta.text
        yield reply.body("text_completion", [_choice(delta.index, text, _logprobs(delta, offsets, strings, req),
                                                     delta.finish_reason)], **extra)
    usage = reply.usage(deltas.outputs())
    if include_usage:
        yield reply.body("text_completion", [], usage=usage)


def _logprobs(delta: Delta, offsets: dict[int, int], strings, req: CompletionRequest) -> dict | None:
    """The delta's token logprobs, their text offsets continuing from the choice's previous chunks."""
    if req.logprobs is None:
        return None
    start = offsets.get(delta.index, 0)
    result = completion_logprobs(strings, delta.logprobs, start)
    offsets[delta.index] = start + sum(len(t) for t in result["tokens"])
    return result
