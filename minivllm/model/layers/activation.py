"""The SwiGLU activation (vLLM: ``vllm/model_executor/layers/activation.py``, ``SiluAndMul``)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from minivllm import custom_ops


class SiluAndMul(nn.Module):
    """``silu(x[..., :d]) * x[..., d:]`` with ``d = x.shape[-1] // 2`` (Shazeer 2020, SwiGLU).

    The input is the fused ``gate_up_proj`` output: ``x [T, 2 * intermediate]`` -> ``[T, intermediate]``, same
    dtype. In bfloat16 on the CPU one kernel reads ``x`` once and writes the result (``custom_ops.silu_and_mul``)
    instead of materialising ``silu(gate)`` first.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and custom_ops.usable(x):
            return custom_ops.silu_and_mul(x)
        return self.forward_native(x)

    @staticmethod
    def forward_native(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
