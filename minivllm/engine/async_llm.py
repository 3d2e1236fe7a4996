"""The asynchronous engine front: one engine loop, many streams (vLLM: ``vllm/v1/engine/async_llm.py``).

``AsyncLLM`` owns an ``LLMEngine`` and runs it in its own *engine thread*: the thread applies the queued adds and
aborts, runs one ``LLMEngine.step()``, hands each request's outputs to its stream, and repeats; with nothing to do it
sleeps until a request arrives. Requests are therefore added and aborted only between steps, and the model's torch
work never blocks the asyncio event loop of the callers (the API server's).

``generate(prompt, params, request_id)`` is an async generator of ``RequestOutput``s, one per step that produced
something for the request, ending with the finished one. A caller that stops listening (its task cancelled, the
generator closed: a client that disconnected) aborts the request, and its KV blocks return to the pool before the
next step. ``shutdown()`` aborts everything in flight: each open stream gets a final output with
``finish_reason == "abort"``; later requests raise ``EngineDeadError``.

Where minivllm differs from vLLM: vLLM's ``AsyncLLM`` sends requests over ZMQ to an ``EngineCoreProc`` in another
process (a busy loop with input and output queues and its own threads for socket I/O) and detokenizes in the
front-end process (``OutputProcessor`` in an asyncio output-handler task). minivllm keeps one process and one
thread for the whole ``LLMEngine`` (input processing, core and output processing): tokenizer and engine state are
touched by that thread only, so nothing else needs a lock. Validation (``LLMEngine.add_request``) also runs there,
between steps, and its ``ValueError`` is raised in the caller before the request is queued.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncGenerator, Dict, List, Optional, Tuple

from minivllm.engine.llm_engine import LLMEngine, PromptType
from minivllm.metrics.stats import SchedulerStats
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine was shut down (or its thread died): no new request is accepted (vLLM ``EngineDeadError``)."""


@dataclass
class EngineStats:
    """The engine as ``/metrics`` reads it: the scheduler's last ``SchedulerStats`` (vLLM's, carried in
    ``EngineCoreOutputs`` after each step, and made again after aborts) and the steps this front end ran."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of the pool's blocks in use, in [0, 1]
    num_preemptions: int = 0  # since the engine started
    num_steps: int = 0


@dataclass
class _Stream:
    """One request's output queue, bound to the event loop of the caller that reads it."""

    loop: asyncio.AbstractEventLoop
    queue: "asyncio.Queue[RequestOutput]" = field(default_factory=asyncio.Queue)


