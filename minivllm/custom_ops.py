"""The engine's own CPU kernels (``minivllm/csrc``), compiled on first use, and their Python entry points (vLLM:
``vllm/_custom_ops.py`` over ``csrc/cpu``).

Eight operators, each replacing one or several PyTorch operators of one decoder layer:

* ``paged_attention_decode``: decode attention that follows each request's block table through the paged KV
  cache, with no gather, padding or mask (``csrc/attention.cpp``; vLLM ``paged_attention_v1``).
* ``paged_attention_prefill``: causal attention of prefill chunks over the same blocks, in tiles: bfloat16 where
  the CPU has AVX512-BF16, float32 where it has AVX2 and FMA (``csrc/prefill_attention.cpp``;
  ``prefill_kernel_available(dtype)``).
* ``fused_add_rms_norm`` and ``rms_norm``: the residual add and RMSNorm in one pass (``csrc/layernorm.cpp``).
* ``silu_and_mul``: SwiGLU's ``silu(gate) * up`` in one pass (``csrc/activation.cpp``).
* ``rotary_embedding``: RoPE on the q and k heads of the fused qkv output, in place (``csrc/pos_encoding.cpp``).
* ``packed_gemm``: a float32 linear layer, register tiles over a weight packed once into column panels by
  ``pack_gemm_weight`` (``csrc/packed_gemm.cpp``; ``packed_gemm_available()``: a CPU with AVX2 and FMA); one row,
  a batch-1 decode step, included. ``unpack_gemm_weight`` gives the weight back from the panels.
* ``skinny_gemm``: a float32 or bfloat16 linear layer for one row of activations on the weight as it is, the output
  rows split across the threads (``csrc/skinny_gemm.cpp``): the batch-1 decode's matrix-vector products in
  bfloat16, and in float32 where ``packed_gemm`` is not built.

They are built with ``torch.utils.cpp_extension`` (g++ and ninja; about 20 s on two cores, once: the library is
cached under ``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``, keyed by a hash of the sources,
the compiler flags, the PyTorch version and the CPU). The model uses them for bfloat16 on the CPU, and for float32
too by default (``MINIVLLM_CPU_KERNELS_FP32``, default ``1``: decode and prefill attention, RMSNorm, RoPE,
SiLU-and-mul and the linear layers), as vLLM's CPU build runs float32 through its ``csrc/cpu`` kernels; results then differ
from PyTorch's operators in the last bits (sums in another order). ``MINIVLLM_CPU_KERNELS_FP32=0`` keeps float32 on
those operators, the exact reference the course compares bit for bit and token for token against Hugging Face
(``./course.sh`` and the test suite choose it).
If the build fails (no compiler), the engine warns once and keeps the PyTorch operators; set
``MINIVLLM_CPU_KERNELS=0`` to choose them yourself (the benchmark's before/after in ``OPTIMISATIONS.md``).

Every wrapper raises ``RuntimeError`` (from the kernel's checks) on a wrong shape, dtype, layout, block id,
position or an output row claimed by two requests, before it writes anything.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from minivllm import envs

CSRC = Path(__file__).with_name("csrc")
SOURCES = ["attention.cpp", "prefill_attention.cpp", "layernorm.cpp", "activation.cpp", "pos_encoding.cpp",
           "skinny_gemm.cpp", "packed_gemm.cpp", "thread_pool.cpp", "torch_bindings.cpp"]
# -march=native: the build is for this machine's CPU (the cache key includes its feature flags). Files whose
# results must round exactly as PyTorch's separate operators switch off fused multiply-adds themselves.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++20", "-w"]
# MINIVLLM_CPU_ISA: the -march that builds for a narrower class than this machine's (minivllm.bench.isa).
MARCH_FOR_ISA = {"avx2": "-march=x86-64-v3"}


def cflags() -> list:
    """``CFLAGS``, with ``-march=native`` replaced when ``MINIVLLM_CPU_ISA`` names a narrower class.

    Raises:
        ValueError: for a ``MINIVLLM_CPU_ISA`` minivllm does not know (``minivllm.envs``), or ``avx2`` on a CPU
            without AVX2 and FMA.
    """
    isa = envs.MINIVLLM_CPU_ISA
    if isa == "avx2" and not {"avx2", "fma"} <= set(_cpu_id().split()):
        raise ValueError("MINIVLLM_CPU_ISA=avx2 needs a CPU with AVX2 and FMA (this one lacks them): the kernels would "
                         "stop with an illegal instruction")
    return [MARCH_FOR_ISA[isa] if f == "-march=native" and isa else f for f in CFLAGS]

_state: dict = {"loaded": None, "error": None}


def enabled() -> bool:
    """False when ``MINIVLLM_CPU_KERNELS=0`` is set (``minivllm.envs``)."""
    return envs.MINIVLLM_CPU_KERNELS


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next(line for line in cpuinfo if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return flags


def _build_name(flags: list) -> str:
    h = hashlib.sha256()
    for name in SOURCES + ["ops.h", "cpu_utils.h", "thread_pool.h"]:
        h.update((CSRC / name).read_bytes())
    h.update(" ".join(flags).encode())
    h.update(torch.__version__.encode())
    h.update(_cpu_id().encode())
    return "minivllm_cpu_" + h.hexdigest()[:12]


def _put_ninja_on_path() -> None:
    """cpp_extension runs ``ninja`` from PATH; the pip package ``ninja`` installs it next to the venv's python,
    which is not on PATH when the venv is not activated (``.venv/bin/python -m ...``)."""
    if shutil.which("ninja") is None:
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass  # the build then fails and the engine falls back, with the error in build_error()


def build_directory(name: str) -> Path:
    """Where ``torch.utils.cpp_extension.load`` builds the library ``name``: the folder its
    ``_get_build_directory`` chooses at PyTorch 2.13 (``TORCH_EXTENSIONS_DIR`` as it is, else
    ``get_default_build_root()/py<major><minor><abiflags>_<rocm…|cu…|cpu>``), so that a library built before is found
    again. ``load()`` passes it to torch explicitly: the folder whose lock it checks is the folder torch builds in,
    even where this copy of torch's rule goes out of date."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        if torch.version.hip is not None:
            accelerator = f"rocm{torch.version.hip.replace('.', '')}"
        elif torch.version.cuda is not None:
            accelerator = f"cu{torch.version.cuda.replace('.', '')}"
        else:
            accelerator = "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(get_default_build_root(), f"{python}_{accelerator}")
    return Path(root) / name


