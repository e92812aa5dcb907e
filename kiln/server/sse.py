"""Server-sent events: one `data: {json}` event per chunk, then `data: [DONE]`; an error during the stream is
sent as an OpenAI error event. When the stream stops early (client gone, server stopping), its generation is
aborted at once, so its KV blocks are freed without waiting for garbage collection."""
from __future__ import annotations

import json
from typing import AsyncIterator

from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse

from .errors import APIError
from .generation import Generation

DONE = "data: [DONE]\n\n"


def event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class EventStream(StreamingResponse):
    def __init__(self, chunks: AsyncIterator[dict], generation: Generation, state):
        self.generation, self.state, self.complete = generation, state, False
        super().__init__(self._events(chunks), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _events(self, chunks: AsyncIterator[dict]):
        try:
            async for chunk in chunks:
                yield event(chunk)
        except APIError as err:
            self.state.outcome = err.message
            yield event(err.body())
        else:
            yield DONE
        self.complete = True

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except (ClientDisconnect, OSError):
            pass
        finally:
            if not self.complete:
                self.state.outcome = "stream ended early (client gone or server stopping)"
            self.generation.close()
            await self.body_iterator.aclose()
