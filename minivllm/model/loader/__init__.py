"""Model loaders, one per ``LoadConfig.load_format`` (vLLM: ``vllm/model_executor/model_loader/__init__.py``).

``get_model(model_config, load_config, device, dtype)`` is what the engine calls; ``load_model(path)`` is the
short form for notebooks and scripts. No function here downloads anything.
"""

from __future__ import annotations

from typing import Dict, Optional, Type, Union

import torch

from minivllm.config import LoadConfig, ModelConfig, create_model_and_load_config
from minivllm.model.config import default_model_path, tiny_llama_config
from minivllm.model.llama import LlamaForCausalLM
from minivllm.model.loader.base_loader import BaseModelLoader
from minivllm.model.loader.default_loader import DefaultModelLoader
from minivllm.model.loader.dummy_loader import DummyModelLoader, build_tiny_model
from minivllm.model.loader.gguf_loader import GGUFModelLoader

__all__ = ["BaseModelLoader", "build_tiny_model", "default_model_path", "get_model", "get_model_loader",
           "load_model", "tiny_llama_config"]

_LOAD_FORMAT_TO_MODEL_LOADER: Dict[str, Type[BaseModelLoader]] = {
    "gguf": GGUFModelLoader,
    "safetensors": DefaultModelLoader,
    "dummy": DummyModelLoader,
}


def get_model_loader(load_config: LoadConfig) -> BaseModelLoader:
    """The loader of ``load_config.load_format``.

    Raises:
        ValueError: for ``"auto"`` (``create_model_and_load_config`` resolves it first) or an unknown format.
    """
    cls = _LOAD_FORMAT_TO_MODEL_LOADER.get(load_config.load_format)
    if cls is None:
        raise ValueError(f"load_format {load_config.load_format!r} has no loader; expected one of "
                         f"{sorted(_LOAD_FORMAT_TO_MODEL_LOADER)} (resolve 'auto' with create_model_and_load_config)")
    return cls(load_config)


def get_model(model_config: ModelConfig, load_config: LoadConfig, device: Union[str, torch.device] = "cpu",
              dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """The model of ``model_config`` with weights loaded per ``load_config``, in ``dtype`` on ``device``, eval mode."""
    return get_model_loader(load_config).load_model(model_config, torch.device(device), dtype)


def load_model(path: Optional[str] = None, dtype: torch.dtype = torch.float32, device="cpu",
               load_format: str = "auto") -> LlamaForCausalLM:
    """Load a Llama from ``path`` (a ``.gguf`` file or a Hugging Face folder; default: SmolLM2-135M-Instruct; or a
    built-in name such as ``"tiny"``).

    Args:
        path: model location on disk, ``None`` for the default model, or a built-in name.
        dtype: weight dtype (``torch.float32`` or ``torch.bfloat16``; ``float16`` on CUDA).
        device: ``"cpu"`` or ``"cuda"``.
        load_format: see ``LoadConfig``.

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        ValueError: when the file is not a supported Llama model.
    """
    model_config, load_config = create_model_and_load_config(path, load_format)
    return get_model(model_config, load_config, device, dtype)
