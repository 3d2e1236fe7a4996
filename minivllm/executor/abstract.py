"""The executor: how the engine core reaches its workers, whatever their number (vLLM 0.32:
``vllm/v1/executor/abstract.py``, ``Executor``).

The engine core talks to one executor and never to a worker or a model runner. Three executors, as in vLLM:

* ``UniProcExecutor`` (``distributed_executor_backend="uni"``, the default for one device): one ``Worker`` in the
  engine's own process (``uniproc_executor.py``);
* ``ExecutorWithExternalLauncher`` (``"external_launcher"``): its subclass for a process that ``torchrun`` started,
  one rank per process (``uniproc_executor.py`` in vLLM too);
* ``MultiprocExecutor`` (``"mp"``, the default for ``tensor_parallel_size > 1``): one worker process per rank
  (``multiproc_executor.py``).

A step is two calls, as in vLLM 0.32: ``execute_model`` runs the forward pass on every worker and returns ``None``
(or, for a step that schedules no token, its output at once); ``sample_tokens`` then samples on every worker and
returns the driver's ``ModelRunnerOutput``. vLLM computes the structured-output bitmask between the two and passes
it to ``sample_tokens``; minivllm has no structured output and passes ``None``. Where minivllm differs from vLLM:
the calls block (vLLM's ``non_block=True`` returns a future, so that the scheduler works while the model runs).
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Union

from minivllm.config import VllmConfig
from minivllm.core.sched.output import SchedulerOutput
from minivllm.kv_cache_interface import FullAttentionSpec
from minivllm.outputs import ModelRunnerOutput


class Executor:
    """The calls every executor answers; the subclasses say how they reach their workers (``collective_rpc``).

    Args:
        vllm_config: the engine's config; sent to the workers as it is.
        model, kv_connector: minivllm only: a built ``LlamaForCausalLM`` and a ``KVConnectorBase`` object handed
            to the engine, for the worker in this process (``UniProcExecutor``); objects, so never in the config.
    """

    def __init__(self, vllm_config: VllmConfig, model: Any = None, kv_connector: Any = None) -> None:
        self.vllm_config = vllm_config
        self.model, self.kv_connector = model, kv_connector
        self._init_executor()

    def _init_executor(self) -> None:
        """Start the workers, and have each init its device and load its model."""
        raise NotImplementedError

    def collective_rpc(self, method: Union[str, Callable], args: Sequence[Any] = (),
                       unique_reply_rank: Optional[int] = None, **kwargs: Any) -> Any:
        """Run ``method`` on every worker: a ``Worker`` method name, or a module-level function called as
        ``method(worker, *args)``. Returns the list of the workers' results, or only ``unique_reply_rank``'s."""
        raise NotImplementedError

    def determine_available_memory(self) -> List[int]:
        """Each worker's bytes for its KV cache (``Worker.determine_available_memory``)."""
        return self.collective_rpc("determine_available_memory")

    def get_kv_cache_specs(self) -> List[FullAttentionSpec]:
        return self.collective_rpc("get_kv_cache_spec")

    def initialize_from_config(self, num_gpu_blocks: int) -> None:
        """Allocate every worker's KV cache, then capture its CUDA graphs (vLLM ``initialize_from_config`` then
        ``compile_or_warm_up_model``)."""
        self.collective_rpc("initialize_from_config", (num_gpu_blocks,))
        self.collective_rpc("compile_or_warm_up_model")

    def execute_model(self, scheduler_output: SchedulerOutput) -> Optional[ModelRunnerOutput]:
        """Run one step's forward pass on every worker; the driver's (rank 0's) reply comes back: ``None``, or
        the output of a step that scheduled no token."""
        return self.collective_rpc("execute_model", (scheduler_output,), unique_reply_rank=0)

    def sample_tokens(self, grammar_output: None = None) -> ModelRunnerOutput:
        """Sample the step on every worker (each keeps its request states); the driver's output comes back."""
        return self.collective_rpc("sample_tokens", (grammar_output,), unique_reply_rank=0)

    def shutdown(self) -> None:
        """Stop the workers; idempotent."""
