"""minivllm: a small vLLM-style inference engine for teaching (V1 scheduler, paged KV cache, chunked prefill,
preemption, prefix caching), running a real Llama-architecture model on CPU or CUDA.

The public names are loaded lazily (PEP 562 module ``__getattr__``), so that importing a lower layer such as
``minivllm.core.block_pool`` does not pull torch, the model and the engine in through this package's
``__init__``. ``from minivllm import LLM, LLMEngine, SamplingParams`` works as usual.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from minivllm.engine.llm import LLM
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.outputs import CompletionOutput, RequestOutput
    from minivllm.sampling_params import SamplingParams

_LAZY = {
    "LLM": "minivllm.engine.llm",
    "LLMEngine": "minivllm.engine.llm_engine",
    "SamplingParams": "minivllm.sampling_params",
    "RequestOutput": "minivllm.outputs",
    "CompletionOutput": "minivllm.outputs",
}

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    raise AttributeError(f"module 'minivllm' has no attribute {name!r}")


def __dir__() -> list:
    return sorted(list(globals()) + list(_LAZY))
