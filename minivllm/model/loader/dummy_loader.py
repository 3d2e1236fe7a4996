"""Random weights for a given architecture (vLLM: ``vllm/model_executor/model_loader/dummy_loader.py``,
``load_format="dummy"``): the built-in ``"tiny"`` model, or any model's shape without reading its weights."""

from __future__ import annotations

from typing import Optional

import torch

from minivllm import custom_ops
from minivllm.config import ModelConfig
from minivllm.distributed.parallel_state import full_model_view, get_tensor_model_parallel_world_size
from minivllm.model.config import LlamaConfig, tiny_llama_config
from minivllm.model.llama import LlamaForCausalLM
from minivllm.model.loader.base_loader import BaseModelLoader


def initialize_dummy_weights(model: LlamaForCausalLM, seed: int = 0) -> None:
    """Overwrite every parameter of ``model`` with seeded random values, in ``named_parameters()`` order.

    Norm weights ``1 + 0.1 N(0, 1)``, embeddings ``N(0, 1)``, matrices ``N(0, 1) / sqrt(in_features)``. vLLM fills
    ``U(-1e-3, 1e-3)`` (``weight_utils.initialize_dummy_weights``), which only needs the shapes for timing; here the
    scale keeps logits well separated, so greedy decoding is stable under the float rounding differences between
    chunked and unchunked prefill and the course's dummy-model runs give the same tokens either way. The order and
    the draws are fixed: notebooks print results of this model.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)


class DummyModelLoader(BaseModelLoader):
    """``load_format="dummy"``: ``model_config.hf_config``'s architecture with ``initialize_dummy_weights``
    (seed ``load_config.seed``). Built in float32 on the CPU, then cast and moved, so the weights of one seed are
    the same for every dtype and device."""

    def load_model(self, model_config: ModelConfig, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
        if get_tensor_model_parallel_world_size() == 1:
            return build_tiny_model(model_config.hf_config, self.load_config.seed, dtype).to(device)
        # A tensor-parallel rank: draw the whole model's weights exactly as one device does, then keep this
        # rank's share (load_weights shards), so every N gives the same model.
        with full_model_view():
            weights = build_tiny_model(model_config.hf_config, self.load_config.seed).state_dict()
        with torch.device("meta"):
            model = LlamaForCausalLM(model_config.hf_config)
        model.load_weights(weights)
        return model.to(device=device, dtype=dtype).eval()


def build_tiny_model(config: Optional[LlamaConfig] = None, seed: int = 0, dtype=torch.float32) -> LlamaForCausalLM:
    """A Llama of ``config`` (default: the built-in ``tiny_llama_config()``) with dummy weights of ``seed``, in
    ``dtype`` on the CPU, eval mode. ``LLMEngine("tiny")`` runs ``build_tiny_model()``."""
    model = LlamaForCausalLM(config or tiny_llama_config())
    initialize_dummy_weights(model, seed)
    model = model.to(dtype).eval()
    model.set_custom_op_dispatch("cpu", custom_ops.use_cpu_kernels("cpu", dtype))  # after .to: it reads the dtype
    return model
