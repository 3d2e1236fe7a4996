"""Weights from a llama.cpp GGUF file (vLLM: ``vllm/model_executor/model_loader/gguf_loader.py``).

vLLM keeps GGUF weights quantized and multiplies with GGUF kernels; minivllm dequantizes every tensor to float32
once at load time (``gguf.quants.dequantize``), then casts to the engine's dtype.
"""

from __future__ import annotations

from typing import Dict

import numpy as np
import torch

from minivllm.config import ModelConfig
from minivllm.model.config import LlamaConfig, open_gguf, release_gguf
from minivllm.model.llama import LlamaForCausalLM
from minivllm.model.loader.base_loader import BaseModelLoader


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of ``attn_q`` / ``attn_k`` (it interleaves each head's two RoPE halves)."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def read_gguf_weights(path: str, config: LlamaConfig) -> Dict[str, torch.Tensor]:
    """The tensors of a Llama GGUF as float32 weights in minivllm's fused layout (``qkv_proj``, ``gate_up_proj``).

    Raises:
        KeyError: naming a tensor that ``config``'s layer count or head tie expects and the file lacks.
    """
    import gguf

    tensors = {t.name: t for t in open_gguf(path).tensors}

    def get(name: str) -> np.ndarray:
        t = tensors[name]
        return np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)  # a writable copy

    sd: Dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.from_numpy(get("token_embd.weight")),
        "model.norm.weight": torch.from_numpy(get("output_norm.weight")),
    }
    if not config.tie_word_embeddings:
        sd["lm_head.weight"] = torch.from_numpy(get("output.weight"))
    for i in range(config.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        q = _unpermute(get(b + "attn_q.weight"), config.num_attention_heads)
        k = _unpermute(get(b + "attn_k.weight"), config.num_key_value_heads)
        sd[p + "self_attn.qkv_proj.weight"] = torch.from_numpy(np.concatenate([q, k, get(b + "attn_v.weight")]))
        sd[p + "self_attn.o_proj.weight"] = torch.from_numpy(get(b + "attn_output.weight"))
        sd[p + "mlp.gate_up_proj.weight"] = torch.from_numpy(
            np.concatenate([get(b + "ffn_gate.weight"), get(b + "ffn_up.weight")])
        )
        sd[p + "mlp.down_proj.weight"] = torch.from_numpy(get(b + "ffn_down.weight"))
        sd[p + "input_layernorm.weight"] = torch.from_numpy(get(b + "attn_norm.weight"))
        sd[p + "post_attention_layernorm.weight"] = torch.from_numpy(get(b + "ffn_norm.weight"))
    return sd


class GGUFModelLoader(BaseModelLoader):
    """``load_format="gguf"``: the model is built on the meta device (no memory, no random draws), then takes the
    file's dequantized tensors as its parameters."""

    def load_model(self, model_config: ModelConfig, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
        weights = read_gguf_weights(model_config.model, model_config.hf_config)
        release_gguf()  # the parsed reader holds a quarter of a GiB; the config is cached on its own
        with torch.device("meta"):
            model = LlamaForCausalLM(model_config.hf_config)
        model.load_weights(weights)
        return model.to(device=device, dtype=dtype).eval()
