"""Choosing the attention backend, once per model runner (vLLM: ``vllm/v1/attention/selector.py``
``get_attn_backend``).

The engine argument ``attention_backend`` (vLLM 0.32's ``--attention-backend``, ``EngineArgs.attention_backend``,
`arg_utils.py L791 <https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/engine/arg_utils.py#L791>`_) names a
backend, or is an ``AttentionBackend`` subclass: a backend of one's own, such as a learner's (issue 26). vLLM takes
a custom class in two steps, ``register_backend(AttentionBackendEnum.CUSTOM)`` and then
``attention_backend="CUSTOM"`` (`registry.py L158
<https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/v1/attention/backends/registry.py#L158>`_, `L340
<https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/v1/attention/backends/registry.py#L340>`_); minivllm takes
the class itself, as it takes a ``scheduler_cls`` or a ``kv_connector``.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Type

import torch

from minivllm import custom_ops
from minivllm.attention.backend import AttentionBackend
from minivllm.attention.backends.cpu_attn import CPUAttentionBackend
from minivllm.attention.backends.reference import ReferenceAttentionBackend
from minivllm.attention.backends.torch_sdpa import TorchSDPABackend
from minivllm.attention.backends.triton_attn import TritonAttentionBackend, triton_attn_unavailable

BACKENDS: Dict[str, Type[AttentionBackend]] = {
    b.get_name(): b
    for b in (ReferenceAttentionBackend, TorchSDPABackend, CPUAttentionBackend, TritonAttentionBackend)
}


def check_attention_backend(value: Any) -> None:
    """Validate the ``attention_backend`` engine argument before anything is built: ``None``, a name of
    ``BACKENDS`` (any case), or a subclass of ``AttentionBackend``. Whether a named backend can run on the device
    is checked by ``get_attn_backend``, once the model runner knows its device and dtype.

    Raises:
        ValueError: naming ``attention_backend`` and the choices.
    """
    if value is None or (isinstance(value, type) and issubclass(value, AttentionBackend)):
        return
    if isinstance(value, str) and value.upper() in BACKENDS:
        return
    raise ValueError(f"attention_backend must be one of {sorted(BACKENDS)} (any case), a subclass of "
                     f"minivllm.attention.backend.AttentionBackend, or None, got {value!r}")


def get_attn_backend(device: torch.device, dtype: torch.dtype, name: Any = None,
                     head_size: Optional[int] = None) -> Type[AttentionBackend]:
    """The backend for a model on ``device`` in ``dtype``.

    Args:
        device, dtype: of the model and its KV cache.
        name: an ``AttentionBackend`` subclass, used as it is (its own kernels answer for the device and dtype);
            ``"REFERENCE"``, ``"TORCH_SDPA"``, ``"CPU_ATTN"`` or ``"TRITON_ATTN"`` (any case) to choose one
            yourself; ``None``: on CUDA ``TRITON_ATTN`` when triton imports (and the head size suits its kernels),
            (vLLM's ``vllm/platforms/cuda.py`` ``_get_backend_priorities`` puts ``FLASH_ATTN`` first and
            ``TRITON_ATTN`` after it; minivllm has no FlashAttention backend); on the CPU ``CPU_ATTN`` for
            bfloat16 and float32 when ``MINIVLLM_CPU_KERNELS`` is not ``0`` and the kernels build
            (``MINIVLLM_CPU_KERNELS_FP32=0`` keeps float32 on ``TORCH_SDPA``, the exact reference compared with
            Hugging Face); else ``TORCH_SDPA``.
        head_size: the model's head dimension, checked against the Triton kernels' limits (``None``: not checked).

    Raises:
        ValueError: ``name`` neither a known name nor an ``AttentionBackend`` subclass; ``CPU_ATTN`` where its kernels cannot run (neither bfloat16 nor float32
            on the CPU, or not built); ``TRITON_ATTN`` where its kernels cannot run, with the reason (on the CPU:
            only under ``TRITON_INTERPRET=1``, in float32 or float16).
    """
    device = torch.device(device)
    if name is None:
        if device.type == "cuda" and triton_attn_unavailable(device, dtype, head_size) is None:
            return TritonAttentionBackend
        if custom_ops.use_cpu_kernels(device, dtype):  # the same rule as the model's CustomOp layers
            return CPUAttentionBackend
        return TorchSDPABackend
    check_attention_backend(name)
    if isinstance(name, type):
        return name
    backend = BACKENDS[name.upper()]
    if backend is CPUAttentionBackend and not (
            device.type == "cpu" and dtype in (torch.bfloat16, torch.float32) and custom_ops.load()):
        raise ValueError(f"CPU_ATTN needs bfloat16 or float32 on the CPU and built kernels, got {dtype} on {device}")
    if backend is TritonAttentionBackend:
        reason = triton_attn_unavailable(device, dtype, head_size)
        if reason is not None:
            raise ValueError(f"TRITON_ATTN cannot run for {dtype} on {device}: {reason}")
    return backend
