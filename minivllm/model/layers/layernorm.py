"""RMSNorm (vLLM: ``vllm/model_executor/layers/layernorm.py``)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from minivllm import custom_ops


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, computed in float32 (Zhang & Sennrich 2019).

    ``forward(x)`` returns the normalised ``x [T, hidden]``. ``forward(x, residual)`` first adds ``x`` to the
    residual stream and returns ``(norm(x + residual), x + residual)``, as vLLM's ``RMSNorm`` does: in bfloat16 on
    the CPU both run as one kernel (``minivllm.custom_ops``), which then overwrites ``x`` and ``residual`` with
    the results.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if x.dim() == 2 and custom_ops.usable(x) and self.weight.dtype == x.dtype:
            if residual is None:
                return custom_ops.rms_norm(x, self.weight, self.eps)
            custom_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        if residual is None:
            return self.forward_native(x)
        residual = x + residual
        return self.forward_native(residual), residual

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """The PyTorch formula (the kernels are checked against it): ``x [..., hidden]``, same dtype out."""
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight.float()).to(dtype)
