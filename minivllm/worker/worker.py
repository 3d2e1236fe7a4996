"""One device's worker: its device, its share of the model, its KV cache, its model runner (vLLM 0.32:
``vllm/v1/worker/gpu_worker.py``, ``Worker``; ``cpu_worker.py`` on the CPU).

Every executor drives its workers through the same calls, in vLLM's order (``EngineCore.__init__`` and
``EngineCore._initialize_kv_caches``)::

    init_device()                  join the tensor-parallel group when there is one
    load_model()                   the one place the weights are loaded; the V1 or V2 runner is chosen here, once
    determine_available_memory()   bytes this device may give the KV cache
    get_kv_cache_spec()            what one block of this rank's cache holds (its page size)
    initialize_from_config(n)      allocate n blocks per layer (the engine took the minimum over the ranks)
    compile_or_warm_up_model()     set up CUDA-graph replay of decode steps, at start-up
    execute_model(scheduler_output)  once a step: the forward pass (returns None, or an empty step's output)
    sample_tokens(None)              then: sample the step (vLLM 0.32 passes the structured-output bitmask here)

Under tensor parallelism every rank receives the same ``SchedulerOutput`` each step and runs the same step; the
collectives inside the layers keep them in lockstep, and every rank samples the same tokens (the logits are
gathered to all ranks, and the generators are seeded alike), so the runners' request states agree without
messages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from minivllm.config import VllmConfig
from minivllm.core.sched.output import SchedulerOutput
from minivllm.distributed import parallel_state
from minivllm.kv_cache_interface import FullAttentionSpec
from minivllm.outputs import ModelRunnerOutput

if TYPE_CHECKING:
    from minivllm.worker.cpu_threads import CpuThreadGovernor
    from minivllm.worker.model_runner import ModelRunner

# The KV budget on the CPU when ``kv_cache_memory_bytes`` is not given (vLLM's CPU worker returns
# ``VLLM_CPU_KVCACHE_SPACE`` from ``determine_available_memory`` the same way).
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


class Worker:
    """Rank ``rank`` of ``vllm_config.parallel_config.tensor_parallel_size`` (rank 0 of 1 on one device).

    Args:
        vllm_config: the engine's config, as the engine has it (``model_config`` and ``load_config`` say what to
            load).
        rank: this worker's rank; local_rank: its CUDA device on its machine (CPU: unused).
        distributed_init_method: the rendezvous, ``"tcp://host:port"`` or ``"env://"`` (``torchrun``); ``None``
            for one device, where no process group is made.
        model: minivllm only: a ``LlamaForCausalLM`` handed to the engine built (notebooks share one model between
            engines); used instead of loading.
        kv_connector: minivllm only: the engine's ``KVConnectorBase`` object, whose worker side the runner calls.
    """

    def __init__(self, vllm_config: VllmConfig, rank: int = 0, local_rank: int = 0,
                 distributed_init_method: Optional[str] = None, model: Any = None, kv_connector: Any = None) -> None:
        self.vllm_config = vllm_config
        self.given_model, self.kv_connector = model, kv_connector
        self.rank, self.local_rank = rank, local_rank
        self.distributed_init_method = distributed_init_method
        self.model_runner: Optional["ModelRunner"] = None
        self.device: Optional[torch.device] = None
        self._distributed = False
        self.cpu_threads: Optional["CpuThreadGovernor"] = None

    def init_device(self) -> None:
        """Pick the device; with a rendezvous, join the process group (gloo on the CPU, NCCL on CUDA) and make it
        the tensor-parallel group."""
        dev = torch.device(self.vllm_config.device)
        if dev.type == "cuda":
            self.device = torch.device("cuda", self.local_rank if self.distributed_init_method else (dev.index or 0))
            torch.cuda.set_device(self.device)
        else:
            self.device = dev
        if self.distributed_init_method is not None:
            n = self.vllm_config.parallel_config.tensor_parallel_size
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            parallel_state.init_distributed_environment(n, self.rank, self.distributed_init_method, backend,
                                                        self.local_rank)
            parallel_state.initialize_model_parallel(n)
            self._distributed = True

    def load_model(self) -> None:
        """Load this rank's share of the weights (the loaders shard at load time) and build the model runner over
        it: V1 (``ModelRunner``) or V2 (``ModelRunnerV2``), as ``scheduler_config.use_v2_model_runner`` says."""
        from minivllm.model.loader import get_model
        from minivllm.worker.model_runner import ModelRunner
        from minivllm.worker.v2.model_runner import ModelRunnerV2

        cfg = self.vllm_config
        assert self.device is not None, "init_device() first"
        mc = cfg.model_config
        if self.given_model is not None:
            model = self.given_model.to(self.device)
        else:
            model = get_model(mc, cfg.load_config, self.device, mc.dtype)
        runner_cls = ModelRunnerV2 if cfg.scheduler_config.use_v2_model_runner else ModelRunner
        # No CUDA graphs across ranks: capturing NCCL collectives in minivllm's decode graphs is untested (vLLM
        # captures them; this course has had no multi-GPU machine to check it on).
        enforce_eager = cfg.enforce_eager or cfg.parallel_config.tensor_parallel_size > 1
        connector = self.kv_connector if cfg.parallel_config.tensor_parallel_size == 1 else None
        self.model_runner = runner_cls(model, None, cfg.cache_config.block_size, self.device, cfg.seed, connector,
                                       cfg.attention_backend, enforce_eager)
        if self.device.type == "cpu" and self.distributed_init_method is None:
            from minivllm.worker.cpu_threads import governor_for_this_process

            self.cpu_threads = governor_for_this_process()

    def determine_available_memory(self) -> int:
        """Bytes this worker may give its KV cache (vLLM ``Worker.determine_available_memory``).

        * ``kv_cache_memory_bytes`` when set (on CUDA too, as vLLM's ``kv_cache_memory_bytes``);
        * on the CPU, else 1 GiB (vLLM's CPU worker: ``VLLM_CPU_KVCACHE_SPACE``);
        * on CUDA, else ``total x gpu_memory_utilization - memory in use now`` (weights loaded, measured with
          ``torch.cuda.mem_get_info``, other processes' use included). Where minivllm differs from vLLM: vLLM
          also runs a profile forward pass of ``max_num_batched_tokens`` and subtracts its activation peak;
          minivllm leaves the headroom above ``gpu_memory_utilization`` to the activations.

        Raises:
            ValueError: on CUDA, when the weights already use more than ``gpu_memory_utilization`` allows.
        """
        cache = self.vllm_config.cache_config
        if cache.kv_cache_memory_bytes is not None:
            return int(cache.kv_cache_memory_bytes)
        assert self.device is not None, "init_device() first"
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_CACHE_BYTES
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        available = int(total * cache.gpu_memory_utilization) - (total - free)
        if available <= 0:
            raise ValueError(
                f"gpu_memory_utilization ({cache.gpu_memory_utilization}) leaves no memory for the KV cache: "
                f"{(total - free) / 2**30:.2f} GiB of {total / 2**30:.2f} GiB are in use after loading the model; "
                "raise gpu_memory_utilization or set kv_cache_memory_bytes")
        return available

    def get_kv_cache_spec(self) -> FullAttentionSpec:
        """One block of this rank's cache: its own KV heads only under tensor parallelism."""
        assert self.model_runner is not None, "load_model() first"
        return self.model_runner.get_kv_cache_spec()

    def initialize_from_config(self, num_gpu_blocks: int) -> None:
        """Allocate ``num_gpu_blocks`` blocks per layer (vLLM ``Worker.initialize_from_config``)."""
        assert self.model_runner is not None, "load_model() first"
        self.model_runner.initialize_kv_cache(num_gpu_blocks)

    def compile_or_warm_up_model(self) -> None:
        """Set up CUDA-graph replay of decode steps of up to ``max_num_seqs`` requests, at start-up, when the
        runner will replay graphs (vLLM ``Worker.compile_or_warm_up_model`` -> ``capture_model``); nothing to do
        on the CPU. Unlike vLLM, which captures every batch size here, each graph is captured the first time its
        (batch, block-table width) bucket runs: ``ModelRunnerBase.capture_model`` says why."""
        assert self.model_runner is not None, "load_model() first"
        self.model_runner.capture_model(self.vllm_config.scheduler_config.max_num_seqs)

    def execute_model(self, scheduler_output: SchedulerOutput) -> Optional[ModelRunnerOutput]:
        """The step's forward pass (``ModelRunnerBase.execute_model``): ``None``, or an empty step's output. On the
        CPU of one process, the step's thread count first follows the machine's load (``cpu_threads``)."""
        assert self.model_runner is not None, "load_model() first"
        if self.cpu_threads is not None:
            self.cpu_threads.update()
        try:
            output = self.model_runner.execute_model(scheduler_output)
        except BaseException:
            # A step that raised has ended too: without the mark, the governor would count the pause after it as
            # time spent stepping.
            if self.cpu_threads is not None:
                self.cpu_threads.step_done()
            raise
        if output is not None and self.cpu_threads is not None:
            self.cpu_threads.step_done()
        return output

    def sample_tokens(self, grammar_output: None = None) -> ModelRunnerOutput:
        """Sample the step ``execute_model`` ran (``ModelRunnerBase.sample_tokens``)."""
        assert self.model_runner is not None, "load_model() first"
        try:
            return self.model_runner.sample_tokens(grammar_output)
        finally:
            if self.cpu_threads is not None:
                self.cpu_threads.step_done()

    def shutdown(self) -> None:
        if self.cpu_threads is not None:
            self.cpu_threads.close()
            self.cpu_threads = None
        if self._distributed:
            parallel_state.destroy_model_parallel()
            self._distributed = False


