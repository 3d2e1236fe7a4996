"""The engine core: scheduler + model runner, one step at a time (vLLM: ``vllm/v1/engine/core.py``).

``EngineCore.step()`` is vLLM's: ``schedule()`` -> ``execute_model()`` -> ``sample_tokens()`` ->
``update_from_output()``. It knows
nothing of text: detokenization and stop strings happen in the ``OutputProcessor``, above it.

Where minivllm differs from vLLM:

* Everything runs in one process. vLLM's ``LLMEngine`` talks to the core through an ``EngineCoreClient`` (in
  process, or over ZMQ to a busy-looping ``EngineCoreProc``); minivllm calls ``EngineCore`` directly, because the
  course steps it by hand and inspects its scheduler and KV cache between steps.
* The layers below are vLLM's: ``model_executor`` is an ``Executor`` (``minivllm/executor/``:
  ``UniProcExecutor`` for one device, ``MultiprocExecutor`` for worker processes that the engine starts,
  ``ExecutorWithExternalLauncher`` under ``torchrun``), which drives one ``Worker`` per device, which owns the
  ``ModelRunner``. ``__init__`` follows vLLM's order: the executor (its workers load the model), then
  ``_initialize_kv_caches`` (the workers' available memory -> the block count -> each worker allocates its KV
  cache and captures its graphs), then the ``KVCacheManager`` and the ``Scheduler``.
* Async scheduling (``SchedulerConfig.async_scheduling``) runs vLLM's ``step_with_batch_queue`` with a queue of
  two: schedule step N+1 and run it, then process step N's output. The forward pass runs synchronously here, so
  the model runner already holds step N's sampled tokens when it builds step N+1's inputs (vLLM's runner copies
  them on the GPU); what changes is the scheduler's view, exactly as in vLLM. When no request is left, the step
  still in the queue is processed at once (its requests are all finished, so it emits nothing).
* Step observers (``step_observers``) let tools watch each step without reaching into the engine: each observer's
  ``on_schedule(engine_core, scheduler_output)`` runs right after ``schedule()`` (before the forward pass changes
  anything), and the ``LLMEngine`` calls ``on_step_end(engine_core, engine_core_outputs, request_outputs)`` when
  the step's outputs are final. The course's ``SchedulerTrace`` is one. vLLM has no such hook; its closest
  relatives are the stat loggers fed with ``SchedulerStats``.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Deque, Iterable, List, Protocol, Tuple

from minivllm.config import VllmConfig, max_model_len_error
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.sched.output import SchedulerOutput
from minivllm.core.sched.async_scheduler import AsyncScheduler
from minivllm.core.sched.scheduler import Scheduler
from minivllm.engine import EngineCoreOutputs
from minivllm.executor import get_executor_class
from minivllm.executor.abstract import Executor
from minivllm.kv_cache_interface import get_num_blocks
from minivllm.request import Request, RequestStatus

if TYPE_CHECKING:
    from minivllm.outputs import ModelRunnerOutput, RequestOutput


# At most this many blocks when the pool is sized from memory (a 1 GiB budget holds ~10^5 blocks of "tiny").
MAX_DEFAULT_BLOCKS = 8192


class StepObserver(Protocol):
    """Watches engine steps (see the module docstring for when each hook runs). Observers must not change state."""

    def on_schedule(self, engine_core: "EngineCore", scheduler_output: SchedulerOutput) -> None: ...

    def on_step_end(self, engine_core: "EngineCore", engine_core_outputs: EngineCoreOutputs,
                    request_outputs: List["RequestOutput"]) -> None: ...


class EngineCore:
    """Owns the executor, the KV cache manager and the scheduler; runs steps.

    Args:
        vllm_config: the config from ``EngineArgs.create_engine_config()``; ``cache_config.num_gpu_blocks`` (and
            a defaulted ``max_model_len``) are set here once the workers have measured their memory.
        model: minivllm only: a ``LlamaForCausalLM`` already built, which the executor's worker takes instead of
            loading (one device only).
        kv_connector: minivllm only: the ``KVConnectorBase`` object (its scheduler side here, its worker side in
            the worker); vLLM builds it from ``kv_transfer_config``, which here only names it.

    Raises:
        ValueError: when the KV pool cannot hold one request of ``max_model_len`` tokens; the executor's
            workers are stopped first.
    """

    def __init__(self, vllm_config: VllmConfig, model: Any = None, kv_connector: Any = None) -> None:
        self.vllm_config = vllm_config
        self.kv_connector = kv_connector
        executor_class = get_executor_class(vllm_config)
        self.model_executor: Executor = executor_class(vllm_config, model=model, kv_connector=kv_connector)
        try:
            num_gpu_blocks = self._initialize_kv_caches(vllm_config)
        except BaseException:
            self.model_executor.shutdown()
            raise
        cache, sched = vllm_config.cache_config, vllm_config.scheduler_config
        self.kv_cache_manager = KVCacheManager(num_gpu_blocks, cache.block_size, sched.max_model_len,
                                               cache.enable_prefix_caching, sched.watermark)
        scheduler_cls = sched.scheduler_cls or (AsyncScheduler if sched.async_scheduling else Scheduler)
        self.scheduler: Scheduler = scheduler_cls(sched, self.kv_cache_manager, kv_connector)
        self.step_observers: List[StepObserver] = []
        # Steps scheduled and run whose output is not processed yet (async scheduling; vLLM's batch_queue).
        self.batch_queue_size = 2 if sched.async_scheduling else 1
        self.batch_queue: Deque[Tuple[SchedulerOutput, "ModelRunnerOutput"]] = deque()

    def _initialize_kv_caches(self, vllm_config: VllmConfig) -> int:
        """Size the KV pool and have every worker allocate it (vLLM ``EngineCore._initialize_kv_caches``).

        The block count is ``num_gpu_blocks`` when the user gave it (vLLM's ``num_gpu_blocks_override``), else
        what fits in the smallest worker's available memory (``get_num_blocks``), at most 8192 blocks (minivllm's
        cap, so that a 1 GiB CPU budget for a tiny model does not allocate a huge table). A ``max_model_len`` the
        user left unset is capped at the pool's capacity; one they set must fit.

        Raises:
            ValueError: when the pool cannot hold one request of ``max_model_len`` tokens (vLLM:
                ``check_enough_kv_cache_memory``) or no block fits at all.
        """
        cache, sched = vllm_config.cache_config, vllm_config.scheduler_config
        num_gpu_blocks = cache.num_gpu_blocks
        if num_gpu_blocks is None:
            specs = self.model_executor.get_kv_cache_specs()
            available = self.model_executor.determine_available_memory()
            num_gpu_blocks = min(min(get_num_blocks(m, spec) for m, spec in zip(available, specs)),
                                 MAX_DEFAULT_BLOCKS)
            if num_gpu_blocks < 1:
                raise ValueError(f"no KV cache block fits in {min(available)} bytes (one block of all layers "
                                 f"needs {specs[0].page_size_bytes * specs[0].num_layers}): raise "
                                 "kv_cache_memory_bytes or gpu_memory_utilization")
        capacity = num_gpu_blocks * cache.block_size
        if sched.max_model_len > capacity:
            if vllm_config.model_config.max_model_len is not None:
                raise ValueError(max_model_len_error(num_gpu_blocks, cache.block_size, sched.max_model_len))
            sched.max_model_len = capacity
        cache.num_gpu_blocks = num_gpu_blocks
        self.model_executor.initialize_from_config(num_gpu_blocks)
        return num_gpu_blocks

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def shutdown(self) -> None:
        """Stop the executor's workers (vLLM ``EngineCore.shutdown``); idempotent."""
        self.model_executor.shutdown()

    def abort_requests(self, request_ids: Iterable[str]) -> List[Request]:
        """Abort requests wherever they are; unknown or finished ids are ignored. Returns the ones aborted."""
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: Iterable[str], finished_status: RequestStatus) -> List[Request]:
        """Finish requests from outside the step, through the scheduler (their blocks return to the pool).

        Where minivllm differs from vLLM: vLLM aborts a request that a stop string ended (its core sees
        ``FINISHED_ABORTED``, the caller ``"stop"``); minivllm finishes it as ``FINISHED_STOPPED`` so that the
        core's view (the KV connector's ``request_finished``, step observers) agrees with the caller's.
        """
        return self.scheduler.finish_requests(list(request_ids), finished_status)

    def step(self) -> EngineCoreOutputs:
        """Schedule, run the model, update the requests (vLLM ``EngineCore.step``); under async scheduling,
        ``step_with_batch_queue``."""
        if self.batch_queue_size > 1:
            return self.step_with_batch_queue()
        scheduler_output = self._schedule()
        model_output = self._execute(scheduler_output)
        return EngineCoreOutputs(self.scheduler.update_from_output(scheduler_output, model_output),
                                 self.scheduler.make_stats())

    def step_with_batch_queue(self) -> EngineCoreOutputs:
        """vLLM ``EngineCore.step_with_batch_queue`` (v0.32.0): while the queue has room and requests remain,
        schedule and run a step and return without output; otherwise process the oldest step in the queue. The
        outputs returned belong to that older step."""
        queue = self.batch_queue
        if self.scheduler.has_unfinished_requests():
            scheduler_output = self._schedule()
            queue.appendleft((scheduler_output, self._execute(scheduler_output)))
            executed = scheduler_output.total_num_scheduled_tokens > 0
            if len(queue) < self.batch_queue_size and (executed or self.scheduler.has_unfinished_requests()):
                return EngineCoreOutputs([], self.scheduler.make_stats())
        elif not queue:
            return EngineCoreOutputs([])
        outputs = self.scheduler.update_from_output(*queue.pop())
        while queue and not self.scheduler.has_unfinished_requests():
            # Nothing left to schedule: the step still queued holds finished requests only; process it now so
            # that no step is left behind (vLLM's busy loop would do so at once).
            outputs += self.scheduler.update_from_output(*queue.pop())
        return EngineCoreOutputs(outputs, self.scheduler.make_stats())

    def _execute(self, scheduler_output: SchedulerOutput) -> "ModelRunnerOutput":
        """vLLM 0.32's two calls: ``execute_model`` (the forward pass), then, unless it returned the step's output
        already (a step with no token), ``sample_tokens``. vLLM passes it the structured-output bitmask
        (``scheduler.get_grammar_bitmask``); minivllm has no structured output."""
        model_output = self.model_executor.execute_model(scheduler_output)
        if model_output is None:
            model_output = self.model_executor.sample_tokens(None)
        return model_output

    def _schedule(self) -> SchedulerOutput:
        scheduler_output = self.scheduler.schedule()
        for observer in self.step_observers:
            observer.on_schedule(self, scheduler_output)
        return scheduler_output
