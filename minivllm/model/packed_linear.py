"""bfloat16 linear layers on the CPU through oneDNN, and float32 ones under ``MINIVLLM_CPU_KERNELS_FP32=1`` (the
default) through minivllm's own GEMM kernel, with the weight packed once, not on every call.

A CPU matmul library lays the weight out in the blocked order its inner kernel reads (here oneDNN's AVX512-BF16
kernel). ``F.linear`` redoes that reordering on every call; for a decode step, whose activations are a handful of
rows, the reorder costs about as much as the multiplication. Packing each weight once and keeping the packed
copy halves the time of a batch-1 decode matmul and gains 10-20 % on large batches (measured: see
``minivllm/bench/OPTIMISATIONS.md``). The result is bit-identical to ``F.linear`` in bfloat16 (both are oneDNN
underneath), so nothing else changes. vLLM's CPU backend does the same: ``vllm/model_executor/layers/utils.py``
``dispatch_cpu_unquantized_gemm`` builds a oneDNN matmul handle with the packed weight at load time. One bfloat16
row (a batch-1 decode step) goes to minivllm's matrix-vector kernel instead, with the kernels on
(``PackedWeight.set_kernels``, ``custom_ops.skinny_gemm``): it reads the weight at the machine's copy bandwidth,
oneDNN's one-row matmul at two thirds of it; its sums may differ from oneDNN's in a result's last bit.

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
prefill's last token) goes to ``packed_gemm``'s panels too where that kernel is built (a row then sums in the same
order alone as inside a batch), else to minivllm's own matrix-vector kernel (``custom_ops.skinny_gemm``), which
splits the output rows across the threads: MKL's did not get faster with a second thread
(``minivllm/bench/OPTIMISATIONS.md``). Once an engine takes the model, the float32 layers' ``[out, in]`` weights
are freed and the panels alone kept (``Linear.remove_weight``, called through
``LlamaForCausalLM.remove_packed_weights`` by the model runner), as vLLM 0.32's CPU build keeps only its packed
copy (``remove_weight=True``): they were held twice, 425 MB of SmolLM2's 538 MB. The LM head keeps its weight,
which a tied head shares with the embedding (vLLM keeps it too).
``MINIVLLM_CPU_KERNELS_FP32=0`` keeps ``F.linear`` (MKL): the exact reference the course compares bit for bit; the
kernels' and oneDNN's float32 results differ from it in the last bits.
Two switches turn packing off, to compare: ``MINIVLLM_ONEDNN_PACKING=0`` (``minivllm.envs``), read when a layer is
built and again when a model is loaded or a model runner is built (``LlamaForCausalLM.set_custom_op_dispatch``),
never per call, like ``MINIVLLM_CPU_KERNELS``; and this module's ``ENABLED = False``, for every layer at once from a
running notebook (notebook 09).
"""

from __future__ import annotations

