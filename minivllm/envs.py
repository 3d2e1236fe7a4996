"""Every environment variable minivllm reads, in one place (vLLM: ``vllm/envs.py``).

Each variable is read when it is accessed (``envs.MINIVLLM_CPU_KERNELS``), not at import: a notebook or test that
sets one before building an engine gets its value, as in vLLM. Nothing here writes to ``os.environ``.

* ``MINIVLLM_CPU_KERNELS`` (default ``1``): ``0`` keeps bfloat16 on the CPU on PyTorch operators instead of
  minivllm's C++ kernels (``minivllm.custom_ops``). Read when a model is loaded and when a model runner is
  built (its attention backend and its ``CustomOp`` layers' implementation), never per call.
* ``MINIVLLM_CPU_KERNELS_FP32`` (default ``1``): float32 on the CPU runs through the same kernels too (decode and
  prefill attention, RMSNorm, RoPE, SiLU-and-mul, the batch-1 linear layers) and multiplies steps of 2 rows and more
  with packed weights (minivllm's ``packed_gemm``; oneDNN where that kernel is not built, up to 1024 rows without
  AVX-512: ``packed_linear.FP32_PACKED_TOKENS``), as vLLM's CPU build runs float32 through its own kernels and
  oneDNN-packed weights: the fast path, what ``LLM()`` and ``serve`` give. ``0`` chooses the exact reference,
  PyTorch's operators, whose float32 results the course compares bit for bit (the kernels sum in another order:
  results differ in the last bits, ``minivllm.custom_ops``); ``./course.sh`` sets
  ``0`` for the course (``lab``, ``test``, ``grade``, ``slides``, ``figures``, ``vllm-check``), and so does the test
  suite. Read when a model is loaded and when a model runner is built, like ``MINIVLLM_CPU_KERNELS``, which must also
  be on.
* ``MINIVLLM_ONEDNN_PACKING`` (default ``1``): ``0`` turns off the packed weights of
  ``minivllm.model.packed_linear``: oneDNN's for bfloat16, and for float32 ``packed_gemm``'s panels (oneDNN's where
  that kernel is not built), and with them the freeing of the float32 weights the panels replace
  (``packed_linear.Linear.remove_weight``); float32's one row then goes to ``skinny_gemm``, which reads the weight
  itself. Read when a linear layer is built and when a model is loaded or a model runner is built
  (``LlamaForCausalLM.set_custom_op_dispatch``), never per matmul.
* ``MINIVLLM_CPU_THREADS_AUTO`` (default ``1``): on the CPU, when nobody chose a thread count (``OMP_NUM_THREADS``
  unset, torch's count equal to the CPUs the process may use), the worker lowers torch's thread count while other
  processes keep CPUs busy and raises it again when they stop (``minivllm.worker.cpu_threads``); ``0`` keeps the
  count fixed. Read when a worker loads its model.
* ``MINIVLLM_CPU_ISA`` (default unset: the machine's own): ``avx2`` builds minivllm's C++ kernels for x86-64-v3
  (AVX2 and FMA, no AVX-512) instead of ``-march=native``, to run an AVX-512 machine's engine as the AVX2 class runs
  it; ``python -m minivllm bench --isa avx2`` sets it with the libraries' own caps (``minivllm.bench.isa``). Read
  when the kernels are built or loaded. Any other value raises ``ValueError`` naming the variable.
* ``MINIVLLM_CACHE`` (default ``~/.cache/minivllm``): where the tokenizer files are unpacked.
* ``MINIVLLM_VLLM_CHECK_MODEL`` (default ``$MINIVLLM_CACHE/vllm_check/SmolLM2-135M-Instruct-float32``): the
  float32 Hugging Face folder that the live vLLM check writes once and both engines load
  (``minivllm.bench.vllm_check.model_folder``).
* ``MINIVLLM_WORKER_ERROR_FILE`` (internal, unset by default): not a setting. ``MultiprocExecutor`` sets it for each
  worker process it spawns, to the file where a worker that dies while it re-imports an unguarded main script
  leaves its reason (``minivllm.executor.multiproc_executor``); read in that worker.
* ``MINIVLLM_LANG`` (default unset: English): ``zh_CN`` (or ``zh``) formats the package's learner-facing messages
  in Chinese (``minivllm.i18n``); read once, when ``minivllm.i18n`` is imported (``set_language`` switches later).
* ``VLLM_USE_V2_MODEL_RUNNER`` (vLLM's own name, unset by default): ``1`` chooses Model Runner V2, ``0`` the V1
  runner, for an engine built without an explicit ``model_runner`` argument. Unset, minivllm uses V1 (vLLM 0.32
  would choose V2 where Triton runs, see ``SchedulerConfig``). Read when the engine's config is created.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional


def _flag(name: str, default: str) -> Callable[[], bool]:
    return lambda: os.environ.get(name, default) != "0"


def _optional_flag(name: str) -> Callable[[], Optional[bool]]:
    """``None`` when unset or empty, else ``bool(int(value))`` (vLLM's ``maybe_convert_bool``).

    Raises (when read): ``ValueError`` naming the variable if the value is not an integer."""

    def read() -> Optional[bool]:
        value = os.environ.get(name)
        if not value:
            return None
        try:
            return bool(int(value))
        except ValueError:
            raise ValueError(f"{name} must be 0 or 1, got {value!r}") from None

    return read


CPU_ISAS = ("avx2",)  # the values MINIVLLM_CPU_ISA takes besides unset


def _cpu_isa() -> Optional[str]:
    value = os.environ.get("MINIVLLM_CPU_ISA") or None
    if value is not None and value not in CPU_ISAS:
        raise ValueError(f"MINIVLLM_CPU_ISA must be unset or one of {', '.join(CPU_ISAS)}, got {value!r}")
    return value


environment_variables: Dict[str, Callable[[], Any]] = {
    "MINIVLLM_CPU_KERNELS": _flag("MINIVLLM_CPU_KERNELS", "1"),
    "MINIVLLM_CPU_KERNELS_FP32": _flag("MINIVLLM_CPU_KERNELS_FP32", "1"),
    "MINIVLLM_ONEDNN_PACKING": _flag("MINIVLLM_ONEDNN_PACKING", "1"),
    "MINIVLLM_CPU_THREADS_AUTO": _flag("MINIVLLM_CPU_THREADS_AUTO", "1"),
    "VLLM_USE_V2_MODEL_RUNNER": _optional_flag("VLLM_USE_V2_MODEL_RUNNER"),
    "MINIVLLM_CACHE": lambda: os.environ.get(
        "MINIVLLM_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "minivllm")
    ),
    "MINIVLLM_CPU_ISA": _cpu_isa,
    "MINIVLLM_LANG": lambda: os.environ.get("MINIVLLM_LANG") or None,
    "MINIVLLM_WORKER_ERROR_FILE": lambda: os.environ.get("MINIVLLM_WORKER_ERROR_FILE") or None,
    "MINIVLLM_VLLM_CHECK_MODEL": lambda: os.environ.get("MINIVLLM_VLLM_CHECK_MODEL") or os.path.join(
        environment_variables["MINIVLLM_CACHE"](), "vllm_check", "SmolLM2-135M-Instruct-float32"
    ),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return list(environment_variables)
