"""The engine requests behind one HTTP request (one per prompt): submitted together, awaited or streamed
together, and aborted together when the client goes away, the server stops, or something fails."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from fastapi import Request

from kiln.runtime.outputs import GenerationOutput
from kiln.runtime.sampling import SamplingConfig

from .admission import Admission
from .errors import APIError, invalid
from .metrics import ServerMetrics

LIMIT_WORDS = ("max_input_len", "max_seq_len", "KV cache")


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready."""


class Generation:
    def __init__(self, llm, prompts: list, sampling: SamplingConfig, streaming: bool, admission: Admission,
                 metrics: ServerMetrics):
        admission.acquire()
        self._admission, self._metrics, self.results, self._closed = admission, metrics, [], False
        self._observed: set[int] = set()
        try:
            for prompt in prompts:
                self.results.append(llm.generate_async(prompt, sampling, streaming=streaming))
        except ValueError as err:
            self.close()
            code = "context_length_exceeded" if any(w in str(err) for w in LIMIT_WORDS) else "invalid_value"
            raise invalid(str(err), code=code) from None
        except RuntimeError as err:
            self.close()
            raise APIError(503, f"the engine cannot take requests: {err}", "engine_unavailable") from None

    def close(self) -> None:
        """Abort what is still running and give the queue slot back (once)."""
        if self._closed:
            return
        self._closed = True
        for result in self.results:
            if not result.finished:
                result.abort()
        self._admission.release()

    def _observe(self, index: int, output: GenerationOutput) -> None:
        if output.finished and index not in self._observed:
            self._observed.add(index)
            self._metrics.observe(output)

    async def outputs(self, request: Request) -> list[GenerationOutput]:
        """Every prompt's final output; raises ClientDisconnected (after aborting) if the client leaves first."""
        done = asyncio.ensure_future(asyncio.gather(*(r.aresult() for r in self.results)))
        gone = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not done.done():
                raise ClientDisconnected()
            outputs = done.result()
        except RuntimeError as err:
            raise APIError(503, f"generation failed: {err}", "engine_unavailable") from None
        finally:
            gone.cancel()
            done.cancel()
            self.close()
        for index, output in enumerate(outputs):
            self._observe(index, output)
        return outputs

    async def snapshots(self) -> AsyncIterator[tuple[int, GenerationOutput]]:
        """(prompt index, streamed snapshot) of every prompt, as they come; closes the generation at the end."""
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.ensure_future(_pump(i, r, queue)) for i, r in enumerate(self.results)]
        remaining = len(self.results)
        try:
            while remaining:
                index, output, *error = await queue.get()
                if output is not None:
                    self._observe(index, output)
                    yield index, output
                elif error:
                    raise APIError(503, f"generation failed: {error[0]}", "engine_unavailable")
                else:
                    remaining -= 1
        finally:
            for task in tasks:
                task.cancel()
            self.close()


async def _pump(index: int, result, queue: asyncio.Queue) -> None:
    """Puts (index, snapshot) for each snapshot, then (index, None), or (index, None, error) on failure."""
    try:
        async for output in result:
            queue.put_nowait((index, output))
    except RuntimeError as err:
        queue.put_nowait((index, None, err))
        return
    queue.put_nowait((index, None))


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
