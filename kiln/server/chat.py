"""POST /v1/chat/completions: messages through the tokenizer's chat template; deltas with the assistant role
first, logprobs per token, streaming."""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from .body import parse_request
from .errors import invalid
from .generation import Generation
from .logprobs import chat_logprobs, text_logprobs
from .protocol import UNSUPPORTED_CHAT, ChatCompletionRequest
from .responses import DeltaStream, Reply, choices
from .sampling import sampling_config
from .sse import EventStream


async def create_chat_completion(request: Request, server) -> JSONResponse | EventStream:
    req = await parse_request(request, ChatCompletionRequest, server.config, UNSUPPORTED_CHAT)
    model = server.resolve_model(request, req.model)
    messages = req.chat()
    server.note_prompt(request, messages, req.user)
    server.check_prompt_size("".join(m["content"] for m in messages), "messages")
    prompt = await server.offload(_template, server.llm, messages)
    limits = server.llm.build_config
    max_new = req.max_new_tokens or max(1, min(limits.max_output_len, limits.max_seq_len - len(prompt)))
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    sampling = sampling_config(req, max_new, logprobs)
    reply = Reply(request, server, "chatcmpl", model.name)
    generation = await Generation.start(server, [prompt], sampling, bool(req.stream), model)
    if req.stream:
        return EventStream(_chunks(DeltaStream(generation, req.n or 1), req, reply, server.strings),
                           generation, request.state)
    outputs = await generation.outputs(request)
    body = [{"index": i, "message": {"role": "assistant", "content": c.text, "refusal": None},
             "logprobs": chat_logprobs(server.strings, text_logprobs(c)) if req.logprobs else None,
             "finish_reason": c.finish_reason} for i, _, c in choices(outputs, req.n or 1)]
    return JSONResponse(reply.body("chat.completion", body, usage=reply.usage(outputs)))


def _template(llm, messages: list[dict]) -> list[int]:
    from jinja2 import TemplateError

    try:
        return llm.apply_chat_template(messages)
    except (ValueError, TemplateError) as err:
        raise invalid(f"the chat template cannot format these messages: {err}", "messages") from None


async def _chunks(deltas: DeltaStream, req: ChatCompletionRequest, reply: Reply, strings):
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    extra = {"usage": None} if include_usage else {}
    async for delta in deltas:
        message = ({"role": "assistant", "content": delta.text, "refusal": None} if delta.first
                   else {"content": delta.text})
        if delta.finish_reason and not delta.text and not delta.first:
            message = {}
        choice = {"index": delta.index, "delta": message, "finish_reason": delta.finish_reason,
                  "logprobs": chat_logprobs(strings, delta.logprobs) if req.logprobs else None}
        yield reply.body("chat.completion.chunk", [choice], **extra)
    usage = reply.usage(deltas.outputs())
    if include_usage:
        yield reply.body("chat.completion.chunk", [], usage=usage)
