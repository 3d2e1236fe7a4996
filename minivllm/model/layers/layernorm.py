"""RMSNorm (vLLM: ``vllm/model_executor/layers/layernorm.py``)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from minivllm import custom_ops
from minivllm.model.custom_op import CustomOp, no_kernel_for


class RMSNorm(CustomOp):
    """``x / sqrt(mean(x^2) + eps) * weight``, computed in float32 (Zhang & Sennrich 2019).

    ``forward(x)`` returns the normalised ``x [T, hidden]``. ``forward(x, residual)`` first adds ``x`` to the
    residual stream and returns ``(norm(x + residual), x + residual)``, as vLLM's ``RMSNorm`` does: in bfloat16 on
    the CPU both run as one kernel (``minivllm.custom_ops``, ``forward_cpu``, chosen once: ``CustomOp``), which
    then overwrites ``x`` and ``residual`` with the results.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward_native(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """The PyTorch formula (the kernels are checked against it): ``x [..., hidden]``, same dtype out."""
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def forward_cpu(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if x.dim() != 2 or no_kernel_for(x, self.kernel_dtype) or self.weight.dtype != x.dtype:
            return self.forward_native(x, residual)
        if residual is None:
            return custom_ops.rms_norm(x, self.weight, self.eps)
        custom_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return x, residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight.float()).to(dtype)