class AsyncLLM:
    """Asynchronous, streaming front end of an ``LLMEngine``, stepped by its own thread.

    Args:
        engine: the engine to drive. From here on only the engine thread touches it; read its state (for example
            ``kv_cache_manager.num_free_blocks``) only while no request is in flight, or through ``stats``.
        log_stats: take an ``EngineStats`` snapshot after every step.

    Use ``AsyncLLM.from_engine_args(model, **engine_kwargs)`` to build the engine as well.
    """

    def __init__(self, engine: LLMEngine, log_stats: bool = True) -> None:
        self.engine = engine
        self.log_stats = log_stats
        engine.engine_core.scheduler.log_stats = log_stats
        self.stats = EngineStats()
        self._cond = threading.Condition()
        self._adds: List[Tuple[str, PromptType, SamplingParams, _Stream, "asyncio.Future[None]"]] = []
        self._aborts: List[str] = []
        self._streams: Dict[str, _Stream] = {}  # engine thread only
        self._shutdown = False
        self._dead = False
        self.dead_error: Optional[BaseException] = None  # what killed the engine thread, if anything did
        self._thread = threading.Thread(target=self._engine_loop, name="minivllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, model=None, **engine_kwargs) -> "AsyncLLM":
        """Build the ``LLMEngine`` (``EngineArgs`` fields as keywords) and start its loop."""
        return cls(LLMEngine(model, **engine_kwargs))

    # ---- the caller's side (any event loop) ------------------------------------------------------------------
    @property
    def errored(self) -> bool:
        """True once the engine no longer accepts requests (shut down, or its thread died)."""
        return self._dead or self._shutdown

    @property
    def is_running(self) -> bool:
        """True while the engine thread steps (vLLM ``EngineClient.is_running``): False after ``shutdown()`` and
        after an error; ``dead_error`` then says which."""
        return not self.errored

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams) -> "asyncio.Queue[RequestOutput]":
        """Queue one request; returns its output queue once the engine thread accepted it.

        Raises:
            ValueError: anything ``LLMEngine.add_request`` rejects (bad prompt, prompt over ``max_model_len``,
                duplicate id, ...), before the request reaches the scheduler.
            EngineDeadError: after ``shutdown()``.
        """
        loop = asyncio.get_running_loop()
        stream = _Stream(loop)
        accepted: "asyncio.Future[None]" = loop.create_future()
        with self._cond:
            if self.errored:
                raise EngineDeadError("the engine is shut down")
            self._adds.append((request_id, prompt, params, stream, accepted))
            self._cond.notify()
        try:
            await accepted
        except asyncio.CancelledError:  # the caller left while the engine was deciding: withdraw the request
            self.abort(request_id)
            raise
        return stream.queue

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                       request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """Stream one request's outputs as the engine produces them (vLLM ``AsyncLLM.generate``).

        Use ``sampling_params.output_kind = RequestOutputKind.DELTA`` for deltas (what a streaming server wants),
        ``FINAL_ONLY`` for a single final output. The last output has ``finished == True``. Closing the generator
        or cancelling its task before then aborts the request.

        Raises:
            ValueError / EngineDeadError: from ``add_request``.
        """
        queue = await self.add_request(request_id, prompt, sampling_params)
        async for out in self.stream_outputs(queue, request_id):
            yield out

    async def stream_outputs(self, queue: "asyncio.Queue[RequestOutput]",
                             request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """The outputs of a request queued by ``add_request``, up to its finished one (the second half of
        ``generate``: a server calls ``add_request`` first, to answer a rejected request with an error status
        before it starts a stream). Closing or cancelling it early aborts the request."""
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished:  # cancelled, or the consumer closed us: the client is gone
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request before the next step (non-blocking; safe from any thread, also inside ``finally``).

        Unknown or finished ids are ignored. The request's stream gets its final ``"abort"`` output if anyone
        still reads it.
        """
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort every request in flight (each stream ends with ``finish_reason == "abort"``) and stop the thread.

        Requests still waiting to be accepted get ``EngineDeadError``. Safe to call twice.
        """
        with self._cond:
            self._shutdown = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ---- the engine thread ---------------------------------------------------------------------------------
    def _engine_loop(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cond:
                    while not (self._adds or self._aborts or self._shutdown or engine.has_unfinished_requests()):
                        self._cond.wait()
                    adds, self._adds = self._adds, []
                    aborts, self._aborts = self._aborts, []
                    shutdown = self._shutdown
                for request_id, prompt, params, stream, accepted in adds:
                    if shutdown:
                        _post(stream.loop, _set_exception, accepted, EngineDeadError("the engine is shut down"))
                        continue
                    try:
                        engine.add_request(request_id, prompt, params, arrival_time=time.time())
                    except Exception as e:  # ValueError mostly; the engine's state is unchanged either way
                        _post(stream.loop, _set_exception, accepted, e)
                        continue
                    self._streams[request_id] = stream
                    _post(stream.loop, _set_result, accepted)
                if shutdown:
                    aborts = list(self._streams)
                if aborts:
                    self._deliver(engine.abort_request(aborts))
                    for rid in aborts:  # unknown or already finished: nothing more will come for it
                        self._streams.pop(rid, None)
                    # No step may follow (nothing left to run): the gauges must not keep the aborted requests.
                    self._snapshot(engine.engine_core.scheduler.make_stats(), steps=0)
                if shutdown:
                    return
                if engine.has_unfinished_requests():
                    self._deliver(engine.step())
                    self._snapshot(engine.scheduler_stats, steps=1)
        except BaseException as e:  # a bug in a step: fail every waiting caller instead of leaving them hanging
            self._dead = True
            # A new error naming the cause, not the cause itself: its frames would keep every local of the failed
            # step (requests included) alive as long as the server is.
            self.dead_error = EngineDeadError(f"the engine loop raised {e!r}")
            for _rid, stream in self._streams.items():
                _post(stream.loop, stream.queue.put_nowait, _aborted_output(_rid))
            with self._cond:
                for *_x, stream, accepted in self._adds:
                    _post(stream.loop, _set_exception, accepted, EngineDeadError(repr(e)))
            raise
        finally:
            self._dead = True
            with self._cond:  # whatever slipped in after the last look: refuse it
                for *_x, stream, accepted in self._adds:
                    _post(stream.loop, _set_exception, accepted, EngineDeadError("the engine is shut down"))
                self._adds = []

    def _deliver(self, outputs: List[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            _post(stream.loop, stream.queue.put_nowait, out)

    def _snapshot(self, scheduler_stats: Optional[SchedulerStats], steps: int) -> None:
        if not self.log_stats or scheduler_stats is None:
            return
        s = scheduler_stats
        self.stats = EngineStats(
            num_running_reqs=s.num_running_reqs, num_waiting_reqs=s.num_waiting_reqs,
            kv_cache_usage=s.kv_cache_usage, num_preemptions=s.num_preemptions,
            num_steps=self.stats.num_steps + steps,
        )


def _post(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that caller's event loop is closed: nobody is listening any more
        pass


def _set_result(fut: "asyncio.Future[None]") -> None:
    if not fut.done():
        fut.set_result(None)


def _set_exception(fut: "asyncio.Future[None]", exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def _aborted_output(request_id: str) -> RequestOutput:
    from minivllm.outputs import CompletionOutput

    return RequestOutput(request_id, None, [], [CompletionOutput(0, "", [], "abort")], finished=True)
