"""The background engine loop that many callers share, and the results they wait on (sync, async, streamed).

    callers ──submit/abort──▶ inbox ──▶ [engine thread: drain inbox → EngineCore.step() → publish outputs]
                                                              │
    GenerationResult ◀── snapshots (text, deltas, finish) ────┘

A job for an idle engine (run_when_idle: refit) waits in the loop until the requests submitted before it have
finished; requests submitted after it wait behind it, so each request runs wholly before or wholly after it.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time

import torch

from .detokenizer import IncrementalDetokenizer, find_stop
from .engine_core import EngineCore
from .outputs import CompletionOutput, GenerationOutput, RequestMetrics
from .request import Request, Sequence

logger = logging.getLogger("kiln.runtime")


class RequestFailed(RuntimeError):
    """One request failed inside the engine (its sampling or text processing raised); the engine loop and the
    other requests went on. The message names the request and the cause."""


class GenerationResult:
    """A request's outputs as they come: `.result()` blocks, `await result` waits in asyncio, and iterating
    (`for` or `async for`) yields every published snapshot — each streamed delta when streaming."""

    def __init__(self, request_id: int, abort_fn):
        self.request_id = request_id
        self._abort_fn = abort_fn
        self._cond = threading.Condition()
        self._outputs: list[GenerationOutput] = []
        self._done = False
        self._error: BaseException | None = None
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    # --- engine side --------------------------------------------------------------------------------------
    def _publish(self, output: GenerationOutput | None, error: BaseException | None = None) -> None:
        with self._cond:
            if output is not None:
                self._outputs.append(output)
            self._done = self._done or error is not None or (output is not None and output.finished)
            self._error = self._error or error
            self._cond.notify_all()
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            try:
                loop.call_soon_threadsafe(lambda f=future: f.done() or f.set_result(None))
            except RuntimeError:                   # that caller's event loop has closed: nobody waits there now
                pass

    # --- caller side --------------------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        """Stop generating; the result finishes with finish_reason "abort"."""
        self._abort_fn(self.request_id)

    def result(self, timeout: float | None = None) -> GenerationOutput:
        with self._cond:
            if not self._cond.wait_for(lambda: self._done, timeout):
                raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
            return self._final()

    def _final(self) -> GenerationOutput:
        if isinstance(self._error, RequestFailed):
            raise self._error
        if self._error is not None:
            raise RuntimeError(f"request {self.request_id} failed: {self._error}") from self._error
        return self._outputs[-1]

    def __iter__(self):
        index = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: index < len(self._outputs) or self._done)
                if index >= len(self._outputs):
                    self._final()
                    return
                item = self._outputs[index]
            index += 1
            yield item

    async def _next(self, index: int):
        while True:
            with self._cond:
                if index < len(self._outputs):
                    return self._outputs[index]
                if self._done:
                    self._final()
                    return None
                future = asyncio.get_running_loop().create_future()
                self._waiters.append((asyncio.get_running_loop(), future))
            await future

    async def _aiter(self):
        index = 0
        while (item := await self._next(index)) is not None:
            index += 1
            yield item

    def __aiter__(self):
        return self._aiter()

    async def aresult(self) -> GenerationOutput:
        async for _ in self:
            pass
        with self._cond:
            return self._final()

    def __await__(self):
        return self.aresult().__await__()


class _IdleJob:
    """A function to run on the engine thread with no request in flight (run_when_idle), and how it ended."""

    def __init__(self, fn):
        self.fn, self.done, self.result, self.error = fn, threading.Event(), None, None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as err:  # noqa: BLE001 - the caller of run_when_idle raises it
            self.error = err
            if not isinstance(err, Exception):
                raise
        finally:
            self.done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()


class _SeqText:
    """Text state of one sequence: its detokenizer, the text so far, and what was already published."""

    def __init__(self, detokenizer: IncrementalDetokenizer | None):
        self.detokenizer = detokenizer
        self.text, self.num_tokens, self.stop_reason, self.done = "", 0, None, False
        self.published_text, self.published_tokens = 0, 0


class _RequestState:
    def __init__(self, request: Request, prompt, result: GenerationResult, streaming: bool):
        self.request, self.prompt, self.result, self.streaming = request, prompt, result, streaming
        self.texts: dict[int, _SeqText] = {}


class GenerationExecutor:
    """Owns the EngineCore on a background thread; safe to call from any thread or event loop."""

    def __init__(self, core: EngineCore, tokenizer, describe_failure=None):
        """describe_failure() explains an engine-loop error (e.g. which worker rank died), or returns None."""
        self.core, self.tokenizer, self.describe_failure = core, tokenizer, describe_failure
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._states: dict[int, _RequestState] = {}
        # idle jobs, and the requests submitted after the first of them, in the order they came
        self._deferred: collections.deque[_IdleJob | _RequestState] = collections.deque()
        self._stopped = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kiln-engine", daemon=True)
        self._thread.start()

    def submit(self, request: Request, prompt, streaming: bool) -> GenerationResult:
        if self._error is not None:
            raise RuntimeError(f"the engine loop has stopped after an error: {self._error}")
        if self._stopped.is_set():
            raise RuntimeError("the LLM has been shut down")
        result = GenerationResult(request.request_id, self.abort)
        self._inbox.put(("add", _RequestState(request, prompt, result, streaming)))
        return result

    def abort(self, request_id: int) -> None:
        self._inbox.put(("abort", request_id))

    def run_when_idle(self, fn):
        """Run fn() on the engine thread once every request submitted before this call has finished (requests
        submitted meanwhile wait and run after it); returns its result, or raises its error, in the caller's
        thread."""
        if self._error is not None:
            raise RuntimeError(f"the engine loop has stopped after an error: {self._error}")
        if self._stopped.is_set():
            raise RuntimeError("the LLM has been shut down")
        job = _IdleJob(fn)
        self._inbox.put(("idle", job))
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result

    @property
    def alive(self) -> bool:
        """Whether the engine loop is running and takes requests."""
        return self._thread.is_alive() and not self._stopped.is_set() and self._error is None

    @property
    def finished(self) -> bool:
        """Whether the engine thread has ended (after shutdown, or a failure)."""
        return not self._thread.is_alive()

    def shutdown(self, timeout: float = 30.0) -> None:
        if not self._stopped.is_set():
            self._stopped.set()
            self._inbox.put(("wake", None))
            self._thread.join(timeout)

    # --- engine thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                self._drain(block=not self.core.has_unfinished() and not self._deferred)
                self._run_deferred()
                if self.core.has_unfinished():
                    with torch.inference_mode():
                        advanced = self.core.step()
                    for request in advanced:
                        state = self._states.get(request.request_id)
                        if state is not None:              # None: aborted, or finished by an earlier step
                            self._process_alone(state)
            error = RuntimeError("the LLM was shut down before this request finished")
        except BaseException as exc:  # noqa: BLE001 - every waiting caller must hear about it
            error = exc
            if self.describe_failure is not None:
                time.sleep(0.5)                    # let a dying worker report its traceback
                detail = self.describe_failure()
                if detail:
                    error = RuntimeError(f"{detail}\n(the engine loop stopped: {exc})")
            self._error = error
        for item in self._deferred:
            if isinstance(item, _IdleJob):
                item.fail(RuntimeError(f"the engine loop stopped before this could run: {error}"))
        self._deferred.clear()
        for state in self._states.values():
            state.result._publish(None, error)
        self._states.clear()

    def _drain(self, block: bool) -> None:
        while True:
            try:
                kind, item = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if kind == "add":
                self._states[item.request.request_id] = item
                if self._deferred:
                    self._deferred.append(item)
                else:
                    self._admit(item)
            elif kind == "idle":
                self._deferred.append(item)
            elif kind == "abort" and item in self._states:
                state = self._states[item]
                if state in self._deferred:
                    self._deferred.remove(state)
                self.core.abort(state.request)
                self._process_alone(state)

    def _admit(self, state: _RequestState) -> None:
        try:
            self.core.add_request(state.request)
        except Exception as err:  # noqa: BLE001 - it fails this request only
            self._fail(state, err)

    def _run_deferred(self) -> None:
        """With no request in flight, run the first idle job, then admit the requests that came after it, up to
        the next job (which waits for them)."""
        while self._deferred and not self.core.has_unfinished():
            self._deferred.popleft().run()
            while self._deferred and not isinstance(self._deferred[0], _IdleJob):
                self._admit(self._deferred.popleft())

    def _process_alone(self, state: _RequestState) -> None:
        """_process, where an error (or one the engine met sampling it: request.error) fails this request only."""
        try:
            if state.request.error is not None:
                raise state.request.error
            self._process(state)
        except Exception as err:  # noqa: BLE001 - whatever it is, it is this request's alone
            self._fail(state, err)

    def _fail(self, state: _RequestState, err: Exception) -> None:
        """End a failed request (its KV blocks freed) and tell its caller which request failed and why."""
        request_id = state.request.request_id
        logger.error("request %d failed (the engine goes on): %s: %s", request_id, type(err).__name__, err,
                     exc_info=err)
        self._states.pop(request_id, None)
        if not state.request.finished:
            self.core.abort(state.request)
        failure = RequestFailed(f"request {request_id} failed: {type(err).__name__}: {err}")
        failure.__cause__ = err
        state.result._publish(None, failure)

    def _process(self, state: _RequestState) -> None:
        request = state.request
        if not (request.finished or state.streaming or request.sampling.stop):
            return                                     # nothing to publish or check yet: decode at the end
        for seq in list(request.seqs) + request.finished_seqs:
            self._detokenize(state, request, seq)
        if request.finished or state.streaming:
            state.result._publish(self._snapshot(state))
        if request.finished:
            del self._states[request.request_id]

    def _detokenize(self, state: _RequestState, request: Request, seq: Sequence) -> None:
        if request.sampling.use_beam_search:
            return
        text = state.texts.get(seq.seq_id)
        if text is None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, request.text_prompt_ids) if self.tokenizer else None
            text = state.texts[seq.seq_id] = _SeqText(detokenizer)
        if text.detokenizer is None or text.done:
            return
        tokens = seq.output_token_ids
        if seq.finish_reason == "stop" and tokens and tokens[-1] in request.stop_ids:
            text.stop_reason, tokens = tokens[-1], tokens[:-1]     # an end/stop token adds no text
        new = tokens[text.num_tokens:]
        # several new tokens (a speculative step) are looked at one by one for a stop string, so the tokens after
        # the one that completes it are dropped, as decoding one token a step would never have made them
        pieces = [[t] for t in new] if request.sampling.stop and len(new) > 1 else [new]
        for i, piece in enumerate(pieces):
            before, text.num_tokens = len(text.text), text.num_tokens + len(piece)
            if piece:
                text.text += text.detokenizer.push(piece)
            if seq.finished and i == len(pieces) - 1:
                text.text += text.detokenizer.flush()
                text.done = True
            cut = find_stop(text.text, before, request.sampling.stop) if request.sampling.stop else None
            if cut is not None:
                self._stop_at(request, seq, text, cut, drop_after=len(pieces) > 1)
                return

    def _stop_at(self, request: Request, seq: Sequence, text: _SeqText, cut: int, drop_after: bool) -> None:
        """End the sequence at a stop string found at text position `cut`: its text cut there (and with
        drop_after, its tokens after the one that completed it dropped)."""
        text.stop_reason = next(s for s in request.sampling.stop if text.text.startswith(s, cut))
        text.text, text.done = text.text[:cut], True
        if drop_after:
            del seq.token_ids[seq.num_prompt_tokens + text.num_tokens:]
        if seq.finished:
            seq.finish_reason = "stop"
        else:
            self.core.finish_seq(request, seq, "stop")

    def _snapshot(self, state: _RequestState) -> GenerationOutput:
        request = state.request
        if request.sampling.use_beam_search:
            seqs = [h.sequence for h in request.beam_hypotheses] if request.finished else []
        else:
            seqs = sorted(request.all_seqs(), key=lambda s: s.sample_index)
        outputs = [self._completion(state, i, seq) for i, seq in enumerate(seqs)]
        metrics = RequestMetrics(request.arrival_time, request.first_token_time, request.finish_time,
                                 max((s.num_output_tokens for s in request.all_seqs()), default=0),
                                 request.num_draft_tokens, request.num_accepted_draft_tokens,
                                 request.num_speculative_steps)
        return GenerationOutput(request.request_id, state.prompt, list(request.prompt_token_ids), outputs,
                                request.finished, metrics, request.num_cached_prompt_tokens, request.context_logits,
                                _runtime_dict(request, outputs))

    def _completion(self, state: _RequestState, index: int, seq: Sequence) -> CompletionOutput:
        request, sampling = state.request, state.request.sampling
        text_state = state.texts.get(seq.seq_id)
        if text_state is None:                    # beams: decode once at the end
            text_state = _SeqText(None)
            text_state.text = self.tokenizer.decode(
                [t for t in seq.output_token_ids if t not in request.stop_ids], skip_special_tokens=True,
                clean_up_tokenization_spaces=False) if self.tokenizer else ""
            state.texts[seq.seq_id] = text_state
        tokens = list(seq.output_token_ids)
        hold = 0 if seq.finished or request.finished else max((len(s) for s in sampling.stop), default=1) - 1
        shown = max(text_state.published_text, len(text_state.text) - hold)
        text_diff = text_state.text[text_state.published_text:shown]
        token_diff = tokens[text_state.published_tokens:]
        text_state.published_text, text_state.published_tokens = shown, len(tokens)
        pad = sampling.pad_id if sampling.pad_id is not None else min(request.end_ids, default=0)
        logits = torch.stack(request.generation_logits) if request.generation_logits and index == 0 else None
        return CompletionOutput(
            index=index, text=text_state.text[:shown], token_ids=tokens,
            finish_reason=seq.finish_reason or (request.finish_reason if request.finished else None),
            stop_reason=text_state.stop_reason, cumulative_logprob=seq.cumulative_logprob if seq.logprobs else None,
            logprobs=list(seq.logprobs) if sampling.logprobs is not None else None, text_diff=text_diff,
            token_ids_diff=token_diff, padded_token_ids=tokens + [pad] * (sampling.max_new_tokens - len(tokens)),
            generation_logits=logits)


def _runtime_dict(request, outputs: list[CompletionOutput]) -> dict | None:
    """TensorRT-LLM's runtime output dict of a request that asked for it (SamplingConfig.return_dict)."""
    sampling = request.sampling
    if not sampling.return_dict:
        return None
    prompt = list(request.prompt_token_ids)
    result = {"output_ids": [prompt + c.padded_token_ids for c in outputs]}
    if sampling.output_sequence_lengths:
        result["sequence_lengths"] = [len(prompt) + len(c.token_ids) for c in outputs]
    return result
