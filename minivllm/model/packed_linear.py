"""bfloat16 linear layers on the CPU through oneDNN, and float32 ones under ``MINIVLLM_CPU_KERNELS_FP32=1`` (the
default) through minivllm's own GEMM kernel, with the weight packed once, not on every call.

A CPU matmul library lays the weight out in the blocked order its inner kernel reads (here oneDNN's AVX512-BF16
kernel). ``F.linear`` redoes that reordering on every call; for a decode step, whose activations are a handful of
rows, the reorder costs about as much as the multiplication. Packing each weight once and keeping the packed
copy halves the time of a batch-1 decode matmul and gains 10-20 % on large batches (measured: see
``minivllm/bench/OPTIMISATIONS.md``). The result is bit-identical to ``F.linear`` in bfloat16 (both are oneDNN
underneath), so nothing else changes. vLLM's CPU backend does the same: ``vllm/model_executor/layers/utils.py``
``dispatch_cpu_unquantized_gemm`` builds a oneDNN matmul handle with the packed weight at load time.

With ``MINIVLLM_CPU_KERNELS_FP32=1`` (the default) a float32 model packs its weights too (the loader and the model
runner say so through ``set_float32``), as vLLM's CPU build does for every dtype, but into the column panels of
minivllm's own kernel (``custom_ops.packed_gemm``, ``csrc/packed_gemm.cpp``) for every step of 2 rows or more: on a
2-core AMD EPYC (Zen 4) it took 0.64-0.83x oneDNN's time at the 8-32 rows of a decode step (0.81-0.92x built for
AVX2, ``bench --isa avx2``) and was level with it from 256 to 2048 rows, where MKL took longer than both
(``minivllm/bench/OPTIMISATIONS.md``, "Float32 prefill attention and a packed GEMM"). Where that kernel is not built
(a CPU without AVX2), float32 goes to oneDNN for ``FP32_PACKED_TOKENS`` rows: measured on this project's 2-core AMD
EPYC (AVX2, one thread, SmolLM2's 30 layers, weights streamed from memory), oneDNN took 0.64-0.86x MKL's time for
2-32 rows and 0.92-0.96x for 64-512, and was level at 1024; with AVX-512 it is faster at every size, prefill steps
of thousands of rows included (``fp32_packed_rows``). One row (a batch-1 decode step, and the LM head of a
prefill's last token) goes to minivllm's own matrix-vector kernel (``custom_ops.skinny_gemm``), which splits the
output rows across the threads: MKL's did not get faster with a second thread (``minivllm/bench/OPTIMISATIONS.md``).
``MINIVLLM_CPU_KERNELS_FP32=0`` keeps ``F.linear`` (MKL): the exact reference the course compares bit for bit; the
kernels' and oneDNN's float32 results differ from it in the last bits.
Two switches turn packing off, to compare: ``MINIVLLM_ONEDNN_PACKING=0`` (``minivllm.envs``), read when a layer is
built and again when a model is loaded or a model runner is built (``LlamaForCausalLM.set_custom_op_dispatch``),
never per call, like ``MINIVLLM_CPU_KERNELS``; and this module's ``ENABLED = False``, for every layer at once from a
running notebook (notebook 09).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from minivllm import custom_ops, envs

ENABLED = True  # the course's switch for every layer at once; MINIVLLM_ONEDNN_PACKING is each layer's (module doc)


def fp32_packed_rows(capability: Optional[str] = None) -> range:
    """The rows of ``x`` for which a float32 packed weight beats MKL's ``F.linear``, after the vector unit
    PyTorch's kernels use (``torch.backends.cpu.get_cpu_capability()``, or ``capability``): 2-1024 rows with AVX2
    (measured on this project's AVX2 EPYC: level at 1024 rows, MKL ahead at 1608, module doc), every size from 2
    rows with AVX-512 (measured on its AVX512-BF16 EPYC, SmolLM2's projections at 1024-4096 rows, two threads: packed
    1.8-3.6x faster; ``minivllm/bench/OPTIMISATIONS.md``, "Batch 1 on every thread")."""
    capability = capability or torch.backends.cpu.get_cpu_capability()
    return range(2, 1 << 62) if capability.startswith("AVX512") else range(2, 1025)


FP32_PACKED_TOKENS = fp32_packed_rows()  # rows of x for which a float32 packed weight beats MKL (module doc)
_SUPPORTED: Optional[bool] = None


def onednn_bf16_available() -> bool:
    """True when this PyTorch has oneDNN and the CPU runs bfloat16 matmuls natively (AVX512-BF16 or AMX)."""
    global _SUPPORTED
    if _SUPPORTED is None:
        try:
            _SUPPORTED = bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            _SUPPORTED = False
    return _SUPPORTED


class PackedWeight:
    """A oneDNN-packed copy of one weight, rebuilt whenever the weight tensor is replaced, modified in place or
    given new data (``module.to(dtype)``)."""

    def __init__(self) -> None:
        self._ref = None
        self._version = -1
        self._data: Optional[torch.Tensor] = None
        self._packed: Optional[torch.Tensor] = None
        self._gemm_packed = False  # whether _packed holds packed_gemm's panels (else oneDNN's layout)
        self.float32 = False  # set_float32: the model runs float32 packed too
        self.gemm = False  # set_float32: float32 through custom_ops.packed_gemm (else oneDNN)
        self.enabled = envs.MINIVLLM_ONEDNN_PACKING  # read here, not per call; set_float32 reads it again

    def set_float32(self, on: bool) -> None:
        """Pack float32 weights as well (for ``packed_gemm`` where it is built, else oneDNN for
        ``FP32_PACKED_TOKENS`` rows), and send one row to ``skinny_gemm``
        (``MINIVLLM_CPU_KERNELS_FP32=1``: set by ``LlamaForCausalLM.set_custom_op_dispatch``, i.e. by the loader
        and by each model runner), and read
        ``MINIVLLM_ONEDNN_PACKING`` again, so that a value set after the model was built counts from the next
        engine on."""
        self.float32 = on
        self.gemm = on and custom_ops.packed_gemm_available()
        self.enabled = envs.MINIVLLM_ONEDNN_PACKING

    def usable(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether ``linear`` takes the packed path for ``x [N, in]`` and ``weight [out, in]``: same dtype, on the
        CPU, no autograd, packing enabled (``ENABLED`` and ``MINIVLLM_ONEDNN_PACKING``); bfloat16 where oneDNN has
        native bf16 matmuls; float32 when ``set_float32`` is on and ``N >= 2`` (``packed_gemm``), or, where that
        kernel is not built, ``N`` in ``FP32_PACKED_TOKENS`` (oneDNN)."""
        if not (ENABLED and self.enabled) or x.device.type != "cpu" or x.dim() != 2 or x.dtype != weight.dtype:
            return False
        if torch.is_grad_enabled():  # the packed op has no backward
            return False
        if x.dtype == torch.bfloat16:
            return onednn_bf16_available()
        if not (x.dtype == torch.float32 and self.float32):
            return False
        if self.gemm:
            return x.shape[0] >= 2
        return x.shape[0] in FP32_PACKED_TOKENS and torch.backends.mkldnn.is_available()

    def skinny(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether ``linear`` takes the float32 batch-1 kernel (``custom_ops.skinny_gemm``): one row of float32 on
        the CPU, no autograd, ``set_float32`` on, the weight contiguous (module doc). It reads the weight as it is,
        not a packed copy, so ``ENABLED`` and ``MINIVLLM_ONEDNN_PACKING`` do not turn it off: the float32 kernels'
        switch (``MINIVLLM_CPU_KERNELS_FP32``, ``MINIVLLM_CPU_KERNELS``) does."""
        return (self.float32 and x.dtype == torch.float32 and weight.dtype == torch.float32 and x.dim() == 2
                and x.shape[0] == 1 and x.device.type == "cpu" and weight.is_contiguous()
                and not torch.is_grad_enabled())

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x @ weight.T + bias``: ``x [N, in]``, ``weight [out, in]`` -> ``[N, out]``; the batch-1 kernel when
        ``skinny``, the packed path when ``usable`` (float32: ``packed_gemm`` where it is built), else
        ``F.linear``."""
        if self.skinny(x, weight):
            out = custom_ops.skinny_gemm(x.contiguous(), weight)  # no autograd here (skinny): no detach needed
            return out if bias is None else out.add_(bias)
        if not self.usable(x, weight):
            return F.linear(x, weight, bias)
        # The version counter sees in-place writes; ``module.to(dtype)`` swaps ``param.data`` instead, which keeps
        # the object and its version: ``_data`` (a view, no copy) tells the storage apart, and holding it keeps its
        # address from being reused by the new one.
        gemm = x.dtype == torch.float32 and self.gemm
        if (self._ref is None or self._ref() is not weight or self._version != weight._version
                or self._data.data_ptr() != weight.data_ptr() or self._data.dtype != weight.dtype
                or self._gemm_packed != gemm):
            w = weight.detach()
            self._packed = (custom_ops.pack_gemm_weight(w.contiguous()) if gemm
                            else torch.ops.mkldnn._reorder_linear_weight(w, None))
            self._ref, self._version, self._data, self._gemm_packed = weakref.ref(weight), weight._version, w, gemm
        if gemm:
            out = custom_ops.packed_gemm(x.contiguous(), self._packed, weight.shape[0])
            return out if bias is None else out.add_(bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._packed, bias, "none", [], "")


class Linear(nn.Linear):
    """``nn.Linear`` whose CPU forward multiplies with a packed copy of the weight in bfloat16, and in float32 for
    2 rows and more once ``PackedWeight.set_float32`` is on, when one row goes to ``skinny_gemm`` (see module doc).

    The parameters, ``state_dict`` and every other path are ``nn.Linear``'s.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._packed_weight = PackedWeight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._packed_weight.linear(x, self.weight, self.bias)
