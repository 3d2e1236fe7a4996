"""One rank of a ``torchrun`` job (vLLM: ``vllm/v1/executor/uniproc_executor.py``,
``ExecutorWithExternalLauncher``; ``distributed_executor_backend="external_launcher"``).

``torchrun`` starts N copies of the same script, on one machine or several. Each builds the whole engine
(tokenizer, scheduler, KV cache manager) and this executor, which runs rank ``RANK``'s worker in the same process.
Every rank schedules the same requests in the same order, so the schedulers agree without messages, and every
rank returns the same tokens (vLLM's contract for this backend: the script must be deterministic across ranks).
Two machines, one rank each (``MASTER_ADDR`` = the first machine's address)::

    # machine A                                                   # machine B
    torchrun --nnodes=2 --node-rank=0 --nproc-per-node=1 \\       torchrun --nnodes=2 --node-rank=1 ... (same)
        --master-addr=A --master-port=29500 -m minivllm.entrypoints.torchrun_generate --model tiny-tp \
        --tensor-parallel-size 2

(SmolLM2-135M, the default model, needs 3 ranks: ``--nnodes=3``, ``--tensor-parallel-size 3``.)
"""

from __future__ import annotations

from minivllm.config import VllmConfig
from minivllm.core.sched.output import SchedulerOutput
from minivllm.distributed import parallel_state
from minivllm.outputs import ModelRunnerOutput
from minivllm.worker.worker import Worker


class ExecutorWithExternalLauncher:
    """Runs this process's rank in-process; the rendezvous comes from ``torchrun``'s environment (``env://``).

    Raises:
        RuntimeError: when the process was not started by ``torchrun`` (no ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``)
            or ``WORLD_SIZE`` differs from ``tensor_parallel_size``.
    """

    def __init__(self, vllm_config: VllmConfig) -> None:
        env = parallel_state.torchrun_env()
        n = vllm_config.parallel_config.tensor_parallel_size
        if env is None:
            raise RuntimeError("distributed_executor_backend='external_launcher' needs a process started by torchrun "
                               "(RANK, WORLD_SIZE and MASTER_ADDR are unset)")
        world_size, rank, local_rank = env
        if world_size != n:
            raise RuntimeError(f"tensor_parallel_size ({n}) must equal torchrun's WORLD_SIZE ({world_size})")
        self.rank = rank
        self.worker = Worker(vllm_config, rank, local_rank, "env://")
        self.worker.init_device()
        self.worker.load_model()
        self.model_runner = self.worker.model_runner

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        self.worker.shutdown()
