"""The engine requests behind one HTTP request (one per prompt): submitted together, awaited or streamed
together, and aborted together when the client goes away, the server stops, or something fails.

A Generation holds a queue slot from `start` until `close`, which every path reaches: `start` closes it when
submitting fails, `outputs` and `snapshots` close it when they end, however they end."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from fastapi import Request

from kiln.runtime.executor import RequestFailed
from kiln.runtime.outputs import GenerationOutput
from kiln.runtime.sampling import SamplingConfig

from .admission import Admission
from .errors import APIError, ClientDisconnected, invalid
from .metrics import ServerMetrics
from .models import Model

LIMIT_WORDS = ("max_input_len", "max_output_len", "max_seq_len", "KV cache")


def stopped_by_shutdown() -> APIError:
    return APIError(503, "the server shut down before this request finished", "server_shutting_down")


def _engine_error(err: RuntimeError) -> APIError:
    """A request the engine failed alone: 500; the engine loop stopped: 503."""
    if isinstance(err, RequestFailed):
        return APIError(500, f"generation failed: {err}", "internal_error")
    return APIError(503, f"generation failed: {err}", "engine_unavailable")


class Generation:
    def __init__(self, admission: Admission, metrics: ServerMetrics):
        admission.acquire(self)
        self._admission, self._metrics, self.results = admission, metrics, []
        self._closed = self._stopped = False
        self._observed: set[int] = set()

    @classmethod
    async def start(cls, server, prompts: list, sampling: SamplingConfig, streaming: bool,
                    model: Model) -> "Generation":
        """Take a queue slot and submit every prompt (tokenised on the server's worker thread) to `model`."""
        generation = cls(server.admission, server.metrics)
        try:
            await server.offload(generation._submit, server.llm, prompts, sampling, streaming, model.lora)
        except ValueError as err:
            generation.close()
            code = "context_length_exceeded" if any(w in str(err) for w in LIMIT_WORDS) else "invalid_value"
            raise invalid(str(err), code=code) from None
        except RuntimeError as err:
            generation.close()
            raise APIError(503, f"the engine cannot take requests: {err}", "engine_unavailable") from None
        except BaseException:
            generation.close()
            raise
        if generation._stopped:
            generation.close()
            raise stopped_by_shutdown()
        server.metrics.count_model(model.name)
        return generation

    def _submit(self, llm, prompts: list, sampling: SamplingConfig, streaming: bool, lora) -> None:
        """On the worker thread. Closed or stopped meanwhile (client gone, cancelled, shutdown): what was
        submitted is aborted here, as the loop's close() may have run before it was."""
        try:
            for prompt in prompts:
                if self._closed or self._stopped:
                    return
                self.results.append(llm.generate_async(prompt, sampling, streaming=streaming, lora_request=lora))
        finally:
            if self._closed or self._stopped:
                self._abort()

    def _abort(self) -> None:
        for result in list(self.results):
            if not result.finished:
                result.abort()

    def close(self) -> None:
        """Abort what is still running and give the queue slot back (once)."""
        if self._closed:
            return
        self._closed = True
        self._abort()
        self._admission.release(self)

    def stop(self) -> None:
        """The server is stopping: abort; the request then answers 503 (a stream: an error event, [DONE])."""
        self._stopped = True
        self._abort()

    def _observe(self, index: int, output: GenerationOutput) -> None:
        if output.finished and index not in self._observed:
            self._observed.add(index)
            self._metrics.observe(output)

    async def _finals(self) -> list[GenerationOutput]:
        try:
            return [await result for result in self.results]
        except RuntimeError as err:
            raise _engine_error(err) from None

    async def outputs(self, request: Request) -> list[GenerationOutput]:
        """Every prompt's final output; raises ClientDisconnected (after aborting) if the client leaves first."""
        done = asyncio.ensure_future(self._finals())
        gone = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not done.done():
                raise ClientDisconnected()
            outputs = done.result()
        finally:
            _dismiss(gone)
            _dismiss(done)
            self.close()
        if self._stopped and any(map(_aborted, outputs)):
            raise stopped_by_shutdown()
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
                if self._stopped and output is not None and _aborted(output):
                    raise stopped_by_shutdown()
                if output is not None:
                    self._observe(index, output)
                    yield index, output
                elif error:
                    raise _engine_error(error[0])
                else:
                    remaining -= 1
        finally:
            for task in tasks:
                _dismiss(task)
            self.close()


def _aborted(output: GenerationOutput) -> bool:
    return output.finished and any(c.finish_reason == "abort" for c in output.outputs)


def _dismiss(task: asyncio.Future) -> None:
    """Cancel a task whose outcome nobody needs any more, retrieving the exception it may end with (asyncio
    logs an error for every exception never retrieved)."""
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


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
