"""The SwiGLU activation (vLLM: ``vllm/model_executor/layers/activation.py``, ``SiluAndMul``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minivllm import custom_ops
from minivllm.model.custom_op import CustomOp, no_kernel_for


class SiluAndMul(CustomOp):
    """``silu(x[..., :d]) * x[..., d:]`` with ``d = x.shape[-1] // 2`` (Shazeer 2020, SwiGLU).

    The input is the fused ``gate_up_proj`` output: ``x [T, 2 * intermediate]`` -> ``[T, intermediate]``, same
    dtype. On the CPU (bfloat16, and float32 unless ``MINIVLLM_CPU_KERNELS_FP32=0``) one kernel reads ``x`` once
    and writes the result (``custom_ops.silu_and_mul``) instead of materialising ``silu(gate)`` first
    (``forward_cpu``, chosen once: ``CustomOp``).

    Until issue 27 float32 kept PyTorch's SiLU: on an AVX2 CPU (no AVX-512) the kernel's 16-lane exp took 2.5-4x as
    long as ``F.silu(gate) * up`` (this project's 2-core AMD EPYC, one thread: 1608 rows 15-29 ms against 6.6-7.1
    ms), because GCC lowers a 16-lane vector's selects one lane at a time without AVX-512. The kernel now works in
    one register's width (8 lanes with AVX2, ``csrc/cpu_utils.h``): built for AVX2, 2048 rows 3.9 ms against
    PyTorch's 4.8-21.5 ms, one thread (``minivllm/bench/OPTIMISATIONS.md``, "Batch 1 on every thread").
    """

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or no_kernel_for(x, self.kernel_dtype):
            return self.forward_native(x)
        return custom_ops.silu_and_mul(x)
