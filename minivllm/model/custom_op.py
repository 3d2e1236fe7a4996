"""A layer with one PyTorch implementation and per-platform kernels, chosen once (vLLM:
``vllm/model_executor/custom_op.py``, ``CustomOp``).

``RMSNorm``, ``SiluAndMul`` and ``RotaryEmbedding`` derive from ``CustomOp``. Each writes ``forward_native`` (the
PyTorch formula, the reference the kernels are tested against) and, where minivllm has a kernel,
``forward_cpu``; ``forward`` calls whichever ``dispatch_forward`` chose, so no call asks the environment or the
kernel library again.

Where minivllm differs from vLLM: vLLM chooses in ``__init__`` from the process-wide platform and compilation
config. Here a model is built before its device and dtype are known, and one model object can serve several
engines in one process (notebook 09 runs the same model with ``MINIVLLM_CPU_KERNELS=1`` and then ``0``). So a
layer starts on ``forward_native`` and the choice is re-made for the whole model by
``LlamaForCausalLM.set_custom_op_dispatch``: by the loader once the weights are in their dtype and on their
device, and by the model runner when it is built (as it does for the attention backend).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn


class CustomOp(nn.Module):
    """Base class: subclasses implement ``forward_native`` and may override ``forward_cpu`` / ``forward_cuda``
    (both default to ``forward_native``). A ``forward_cpu`` may still fall back to ``forward_native`` for inputs
    its kernel does not take (a layout, a dtype other than ``kernel_dtype``, autograd); it never reads the
    environment."""

    def __init__(self) -> None:
        super().__init__()
        self._forward_method: Callable[..., Any] = self.forward_native
        self.kernel_dtype = torch.bfloat16  # the dtype forward_cpu hands to a kernel (set_dispatch)

    def forward(self, *args, **kwargs):
        return self._forward_method(*args, **kwargs)

    def forward_native(self, *args, **kwargs):
        """The PyTorch implementation, on every device and dtype."""
        raise NotImplementedError

    def forward_cpu(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    def forward_cuda(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    def dispatch_forward(self, device_type: str, use_cpu_kernels: bool) -> Callable[..., Any]:
        """The implementation for a model on ``device_type`` (``"cpu"``, ``"cuda"``, ...): ``forward_cuda`` on
        CUDA, ``forward_cpu`` on the CPU when ``use_cpu_kernels`` (see ``minivllm.custom_ops.use_cpu_kernels``),
        else ``forward_native``."""
        if device_type == "cuda":
            return self.forward_cuda
        if device_type == "cpu" and use_cpu_kernels:
            return self.forward_cpu
        return self.forward_native

    def set_dispatch(self, device_type: str, use_cpu_kernels: bool, kernel_dtype: torch.dtype = torch.bfloat16) -> None:
        """Make ``forward`` call ``dispatch_forward(device_type, use_cpu_kernels)`` from now on; ``forward_cpu``
        gives its kernel inputs of ``kernel_dtype`` only (the model's dtype: bfloat16, or float32 under
        ``MINIVLLM_CPU_KERNELS_FP32=1``) and computes any other dtype with ``forward_native``."""
        self._forward_method = self.dispatch_forward(device_type, use_cpu_kernels)
        self.kernel_dtype = kernel_dtype

    @property
    def forward_method_name(self) -> str:
        """``"forward_native"``, ``"forward_cpu"`` or ``"forward_cuda"``: what ``forward`` runs now."""
        return self._forward_method.__name__


def no_kernel_for(x: torch.Tensor, kernel_dtype: torch.dtype = torch.bfloat16) -> bool:
    """True when a CPU kernel must not take ``x`` whatever the dispatch: not ``kernel_dtype`` (the layer's, set
    with its dispatch: float32 stays on PyTorch, the exact reference, under ``MINIVLLM_CPU_KERNELS_FP32=0``) or not
    on the CPU, or autograd is recording (the kernels have no backward)."""
    return x.dtype != kernel_dtype or x.device.type != "cpu" or torch.is_grad_enabled()
