"""Choosing the attention backend, once per model runner (vLLM: ``vllm/v1/attention/selector.py``
``get_attn_backend``)."""

from __future__ import annotations

from typing import Dict, Optional, Type

import torch

from minivllm import custom_ops, envs
from minivllm.attention.backend import AttentionBackend
from minivllm.attention.backends.cpu_attn import CPUAttentionBackend
from minivllm.attention.backends.reference import ReferenceAttentionBackend
from minivllm.attention.backends.torch_sdpa import TorchSDPABackend

BACKENDS: Dict[str, Type[AttentionBackend]] = {
    b.get_name(): b for b in (ReferenceAttentionBackend, TorchSDPABackend, CPUAttentionBackend)
}


def get_attn_backend(device: torch.device, dtype: torch.dtype, name: Optional[str] = None) -> Type[AttentionBackend]:
    """The backend for a model on ``device`` in ``dtype``.

    Args:
        device, dtype: of the model and its KV cache.
        name: ``"REFERENCE"``, ``"TORCH_SDPA"`` or ``"CPU_ATTN"`` (any case) to choose one yourself; ``None``:
            ``CPU_ATTN`` for bfloat16 on the CPU when ``MINIVLLM_CPU_KERNELS`` is not ``0`` and the kernels build
            (float32 stays on PyTorch: it is the exact reference compared with Hugging Face), else ``TORCH_SDPA``.

    Raises:
        ValueError: an unknown ``name``, or ``CPU_ATTN`` where its kernels cannot run (not bfloat16 on the CPU,
            or not built).
    """
    device = torch.device(device)
    if name is None:
        if device.type == "cpu" and dtype == torch.bfloat16 and envs.MINIVLLM_CPU_KERNELS and custom_ops.load():
            return CPUAttentionBackend
        return TorchSDPABackend
    backend = BACKENDS.get(name.upper())
    if backend is None:
        raise ValueError(f"attention_backend must be one of {sorted(BACKENDS)} or None, got {name!r}")
    if backend is CPUAttentionBackend and not (device.type == "cpu" and dtype == torch.bfloat16 and custom_ops.load()):
        raise ValueError(f"CPU_ATTN needs bfloat16 on the CPU and built kernels, got {dtype} on {device}")
    return backend
