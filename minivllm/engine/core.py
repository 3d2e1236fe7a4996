"""The engine core: scheduler + model runner, one step at a time (vLLM: ``vllm/v1/engine/core.py``).

``EngineCore.step()`` is vLLM's: ``schedule()`` -> ``execute_model()`` -> ``update_from_output()``. It knows
nothing of text: detokenization and stop strings happen in the ``OutputProcessor``, above it.

Where minivllm differs from vLLM:

* Everything runs in one process. vLLM's ``LLMEngine`` talks to the core through an ``EngineCoreClient`` (in
  process, or over ZMQ to a busy-looping ``EngineCoreProc``); minivllm calls ``EngineCore`` directly, because the
  course steps it by hand and inspects its scheduler and KV cache between steps.
* ``model_executor`` is the ``ModelRunner`` itself: vLLM's executor -> worker -> model runner chain collapses to
  its last link on one device. With ``tensor_parallel_size > 1`` it is an executor (``minivllm/executor/``):
  ``MultiprocExecutor`` (worker processes that the engine starts) or ``ExecutorWithExternalLauncher`` (under
  ``torchrun``); the scheduler still runs here, once.
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

from minivllm.config import VllmConfig
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.sched.output import SchedulerOutput
from minivllm.core.sched.async_scheduler import AsyncScheduler
from minivllm.core.sched.scheduler import Scheduler
from minivllm.engine import EngineCoreOutputs
from minivllm.request import Request, RequestStatus

if TYPE_CHECKING:
    from minivllm.outputs import ModelRunnerOutput, RequestOutput


class StepObserver(Protocol):
    """Watches engine steps (see the module docstring for when each hook runs). Observers must not change state."""

    def on_schedule(self, engine_core: "EngineCore", scheduler_output: SchedulerOutput) -> None: ...

    def on_step_end(self, engine_core: "EngineCore", engine_core_outputs: EngineCoreOutputs,
                    request_outputs: List["RequestOutput"]) -> None: ...


class EngineCore:
    """Owns the KV cache manager, the scheduler and the model runner; runs steps.

    Args:
        vllm_config: the resolved config (``EngineArgs.create_engine_config()``).
    """

    def __init__(self, vllm_config: VllmConfig) -> None:
        from minivllm.worker.model_runner import ModelRunner
        from minivllm.worker.v2.model_runner import ModelRunnerV2

        cache, sched = vllm_config.cache_config, vllm_config.scheduler_config
        num_gpu_blocks = cache.num_gpu_blocks
        assert num_gpu_blocks is not None  # resolved by EngineArgs.create_engine_config
        self.vllm_config = vllm_config
        self.kv_cache_manager = KVCacheManager(num_gpu_blocks, cache.block_size, sched.max_model_len,
                                               cache.enable_prefix_caching)
        scheduler_cls = AsyncScheduler if sched.async_scheduling else Scheduler
        self.scheduler = scheduler_cls(sched, self.kv_cache_manager, vllm_config.kv_connector)
        parallel = vllm_config.parallel_config
        # A ModelRunner (one device) or an executor: all three have execute_model(scheduler_output).
        self.model_executor: Any
        if parallel.tensor_parallel_size > 1 and parallel.distributed_executor_backend == "external_launcher":
            from minivllm.executor.external_launcher import ExecutorWithExternalLauncher
            self.model_executor = ExecutorWithExternalLauncher(vllm_config)
        elif parallel.tensor_parallel_size > 1:
            from minivllm.executor.multiproc_executor import MultiprocExecutor
            self.model_executor = MultiprocExecutor(vllm_config)
        else:
            runner_cls = ModelRunnerV2 if sched.use_v2_model_runner else ModelRunner
            self.model_executor = runner_cls(vllm_config.model, num_gpu_blocks, cache.block_size, vllm_config.device,
                                              vllm_config.seed, vllm_config.kv_connector,
                                              vllm_config.attention_backend, vllm_config.enforce_eager)
        self.step_observers: List[StepObserver] = []
        # Steps scheduled and run whose output is not processed yet (async scheduling; vLLM's batch_queue).
        self.batch_queue_size = 2 if sched.async_scheduling else 1
        self.batch_queue: Deque[Tuple[SchedulerOutput, "ModelRunnerOutput"]] = deque()

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (vLLM ``EngineCore.shutdown``); idempotent. A single-device
        engine has nothing to stop."""
        shutdown = getattr(self.model_executor, "shutdown", None)
        if shutdown is not None:
            shutdown()

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
        model_output = self.model_executor.execute_model(scheduler_output)
        return EngineCoreOutputs(self.scheduler.update_from_output(scheduler_output, model_output))

    def step_with_batch_queue(self) -> EngineCoreOutputs:
        """vLLM ``EngineCore.step_with_batch_queue`` (v0.32.0): while the queue has room and requests remain,
        schedule and run a step and return without output; otherwise process the oldest step in the queue. The
        outputs returned belong to that older step."""
        queue = self.batch_queue
        if self.scheduler.has_unfinished_requests():
            scheduler_output = self._schedule()
            queue.appendleft((scheduler_output, self.model_executor.execute_model(scheduler_output)))
            executed = scheduler_output.total_num_scheduled_tokens > 0
            if len(queue) < self.batch_queue_size and (executed or self.scheduler.has_unfinished_requests()):
                return EngineCoreOutputs([])
        elif not queue:
            return EngineCoreOutputs([])
        outputs = self.scheduler.update_from_output(*queue.pop())
        while queue and not self.scheduler.has_unfinished_requests():
            # Nothing left to schedule: the step still queued holds finished requests only; process it now so
            # that no step is left behind (vLLM's busy loop would do so at once).
            outputs += self.scheduler.update_from_output(*queue.pop())
        return EngineCoreOutputs(outputs)

    def _schedule(self) -> SchedulerOutput:
        scheduler_output = self.scheduler.schedule()
        for observer in self.step_observers:
            observer.on_schedule(self, scheduler_output)
        return scheduler_output