# A torch build lock older than this, found while minivllm's flock is held, is taken as left by a killed process.
# Longer than a build (about 20 s on two cores, a minute under load), so that a lock of a live build that does not
# take the flock (an older minivllm with the same kernel sources, a host sharing the folder over NFS without locks)
# is waited on rather than removed.
STALE_LOCK_S = 120.0


@contextlib.contextmanager
def _held_build_lock(folder: Path):
    """Hold ``folder/minivllm.lock`` (``fcntl.flock``) while torch builds; yields ``[path]`` of a torch lock it
    removed as stale, else ``[]``.

    torch's own lock (``folder/lock``, ``torch.utils.file_baton.FileBaton``) is a file that exists while a process
    builds; a process killed mid-build (Ctrl-C at the first start-up, a killed test run) leaves it, and every later
    start then waited on it forever. The kernel's ``flock`` ends with its holder, so whoever holds it knows that no
    other process running this code is building the library; a ``lock`` file found then is waited on until it is
    ``STALE_LOCK_S`` old (for builds that do not take the flock) and then removed.
    """
    folder.mkdir(parents=True, exist_ok=True)  # torch makes only the folders it chooses itself
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's lock alone, as before
        yield []
        return
    with open(folder / "minivllm.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # waits while another process builds the same library
        try:
            lock, removed, told = folder / "lock", [], False
            while True:
                try:
                    age = time.time() - lock.stat().st_mtime
                except FileNotFoundError:
                    break
                if age >= STALE_LOCK_S:
                    lock.unlink(missing_ok=True)
                    removed.append(lock)
                    break
                if not told:
                    logging.getLogger(__name__).warning(
                        "minivllm: waiting for %s, a build under way or one that was interrupted (removed when %.0f s "
                        "old)", lock, STALE_LOCK_S)
                    told = True
                time.sleep(0.5)
            yield removed
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def load(verbose: bool = False) -> bool:
    """Build (first time) and load the kernels; True when ``torch.ops.minivllm_cpu`` is ready.

    A failed build is remembered for the process: the error is in ``build_error()``, and a ``RuntimeWarning``
    is issued once. Processes that start together build once: the others wait (``_held_build_lock``), and a build
    lock left by a killed process is removed once it is ``STALE_LOCK_S`` old, with a ``RuntimeWarning`` naming it,
    instead of waited on forever.

    Raises:
        ValueError: for a ``MINIVLLM_CPU_ISA`` minivllm does not know, before anything is built.
    """
    if _state["loaded"] is not None:
        return _state["loaded"]
    flags = cflags()  # outside the try: a wrong MINIVLLM_CPU_ISA is the user's error, not a build to fall back from
    try:
        from torch.utils.cpp_extension import load as cpp_load

        _put_ninja_on_path()

        name = _build_name(flags)
        folder = build_directory(name)
        with _held_build_lock(folder) as removed:
            cpp_load(
                name=name,
                sources=[str(CSRC / s) for s in SOURCES],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                build_directory=str(folder),
                is_python_module=False,
                verbose=verbose,
            )
        _state["loaded"] = True
        for lock in removed:  # after the build, so that warnings raised as errors do not fail it
            warnings.warn(f"minivllm: removed {lock}, left by a build that was interrupted", RuntimeWarning,
                          stacklevel=2)
    except Exception as exc:  # a missing compiler or ninja shows up as several exception types
        _state["loaded"], _state["error"] = False, f"{type(exc).__name__}: {exc}"
        warnings.warn(
            f"minivllm: the CPU kernels could not be built, using PyTorch operators instead ({_state['error'][:300]})",
            RuntimeWarning,
            stacklevel=2,
        )
    return _state["loaded"]


def _ops():
    """``torch.ops.minivllm_cpu`` after building the kernels; ``RuntimeError`` when they cannot be built."""
    if not load():
        raise RuntimeError(f"minivllm's CPU kernels are not available: {_state['error']}")
    return torch.ops.minivllm_cpu


def loaded() -> bool:
    """Whether the kernels are loaded in this process, without loading (or building) them."""
    return bool(_state["loaded"])


def build_error() -> Optional[str]:
    """Why the kernels could not be built, or ``None``."""
    return _state["error"]


def kernel_dtypes() -> tuple:
    """The dtypes a model runs through these kernels: bfloat16, and float32 unless ``MINIVLLM_CPU_KERNELS_FP32=0``
    (the exact reference)."""
    return (torch.bfloat16, torch.float32) if envs.MINIVLLM_CPU_KERNELS_FP32 else (torch.bfloat16,)


def use_cpu_kernels(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether a model on ``device`` in ``dtype`` should run these kernels: a ``kernel_dtypes()`` dtype on the
    CPU, kernels enabled (``MINIVLLM_CPU_KERNELS``) and built. Asked once per model runner (its attention backend,
    the model's ``CustomOp`` layers and packed weights), not per call."""
    return torch.device(device).type == "cpu" and dtype in kernel_dtypes() and enabled() and load()


def usable(x: torch.Tensor) -> bool:
    """True when the model should call the kernels for activations like ``x``: a ``kernel_dtypes()`` dtype on
    the CPU, kernels enabled and built, no autograd (the kernels have no backward)."""
    return (
        x.device.type == "cpu"
        and x.dtype in kernel_dtypes()
        and enabled()
        and not torch.is_grad_enabled()
        and load()
    )


def paged_attention_decode(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_rows: torch.Tensor,
    scale: float,
) -> None:
    """Decode attention read in place from the paged cache; writes ``out[query_rows[i]]`` for every request ``i``.

    Args:
        out: ``[num_tokens, num_heads, head_dim]``, query's dtype, heads contiguous; other rows are left alone.
        query: ``[num_tokens, num_heads, head_dim]`` bfloat16 or float32, heads contiguous (rows may be strided,
            e.g. a view of the qkv projection).
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, contiguous, query's dtype.
        block_table: ``int64 [num_reqs, max_blocks]``, rows contiguous.
        seq_lens: ``int64 [num_reqs]``, keys each request attends to (its new token included), at least 1.
        query_rows: ``int64 [num_reqs]``, the row of ``query`` holding request ``i``'s one query token.
        scale: softmax scale, ``1 / sqrt(head_dim)``.

    Scores, softmax and the weighted sum are float32, as in ``reference_paged_attention``.
    """
    _ops().paged_attention_decode(out, query, kv_cache, block_table, seq_lens, query_rows, scale)


def prefill_kernel_available(dtype: torch.dtype) -> bool:
    """True when the kernels are built with a prefill attention for ``dtype`` (``csrc/prefill_attention.cpp``):
    bfloat16 on a CPU with AVX512-BF16, float32 on one with AVX2 and FMA (or AVX-512); False for other dtypes."""
    return load() and bool(_ops().prefill_kernel_available(dtype))


def paged_attention_prefill(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> None:
    """Causal attention of prefill chunks read in place from the paged cache (tiles of 32 positions, an exact
    two-pass float32 softmax per tile; in bfloat16 the probabilities are rounded to bfloat16 before P.V, as in
    PyTorch's bfloat16 flash attention).

    Request ``i``'s query rows ``query_start[i] .. query_start[i] + query_lens[i] - 1`` sit at positions
    ``context_lens[i] + 0, 1, ...`` and attend to keys ``0 ..`` their own position (earlier chunks included),
    read through ``block_table[i]``. Writes those rows of ``out``.

    Args:
        out, query: ``[num_tokens, num_heads, head_dim]`` bfloat16 or float32, heads contiguous; head_dim 64 or 128.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` in query's dtype, holding this step's keys.
        block_table: ``int64 [num_reqs, max_blocks]``.
        query_start, query_lens, context_lens: ``int64 [num_reqs]``.
        scale: softmax scale.

    Raises:
        RuntimeError: on a wrong dtype, shape or block id, or when ``prefill_kernel_available(query.dtype)`` is
            False.
    """
    _ops().paged_attention_prefill(
        out, query, kv_cache, block_table, query_start, query_lens, context_lens, scale
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [T, hidden] / sqrt(mean(x^2) + eps) * weight [hidden]`` in float32, returned in ``x``'s dtype."""
    out = torch.empty_like(x)
    _ops().rms_norm(out, x, weight, eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: ``residual += x`` (rounded to the dtype), then ``x = rms_norm(residual)``. ``[T, hidden]`` each."""
    _ops().fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x [T, 2 d]`` -> ``silu(x[:, :d]) * x[:, d:]`` ``[T, d]``, the SiLU rounded to the dtype before the product."""
    out = x.new_empty(x.shape[:-1] + (x.shape[-1] // 2,))  # a wrong rank is the kernel's RuntimeError
    _ops().silu_and_mul(out, x)
    return out


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [1, in] @ weight[out, in].T`` -> ``[1, out]``, all float32 or all bfloat16 (``csrc/skinny_gemm.cpp``): a
    batch-1 decode's linear layers and LM head, the output rows split across the threads. float32 where
    ``packed_gemm`` is not built or packing is off (else one row goes to the panels): sums in another order than
    MKL's, equal to ``F.linear`` within float32 rounding, not bit for bit. bfloat16 (``PackedWeight.set_kernels``):
    products summed in float32 (AVX512-BF16's ``vdpbf16ps`` where built), rounded to bfloat16 once; another order
    than oneDNN's, so the last bit of a result may differ from oneDNN's.

    Raises:
        RuntimeError: (the kernel's check) when the dtypes are not all float32 or all bfloat16, ``x`` has more
            than one row or another width than ``weight``, or ``weight`` is not contiguous.
    """
    out = x.new_empty((x.shape[0], weight.shape[0])) if x.dim() == 2 and weight.dim() == 2 else x.new_empty(0)
    _ops().skinny_gemm(out, x, weight)
    return out


def rotary_embedding(
    positions: torch.Tensor, qk: torch.Tensor, num_rotated: int, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Rotate heads ``0 .. num_rotated-1`` of ``qk [T, heads, head_dim]`` in place by the angles of ``positions
    int64 [T]`` (float32 tables ``[max_position, head_dim]``, the layout of ``RotaryEmbedding``)."""
    _ops().rotary_embedding(positions, qk, num_rotated, cos, sin)


def packed_gemm_available() -> bool:
    """True when the kernels are built with ``packed_gemm`` (a CPU with AVX2 and FMA, or AVX-512)."""
    return load() and bool(_ops().packed_gemm_available())


def pack_gemm_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` float32, contiguous -> the panels ``packed_gemm`` reads: ``[ceil(out / w), in, w]``,
    ``w`` output columns each (32 with AVX-512, 16 with AVX2), zeros past the last column (``csrc/packed_gemm.cpp``).

    Raises:
        RuntimeError: (the kernel's check) for another dtype or layout, or when ``packed_gemm_available()`` is False.
    """
    return _ops().pack_gemm_weight(weight)


def unpack_gemm_weight(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The inverse of ``pack_gemm_weight``: panels ``[ceil(out / w), in, w]`` -> the contiguous ``weight [out, in]``
    they were packed from, bit for bit (a copy, in PyTorch: no kernel needed, so it also runs where
    ``packed_gemm_available()`` is False).

    Raises:
        ValueError: when ``packed`` is not 3-dimensional or its panels hold fewer than ``out_features`` columns.
    """
    if packed.dim() != 3 or not 0 <= out_features <= packed.shape[0] * packed.shape[2]:
        raise ValueError(f"unpack_gemm_weight: packed must be [panels, in, width] holding out_features="
                         f"{out_features} columns, got shape {tuple(packed.shape)}")
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:out_features].contiguous()


def packed_gemm(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x [rows, in] @ weight.T`` -> ``[rows, out_features]`` float32, ``weight`` packed by ``pack_gemm_weight``:
    the float32 linear layers, one row or more (``csrc/packed_gemm.cpp``), the panels split across the threads.
    Sums over ``in`` in order with fused multiply-adds: equal to ``F.linear`` within float32 rounding, not bit for
    bit; a row's result does not depend on the other rows of ``x`` (each row tile sums in the same order).

    Raises:
        RuntimeError: (the kernel's check) when a dtype is not float32, ``x``'s rows are not contiguous, its width
            is not the packed weight's, or ``out_features`` does not match the panels.
    """
    out = x.new_empty((x.shape[0], out_features)) if x.dim() == 2 else x.new_empty(0, out_features)
    _ops().packed_gemm(out, x, packed)
    return out


def set_redoable_threads(n: int) -> None:
    """The thread count of ``packed_gemm`` and ``paged_attention_decode``, whose work items the calling thread redoes
    rather than wait for a helper thread the OS has descheduled (``csrc/thread_pool.h``): ``n`` above
    ``torch.get_num_threads()`` runs them on helper threads of their own, else on PyTorch's OpenMP threads as the
    other kernels; ``0`` follows ``torch.set_num_threads``. minivllm's thread governor sets every CPU of the process,
    so when it lowers torch's count for a busy CPU these two kernels keep the time that CPU has left
    (``minivllm/worker/cpu_threads.py``). Does nothing where the kernels are not loaded; the count is the process's.

    Raises:
        ValueError: ``n < 0``.
    """
    if n < 0:
        raise ValueError(f"set_redoable_threads: n must be >= 0 (0: follow torch.set_num_threads), got {n}")
    if _state["loaded"]:
        _ops().set_redoable_threads(n)


def redoable_threads() -> int:
    """The thread count ``packed_gemm`` and ``paged_attention_decode`` run on in the calling thread
    (``set_redoable_threads``, else ``torch.get_num_threads()``); ``torch.get_num_threads()`` where the kernels are
    not loaded."""
    return int(_ops().redoable_threads()) if _state["loaded"] else torch.get_num_threads()


def set_helper_cpus(cpus: Sequence[int]) -> bool:
    """The CPUs the helper threads of ``packed_gemm`` and ``paged_attention_decode`` may run on (their sched
    affinity), applied by each helper when it next wakes for a call of those kernels; an empty list, the default (and
    in a forked child), leaves their affinity as it is (at a helper's start, that of the thread that started it).
    minivllm's thread governor keeps them off the CPU of the thread that runs the step while torch's count is one
    (``minivllm/worker/cpu_threads.py``). Returns whether the list was set: False, doing nothing, where the kernels
    are not loaded.

    Raises:
        ValueError: a CPU number below 0 (the kernel raises RuntimeError for one at or above ``CPU_SETSIZE``, 1024).
    """
    cpus = [int(c) for c in cpus]
    if any(c < 0 for c in cpus):
        raise ValueError(f"set_helper_cpus: cpus must be >= 0, got {cpus}")
    if not _state["loaded"]:
        return False
    _ops().set_helper_cpus(cpus)
    return True


def helper_cpus() -> List[int]:
    """The list ``set_helper_cpus`` last set (empty: affinity left alone, and where the kernels are not loaded)."""
    return [int(c) for c in _ops().helper_cpus()] if _state["loaded"] else []


def redone_items() -> int:
    """How many work items of those kernels the calling thread has redone in this process because the helper thread
    that held them had not finished (``csrc/thread_pool.h``); 0 where the kernels are not loaded."""
    return int(_ops().redone_items()) if _state["loaded"] else 0


def helped_items() -> int:
    """How many work items of those kernels helper threads have computed and committed in this process; 0 where the
    kernels are not loaded."""
    return int(_ops().helped_items()) if _state["loaded"] else 0
