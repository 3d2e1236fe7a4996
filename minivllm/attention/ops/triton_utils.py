"""What the Triton kernels of ``minivllm.attention.ops`` share: the interpreter test and input checks.

**Interpreter.** With ``TRITON_INTERPRET=1`` Triton runs a kernel on CPU tensors with NumPy, one program instance
at a time, instead of compiling it for a GPU. The variable is read by the ``@triton.jit`` decorator, i.e. when a
kernel module is *imported* (and ``triton.language``'s own helpers are decorated when ``triton`` is first
imported): kernels imported without it are compiled kernels for good, and setting the variable later changes
nothing. So the launch code asks the kernel object itself which kind it is (``is_interpreted``), not the
environment, and the variable must be set before the process first imports ``triton``
(``triton_language_interpreted``).

**bfloat16 under the interpreter.** NumPy has no bfloat16; with triton 3.9 a ``tl.dot`` of bfloat16 tiles runs
without error and returns garbage (errors of 1e10), while float32 and float16 are exact. The attention entry point
therefore refuses bfloat16 when interpreted (``check_interpreter_dtype``); bfloat16 is checked on a GPU only.
"""

from __future__ import annotations

from typing import Iterable

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def is_interpreted(kernel) -> bool:
    """True when ``kernel`` (a ``@triton.jit`` function) was built by the interpreter (``TRITON_INTERPRET=1`` at
    import time of its module): it then runs on CPU tensors; otherwise it is compiled and needs CUDA tensors."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def check_device(kernel, **tensors: torch.Tensor) -> None:
    """Interpreted kernels take CPU tensors, compiled ones CUDA tensors, all on one device.

    Raises:
        ValueError: naming the first tensor on the wrong device.
    """
    check_interpreter_consistent(kernel)
    interpreted = is_interpreted(kernel)
    first = None
    for name, t in tensors.items():
        if interpreted and t.device.type != "cpu":
            raise ValueError(f"{name}: the kernels were imported under TRITON_INTERPRET=1 and run on CPU tensors, "
                             f"{name} is on {t.device}")
        if not interpreted and t.device.type != "cuda":
            raise ValueError(f"{name}: compiled Triton kernels need CUDA tensors, {name} is on {t.device} "
                             "(TRITON_INTERPRET=1, set before the process imports triton, runs them on the CPU)")
        if first is None:
            first = (name, t.device)
        elif t.device != first[1]:
            raise ValueError(f"{name} is on {t.device} but {first[0]} is on {first[1]}")


def check_interpreter_dtype(kernel, name: str, dtype: torch.dtype) -> None:
    """Raises ``ValueError`` for bfloat16 under the interpreter, where ``tl.dot`` returns garbage (see above)."""
    if dtype == torch.bfloat16 and is_interpreted(kernel):
        raise ValueError(f"{name}: bfloat16 is not supported under TRITON_INTERPRET=1 (the interpreter's tl.dot of "
                         "bfloat16 tiles returns wrong values); use float32 or float16 on the CPU, bfloat16 on a GPU")


def check_index_tensor(name: str, t: torch.Tensor, ndim: int) -> None:
    """Raises ``ValueError`` unless ``t`` is an int32/int64 tensor with ``ndim`` dimensions."""
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(t.shape)}")


def check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    """The kernels step along ``head_dim`` with stride 1. Raises ``ValueError`` naming the tensor otherwise."""
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension (stride 1), got strides {t.stride()}")


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def same_dtype(names_and_tensors: Iterable) -> torch.dtype:
    """The common dtype of ``(name, tensor)`` pairs, one of ``SUPPORTED_DTYPES``.

    Raises:
        ValueError: for an unsupported dtype or a mismatch, naming the tensor.
    """
    dtype = None
    first = None
    for name, t in names_and_tensors:
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name}: dtype must be float32, float16 or bfloat16, got {t.dtype}")
        if dtype is None:
            dtype, first = t.dtype, name
        elif t.dtype != dtype:
            raise ValueError(f"{name} is {t.dtype} but {first} is {dtype}: all must have one dtype")
    return dtype


def triton_language_interpreted() -> bool:
    """True when ``triton`` itself was first imported under ``TRITON_INTERPRET=1``.

    ``triton.language``'s own helpers (``tl.max``, ``tl.sum``, ``tl.cdiv``, ``tl.zeros``) are ``@triton.jit``
    functions too, decorated when ``triton`` is first imported. An interpreted kernel that calls them needs them
    interpreted as well ("Cannot call @triton.jit'd outside of the scope of a kernel" otherwise), and Triton's
    later imports (``triton.experimental.gluon``) assert the mode has not changed. So interpretation is decided
    once per process, before the first ``import triton``, which ``torch._dynamo`` (imported by transformers'
    models) also performs when Triton is installed.
    """
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.cdiv, InterpretedFunction)


def check_interpreter_consistent(kernel) -> None:
    """Raises ``RuntimeError`` with the fix when ``kernel`` is interpreted but ``triton`` was imported compiled."""
    if is_interpreted(kernel) and not triton_language_interpreted():
        raise RuntimeError("the kernels were imported under TRITON_INTERPRET=1 but triton itself was imported "
                           "before the variable was set (torch._dynamo imports it too): set TRITON_INTERPRET=1 "
                           "in the environment before the process imports torch or triton")


def interpreter_problem() -> str | None:
    """Why this Triton's interpreter cannot run the kernels here, or ``None``.

    Triton 3.6's interpreter turns a loop bound (``range(tile_lo, tile_hi)`` on loaded values) into a Python int
    with ``int()`` of a one-element NumPy array, which recent NumPy refuses ("only 0-dimensional arrays can be
    converted to Python scalars", seen with NumPy 2.4); triton 3.7 squeezes the array first. Compiled kernels are
    not affected.
    """
    import triton

    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    if (major, minor) < (3, 7):
        import numpy

        return (f"triton {triton.__version__}'s interpreter fails with NumPy {numpy.__version__} (int() of a "
                "one-element array); triton >= 3.7 runs the interpreter tests")
    return None
