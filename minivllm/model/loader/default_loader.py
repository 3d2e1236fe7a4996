"""Weights from a Hugging Face folder of ``*.safetensors`` files (vLLM:
``vllm/model_executor/model_loader/default_loader.py``)."""

from __future__ import annotations

import os
from typing import Dict

import torch

from minivllm.config import ModelConfig
from minivllm.model.config import LlamaConfig
from minivllm.model.llama import LlamaForCausalLM
from minivllm.model.loader.base_loader import BaseModelLoader


def read_safetensors_weights(path: str, config: LlamaConfig) -> Dict[str, torch.Tensor]:
    """The ``*.safetensors`` tensors of a Hugging Face Llama folder as float32 weights in minivllm's fused layout
    (q/k/v stacked into ``qkv_proj``, gate/up into ``gate_up_proj``, as vLLM's ``stacked_params_mapping``).

    Raises:
        ValueError: if the folder has no ``.safetensors`` file.
        KeyError: naming a tensor that ``config`` expects and the files lack.
    """
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"model: no .safetensors files in {path}")
    raw: Dict[str, torch.Tensor] = {}
    for f in files:
        raw.update(load_file(os.path.join(path, f)))
    sd = {
        "model.embed_tokens.weight": raw["model.embed_tokens.weight"].float(),
        "model.norm.weight": raw["model.norm.weight"].float(),
    }
    if not config.tie_word_embeddings:
        sd["lm_head.weight"] = raw["lm_head.weight"].float()
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        sd[a + "qkv_proj.weight"] = torch.cat(
            [raw[a + "q_proj.weight"], raw[a + "k_proj.weight"], raw[a + "v_proj.weight"]]).float()
        sd[a + "o_proj.weight"] = raw[a + "o_proj.weight"].float()
        sd[m + "gate_up_proj.weight"] = torch.cat([raw[m + "gate_proj.weight"], raw[m + "up_proj.weight"]]).float()
        sd[m + "down_proj.weight"] = raw[m + "down_proj.weight"].float()
        sd[p + "input_layernorm.weight"] = raw[p + "input_layernorm.weight"].float()
        sd[p + "post_attention_layernorm.weight"] = raw[p + "post_attention_layernorm.weight"].float()
    return sd


class DefaultModelLoader(BaseModelLoader):
    """``load_format="safetensors"``: built on the meta device, then takes the folder's tensors as parameters."""

    def load_model(self, model_config: ModelConfig, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
        weights = read_safetensors_weights(model_config.model, model_config.hf_config)
        with torch.device("meta"):
            model = LlamaForCausalLM(model_config.hf_config)
        model.load_weights(weights)
        return model.to(device=device, dtype=dtype).eval()
