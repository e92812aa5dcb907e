"""Server-sent events: one `data: {json}` event per chunk, then `data: [DONE]`; an error during the stream
(the server stopping, the engine failing, a bug) is sent as an OpenAI error event before `[DONE]`. When the
stream stops early (client gone), its generation is aborted at once, so its KV blocks are freed without waiting
for garbage collection."""
from __future__ import annotations

import json
import logging
from typing import AsyncIterator

from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse

from .errors import APIError
from .generation import Generation

DONE = "data: [DONE]\n\n"
logger = logging.getLogger("kiln.server")


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
        except Exception as err:  # noqa: BLE001 - the client still gets an error event and the end of the stream
            logger.exception("request_id=%s: the stream failed", self.state.request_id)
            self.state.outcome = f"internal server error: {type(err).__name__}"
            yield event(APIError(500, self.state.outcome, "internal_error").body())
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
