"""Every environment variable minivllm reads, in one place (vLLM: ``vllm/envs.py``).

Each variable is read when it is accessed (``envs.MINIVLLM_CPU_KERNELS``), not at import: a notebook or test that
sets one before building an engine gets its value, as in vLLM. Nothing here writes to ``os.environ``.

* ``MINIVLLM_CPU_KERNELS`` (default ``1``): ``0`` keeps bfloat16 on the CPU on PyTorch operators instead of
  minivllm's C++ kernels (``minivllm.custom_ops``). Read when a model is loaded and when a model runner is
  built (its attention backend and its ``CustomOp`` layers' implementation), never per call.
* ``MINIVLLM_ONEDNN_PACKING`` (default ``1``): ``0`` turns off the packed oneDNN weights of
  ``minivllm.model.packed_linear`` (read once, when that module is imported).
* ``MINIVLLM_CACHE`` (default ``~/.cache/minivllm``): where the tokenizer files are unpacked.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict


def _flag(name: str, default: str) -> Callable[[], bool]:
    return lambda: os.environ.get(name, default) != "0"


environment_variables: Dict[str, Callable[[], Any]] = {
    "MINIVLLM_CPU_KERNELS": _flag("MINIVLLM_CPU_KERNELS", "1"),
    "MINIVLLM_ONEDNN_PACKING": _flag("MINIVLLM_ONEDNN_PACKING", "1"),
    "MINIVLLM_CACHE": lambda: os.environ.get(
        "MINIVLLM_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "minivllm")
    ),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return list(environment_variables)