import ctypes
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
        self.bf16_row = False  # set_kernels: one bfloat16 row through custom_ops.skinny_gemm (else oneDNN)
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

    def set_kernels(self, on: bool) -> None:
        """Send one bfloat16 row (a batch-1 decode step, a prefill's last token at the LM head) to
        ``custom_ops.skinny_gemm`` on the weight as it is (``on``: minivllm's CPU kernels are used for this model,
        ``custom_ops.use_cpu_kernels``; set by ``LlamaForCausalLM.set_custom_op_dispatch``). oneDNN's bfloat16
        matmul with one row read SmolLM2's weights at about 21 GB/s on two Zen 4 cores (13 at one thread), this
        kernel at the machine's copy bandwidth, 32-34 (18) (``minivllm/bench/OPTIMISATIONS.md``, "bfloat16 at
        batch 1"). Its sums run in another order than oneDNN's: a row's result may differ from the same row inside
        a batch in the last bit of bfloat16."""
        self.bf16_row = on

    def usable(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether ``linear`` takes the packed path for ``x [N, in]`` and ``weight [out, in]``: same dtype, on the
        CPU, no autograd, packing enabled (``ENABLED`` and ``MINIVLLM_ONEDNN_PACKING``); bfloat16 where oneDNN has
        native bf16 matmuls; float32 when ``set_float32`` is on (``packed_gemm``, one row included), or, where that
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
            return x.shape[0] >= 1
        return x.shape[0] in FP32_PACKED_TOKENS and torch.backends.mkldnn.is_available()

    def skinny(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> bool:
        """Whether ``linear`` takes the batch-1 kernel (``custom_ops.skinny_gemm``): one row on the CPU, no
        autograd, the weight contiguous and of ``x``'s dtype, and either float32 with ``set_float32`` on and no
        packed panels for it (module doc: ``packed_gemm`` takes one row where it is built, or packing is switched
        off), or bfloat16 with ``set_kernels`` on and no ``bias`` (the kernel rounds to bfloat16 before a bias
        would be added, where oneDNN adds it to the float32 sum). It reads the weight as it is, not a packed copy,
        so ``ENABLED`` and ``MINIVLLM_ONEDNN_PACKING`` do not turn it off: the kernels' switches
        (``MINIVLLM_CPU_KERNELS_FP32``, ``MINIVLLM_CPU_KERNELS``) do."""
        if not (x.dim() == 2 and x.shape[0] == 1 and x.device.type == "cpu" and weight.dtype == x.dtype
                and weight.is_contiguous() and not torch.is_grad_enabled()):
            return False
        if x.dtype == torch.bfloat16:
            return self.bf16_row and bias is None
        return self.float32 and x.dtype == torch.float32 and not self.usable(x, weight)

    def panels_usable(self, x: torch.Tensor) -> bool:
        """Whether ``x`` may be multiplied by ``packed_gemm``'s panels alone, without the weight they came from:
        what ``usable`` asks of a float32 ``x`` on the ``packed_gemm`` path (``Linear.remove_weight``)."""
        return (ENABLED and self.enabled and self.gemm and x.dtype == torch.float32 and x.dim() == 2
                and x.device.type == "cpu" and not torch.is_grad_enabled())

    def pack(self, weight: torch.Tensor, gemm: bool) -> torch.Tensor:
        """The packed copy of ``weight``, (re)built unless the one held was packed from these very values:
        ``packed_gemm``'s panels when ``gemm``, else oneDNN's layout."""
        # The version counter sees in-place writes; ``module.to(dtype)`` swaps ``param.data`` instead, which keeps
        # the object and its version: ``_data`` (a view, no copy) tells the storage apart, and holding it keeps its
        # address from being reused by the new one.
        if (self._ref is None or self._ref() is not weight or self._version != weight._version
                or self._data.data_ptr() != weight.data_ptr() or self._data.dtype != weight.dtype
                or self._gemm_packed != gemm):
            w = weight.detach()
            self._packed = (custom_ops.pack_gemm_weight(w.contiguous()) if gemm
                            else torch.ops.mkldnn._reorder_linear_weight(w, None))
            self.packed_from(weight, gemm)
        return self._packed

    def packed_from(self, weight: torch.Tensor, gemm: bool) -> None:
        """Record that the packed copy held holds ``weight``'s present values."""
        self._ref, self._version, self._data, self._gemm_packed = (weakref.ref(weight), weight._version,
                                                                    weight.detach(), gemm)

    def forget_source(self) -> None:
        """Drop the view of the weight kept for the staleness check (it holds the weight's storage alive)."""
        self._ref = self._data = None
        self._version = -1

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x @ weight.T + bias``: ``x [N, in]``, ``weight [out, in]`` -> ``[N, out]``; the packed path when
        ``usable`` (float32: ``packed_gemm`` where it is built, one row included), the batch-1 kernel when
        ``skinny``, else ``F.linear``."""
        if self.skinny(x, weight, bias):
            out = custom_ops.skinny_gemm(x.contiguous(), weight)  # no autograd here (skinny): no detach needed
            return out if bias is None else out.add_(bias)
        if not self.usable(x, weight):
            return F.linear(x, weight, bias)
        gemm = x.dtype == torch.float32 and self.gemm
        packed = self.pack(weight, gemm)
        if gemm:
            out = custom_ops.packed_gemm(x.contiguous(), packed, weight.shape[0])
            return out if bias is None else out.add_(bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class Linear(nn.Linear):
    """``nn.Linear`` whose CPU forward multiplies with a packed copy of the weight in bfloat16, and in float32 once
    ``PackedWeight.set_float32`` is on (see module doc).

    ``remove_weight`` keeps a float32 weight as ``packed_gemm``'s panels alone, as vLLM's CPU build keeps only its
    packed copy. The parameter then lives on the meta device, with its shape and dtype (parameter counts and shapes
    stay right; reading its values fails loudly; an in-place write to it does nothing: ``restore_weight`` first).
    ``state_dict`` still gives the ``[out, in]`` values, and the module restores them (bit for bit, from the panels)
    before any path that needs them: ``F.linear`` (the reference, autograd, packing switched off), a conversion by
    ``module.to``/``_apply``, ``load_state_dict``. Every other path is ``nn.Linear``'s.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._packed_weight = PackedWeight()
        self.weight_removed = False  # the weight lives only in _packed_weight's panels (remove_weight)
        self._keep_weight = False  # restored for the reference: a model that also runs it keeps both (remove_weight)
        self.register_state_dict_post_hook(_removed_weight_in_state_dict)
        self.register_load_state_dict_pre_hook(_restore_before_load)

    def remove_weight(self) -> bool:
        """Pack the float32 weight into ``packed_gemm``'s panels now and free the ``[out, in]`` tensor, as vLLM
        0.32's CPU build does after loading (``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``,
        ``vllm/model_executor/layers/linear.py`` L216): the float32 weights were held twice, 425 MB of SmolLM2's
        (module doc). ``self.weight`` becomes a meta tensor of its shape (vLLM: an empty ``torch.empty(0)``, whose
        shape would make every parameter count of the course wrong).

        Only where the panels serve every call of the fast path: float32 on the CPU, ``set_float32`` on,
        ``packed_gemm`` built, packing enabled, and not once the weight was restored for a call the panels could not
        serve (a model that also serves an engine on the reference keeps its weight: removing it at every turn would
        copy it back and forth).

        Returns:
            Whether the weight is removed (also when it already was).
        """
        pw = self._packed_weight
        if self.weight_removed:
            return True
        w = self.weight
        if (self._keep_weight or not (ENABLED and pw.enabled and pw.gemm) or w.dtype != torch.float32
                or w.device.type != "cpu" or w.is_meta or w.dim() != 2):
            return False
        with torch.no_grad():
            pw.pack(w, gemm=True)
        pw.forget_source()
        # A new parameter: .data cannot change a tensor's device.
        self.weight = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=w.requires_grad)
        self.weight_removed = True
        return True

    def restore_weight(self, keep: bool = False) -> None:
        """Give ``self.weight`` its ``[out, in]`` values back, unpacked from the panels (bit for bit); nothing to do
        unless ``remove_weight`` removed it. ``keep``: never remove it again (``remove_weight``)."""
        if not self.weight_removed:
            return
        pw = self._packed_weight
        # A normal tensor even when restored inside a step (inference mode): autograd may use it afterwards.
        with torch.inference_mode(False), torch.no_grad():
            dense = custom_ops.unpack_gemm_weight(pw._packed, self.out_features)
        self.weight = nn.Parameter(dense, requires_grad=self.weight.requires_grad)
        pw.packed_from(self.weight, gemm=True)  # the panels hold these values: no repacking
        self.weight_removed = False
        self._keep_weight = self._keep_weight or keep

    def _apply(self, fn, recurse=True):
        if not self.weight_removed:
            return super()._apply(fn, recurse)
        probe = torch.empty(0)
        if fn(probe) is not probe:  # .to(dtype), .to(device), .float(): they convert the values, which must be there
            self.restore_weight()
            return super()._apply(fn, recurse)
        # Nothing to convert (a model moved to the device it is on, as each engine's worker does): the weight stays
        # removed, out of fn's way (a meta tensor cannot be copied to a device).
        weight = self._parameters.pop("weight")
        try:
            return super()._apply(fn, recurse)
        finally:
            self._parameters["weight"] = weight

    def linear(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """``x [N, in] @ weight.T + bias`` -> ``[N, out]`` through ``PackedWeight.linear``, or through the panels
        alone while the weight is removed (restored first for a path that needs it)."""
        pw = self._packed_weight
        if self.weight_removed:
            if pw.panels_usable(x):
                out = custom_ops.packed_gemm(x.contiguous(), pw._packed, self.out_features)
                return out if bias is None else out.add_(bias)
            self.restore_weight(keep=True)
        return pw.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.bias)


def release_free_memory() -> bool:
    """Hand the C library's free heap memory back to the system (glibc's ``malloc_trim(0)``); False where there is
    no such call (another C library). The freed ``[out, in]`` weights (numpy's arrays, from the loaders) stay in
    the process's heap otherwise, while the panels live in mappings of their own (``csrc/packed_gemm.cpp``): SmolLM2
    kept 230 MiB that way (resident 1203 MiB after a first request, 973 MiB once trimmed)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def _removed_weight_in_state_dict(module: Linear, state_dict, prefix: str, local_metadata) -> None:
    """``state_dict`` of a module whose weight is removed: the ``[out, in]`` values, unpacked (a new tensor)."""
    key = prefix + "weight"
    if module.weight_removed and key in state_dict:
        with torch.inference_mode(False), torch.no_grad():
            state_dict[key] = custom_ops.unpack_gemm_weight(module._packed_weight._packed, module.out_features)


def _restore_before_load(module: Linear, *args, **kwargs) -> None:
    module.restore_weight()  # load_state_dict copies into the [out, in] parameter
