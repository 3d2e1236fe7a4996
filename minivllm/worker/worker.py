"""One tensor-parallel rank: its device, its share of the model, its model runner (vLLM:
``vllm/v1/worker/gpu_worker.py``, ``Worker``; ``cpu_worker.py`` on the CPU).

A worker joins the ``torch.distributed`` group, loads its rank's share of the weights (the loaders shard at load
time), and builds the same ``ModelRunner`` as a single-device engine, whose KV cache then holds only this rank's
KV heads. Every rank receives the same ``SchedulerOutput`` each step and runs the same step; the collectives
inside the layers keep them in lockstep, and every rank samples the same tokens (the logits are gathered to all
ranks, and the generators are seeded alike), so the runners' request states agree without messages.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from minivllm.config import VllmConfig
from minivllm.core.sched.output import SchedulerOutput
from minivllm.distributed import parallel_state
from minivllm.outputs import ModelRunnerOutput


class Worker:
    """Rank ``rank`` of ``vllm_config.parallel_config.tensor_parallel_size``.

    Args:
        vllm_config: the engine's config; its ``model_config`` and ``load_config`` say what to load.
        rank: this process's rank; local_rank: its CUDA device on its machine (CPU: unused).
        distributed_init_method: the rendezvous, ``"tcp://host:port"`` or ``"env://"`` (``torchrun``).
    """

    def __init__(self, vllm_config: VllmConfig, rank: int, local_rank: int = 0,
                 distributed_init_method: str = "env://") -> None:
        self.vllm_config = vllm_config
        self.rank, self.local_rank = rank, local_rank
        self.distributed_init_method = distributed_init_method
        self.model_runner = None
        self.device: Optional[torch.device] = None

    def init_device(self) -> None:
        """Join the process group (gloo on the CPU, NCCL on CUDA) and make it the tensor-parallel group."""
        n = self.vllm_config.parallel_config.tensor_parallel_size
        dev = torch.device(self.vllm_config.device)
        self.device = torch.device("cuda", self.local_rank) if dev.type == "cuda" else dev
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        parallel_state.init_distributed_environment(n, self.rank, self.distributed_init_method, backend,
                                                    self.local_rank)
        parallel_state.initialize_model_parallel(n)

    def load_model(self) -> None:
        """Load this rank's share of the weights and build the model runner over it."""
        from minivllm.model.loader import get_model
        from minivllm.worker.model_runner import ModelRunner
        from minivllm.worker.v2.model_runner import ModelRunnerV2

        cfg = self.vllm_config
        model = get_model(cfg.model_config, cfg.load_config, self.device, cfg.dtype)
        runner_cls = ModelRunnerV2 if cfg.scheduler_config.use_v2_model_runner else ModelRunner
        # No CUDA graphs across ranks: capturing NCCL collectives in minivllm's decode graphs is untested (vLLM
        # captures them; this course has had no multi-GPU machine to check it on).
        enforce_eager = cfg.enforce_eager or cfg.parallel_config.tensor_parallel_size > 1
        self.model_runner = runner_cls(model, cfg.cache_config.num_gpu_blocks, cfg.cache_config.block_size,
                                       self.device, cfg.seed, None, cfg.attention_backend, enforce_eager)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        parallel_state.destroy_model_parallel()


def config_for_worker(vllm_config: VllmConfig) -> VllmConfig:
    """``vllm_config`` without what stays in the engine process (the tokenizer), for pickling to a worker."""
    return dataclasses.replace(vllm_config, tokenizer=None, model=None)
