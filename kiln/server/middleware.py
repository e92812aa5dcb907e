"""Around every HTTP request: a request id (also the X-Request-Id header), the count by route and status, and
one log line when the response is done (id, status, tokens, latency, the LoRA adapter asked for; the prompt only
with log_prompts)."""
from __future__ import annotations

import logging
import time
import uuid

from .metrics import ServerMetrics

logger = logging.getLogger("kiln.server")


class RequestLog:
    """A plain ASGI middleware, so that streamed responses are logged when their last event is sent."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = uuid.uuid4().hex[:24]
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        start, status = time.perf_counter(), [500]

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self.metrics.count_request(scope["path"], status[0])
            logger.info(log_line(scope, state, status[0], time.perf_counter() - start))


def log_line(scope, state: dict, status: int, seconds: float) -> str:
    prompt_tokens, completion_tokens = state.get("usage", ("-", "-"))
    parts = [f"request_id={state['request_id']}", f"{scope['method']} {scope['path']}", f"status={status}",
             f"prompt_tokens={prompt_tokens}", f"completion_tokens={completion_tokens}",
             f"latency_ms={seconds * 1e3:.1f}"]
    for key in ("adapter", "user", "outcome", "prompt"):
        if state.get(key) is not None:
            parts.append(f"{key}={state[key]!r}")
    return " ".join(parts)
