"""One worker in the engine's own process (vLLM 0.32: ``vllm/v1/executor/uniproc_executor.py``,
``UniProcExecutor`` and ``ExecutorWithExternalLauncher``).

``UniProcExecutor`` runs one device: its ``driver_worker`` is called directly, with no process and no process
group. ``ExecutorWithExternalLauncher`` is the same executor for a process that ``torchrun`` started: the worker
joins the ``torchrun`` job's process group (``env://``) as rank ``RANK``.

Under ``torchrun``, N copies of the same script start, on one machine or several. Each builds the whole engine
(tokenizer, scheduler, KV cache manager) and this executor. Every rank schedules the same requests in the same order,
so the schedulers agree without messages, and every rank returns the same tokens (vLLM's contract for this
backend: the script must be deterministic across ranks). Two machines, one rank each (``MASTER_ADDR`` = the first
machine's address)::

    # machine A                                                   # machine B
    torchrun --nnodes=2 --node-rank=0 --nproc-per-node=1 \\       torchrun --nnodes=2 --node-rank=1 ... (same)
        --master-addr=A --master-port=29500 -m minivllm.entrypoints.torchrun_generate --model tiny-tp \\
        --tensor-parallel-size 2

(SmolLM2-135M, the default model, needs 3 ranks: ``--nnodes=3``, ``--tensor-parallel-size 3``.)
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple, Union

from minivllm.distributed import parallel_state
from minivllm.executor.abstract import Executor
from minivllm.worker.worker import Worker


class UniProcExecutor(Executor):
    """One ``Worker`` (``driver_worker``) in this process; every call is a direct call.

    Raises:
        whatever the worker raises while it loads the model (``FileNotFoundError``, ``ValueError``).
    """

    def _distributed_args(self) -> Tuple[Optional[str], int, int]:
        """``(distributed_init_method, rank, local_rank)``: no process group for one device."""
        return None, 0, 0

    def _init_executor(self) -> None:
        init_method, rank, local_rank = self._distributed_args()
        self.rank = rank
        self.driver_worker = Worker(self.vllm_config, rank, local_rank, init_method, model=self.model,
                                    kv_connector=self.kv_connector)
        self.driver_worker.init_device()
        self.driver_worker.load_model()

    def collective_rpc(self, method: Union[str, Callable], args: Sequence[Any] = (),
                       unique_reply_rank: Optional[int] = None, **kwargs: Any) -> Any:
        fn = getattr(self.driver_worker, method) if isinstance(method, str) else None
        result = fn(*args) if fn is not None else method(self.driver_worker, *args)  # type: ignore[operator]
        return result if unique_reply_rank is not None else [result]

    def execute_model(self, scheduler_output):
        return self.driver_worker.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output=None):
        return self.driver_worker.sample_tokens(grammar_output)

    def shutdown(self) -> None:
        self.driver_worker.shutdown()


class ExecutorWithExternalLauncher(UniProcExecutor):
    """This process's rank of a ``torchrun`` job; the rendezvous comes from ``torchrun``'s environment.

    Raises:
        RuntimeError: when the process was not started by ``torchrun`` (no ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``)
            or ``WORLD_SIZE`` differs from ``tensor_parallel_size``.
    """

    def _distributed_args(self) -> Tuple[Optional[str], int, int]:
        env = parallel_state.torchrun_env()
        n = self.vllm_config.parallel_config.tensor_parallel_size
        if env is None:
            raise RuntimeError("distributed_executor_backend='external_launcher' needs a process started by torchrun "
                               "(RANK, WORLD_SIZE and MASTER_ADDR are unset)")
        world_size, rank, local_rank = env
        if world_size != n:
            raise RuntimeError(f"tensor_parallel_size ({n}) must equal torchrun's WORLD_SIZE ({world_size})")
        return "env://", rank, local_rank
