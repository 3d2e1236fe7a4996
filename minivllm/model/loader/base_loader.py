"""What every model loader does (vLLM: ``vllm/model_executor/model_loader/base_loader.py``)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from minivllm.config import LoadConfig, ModelConfig
from minivllm.model.llama import LlamaForCausalLM


class BaseModelLoader(ABC):
    """Builds a ``LlamaForCausalLM`` for a ``ModelConfig`` and fills its weights one way (one subclass per
    ``LoadConfig.load_format``). Nothing is ever downloaded: the model is a path on disk or a built-in config."""

    def __init__(self, load_config: LoadConfig) -> None:
        self.load_config = load_config

    @abstractmethod
    def load_model(self, model_config: ModelConfig, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
        """The model with its weights, in ``dtype`` on ``device``, in eval mode."""
