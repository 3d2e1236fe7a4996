"""Llama-shaped models with seeded random weights, the same in minivllm and in Hugging Face transformers.

For checks where the real weights cannot travel (the GPU check: at most 64 MiB of files go with a run, the
SmolLM2 GGUF is 98 MB, and the GPU machine has no ``gguf`` package): the architecture is what matters for
token equality and speed, not what the weights say.

* ``SMOLLM2_135M``: SmolLM2-135M's shape (30 layers, hidden 576, 9 query / 3 KV heads, intermediate 1536,
  vocab 49152, tied embeddings, RoPE theta 100000).
* ``LLAMA_1B``: Llama-3.2-1B's shape (16 layers, hidden 2048, 32 / 8 heads, intermediate 8192, vocab 128256,
  tied), for the memory-bandwidth-bound regime of batch-1 decode.
* ``TINY``: two small layers for dry runs on the CPU.

``build_hf_random_model`` draws the weights in a ``transformers.LlamaForCausalLM``; ``save_and_load`` writes it
with ``save_pretrained`` and reads it back through minivllm's own Hugging Face loader
(``minivllm.model.loader.load_model``), so the loader's conversion (fused ``qkv_proj`` / ``gate_up_proj``) is
part of what the equality check checks.
"""

from __future__ import annotations

import json
import os
from typing import Dict

import torch

EMBED_STD = 0.05  # see randomize_

SMOLLM2_135M: Dict = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
                          max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=1e-5)
LLAMA_1B: Dict = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                      max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=1e-5)
TINY: Dict = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rope_theta=100000.0,
                  max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-5)


def num_params(shape: Dict) -> int:
    """Parameters of a Llama of this shape (embedding counted once when tied)."""
    h, i, v, n = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"], shape["num_hidden_layers"]
    d = h // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
    return n * per_layer + h + v * h * (1 if shape["tie_word_embeddings"] else 2)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter with seeded random values: embeddings ``N(0, EMBED_STD^2)``, norm weights
    ``1 + 0.1 N(0, 1)``, linear weights ``N(0, 1 / fan_in)``.

    The scales keep greedy decoding meaningful. Linear weights of ``N(0, 1 / fan_in)`` make every layer add to
    the residual stream about as much as it holds, so the next token depends on the context. With tied embeddings
    the logit of token ``t`` is ``<norm(h), E_t>`` and ``h`` contains the last token's own embedding: with large
    embeddings that term wins and the model repeats its last token, so two implementations would agree for a
    trivial reason. Measured on SmolLM2's shape, 4 prompts x 24 greedy tokens in float32 (the fraction of tokens
    equal to the previous one; the median and smallest gap between the top two logits): embeddings of standard
    deviation 0.2: 0.82 repeated (32 tokens); 0.1: 0.52; 0.05: 0.22, median gap 0.19, smallest 0.004, far
    above float32 rounding differences (about 1e-5). Hence ``EMBED_STD = 0.05``.
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            value = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        elif "embed_tokens" in name:
            value = EMBED_STD * torch.randn(p.shape, generator=g)
        else:
            value = torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5
        p.copy_(value.to(p.dtype))


def build_hf_random_model(shape: Dict, seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu"):
    """A ``transformers.LlamaForCausalLM`` of ``shape`` with ``randomize_``'s weights, eval mode, no EOS (so that
    ``generate`` stops at ``max_new_tokens`` only). The weights are drawn on the CPU (the same on every machine),
    then moved to ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(shape)
    # transformers 5's spelling of the RoPE base (as minivllm.bench.hf_peer writes it).
    rope = {"rope_type": "default", "rope_theta": kw.pop("rope_theta")}
    config = LlamaConfig(**kw, rope_parameters=rope, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    randomize_(model, seed)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model.to(device=device, dtype=dtype).eval()


def save_and_load(hf_model, folder: str, dtype: torch.dtype = torch.float32, device="cpu"):
    """``hf_model.save_pretrained(folder)`` (safetensors), then minivllm's ``load_model(folder)``.

    transformers 5 writes the RoPE base inside ``config.json``'s ``rope_parameters``, transformers 4 at the top
    level; a loader that read only the latter would silently use 10000 and every token after the first few would
    differ. The loaded value is checked against the saved one.

    Raises:
        RuntimeError: if minivllm's model does not end up with the Hugging Face model's RoPE theta.
    """
    from minivllm.model.loader import load_model

    hf_model.save_pretrained(folder, safe_serialization=True)
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta"))
    model = load_model(folder, dtype=dtype, device=device)
    if theta is not None and abs(model.config.rope_theta - float(theta)) > 1e-6:
        raise RuntimeError(f"minivllm loaded rope_theta={model.config.rope_theta}, config.json has {theta}")
    return model


def build_minivllm_random_model(shape: Dict, seed: int = 0, dtype: torch.dtype = torch.bfloat16, device="cpu"):
    """A minivllm ``LlamaForCausalLM`` of ``shape`` with random weights drawn directly on ``device`` (a 1B model
    in float32 on the CPU would take minutes): for speed measurements only, where no other implementation needs
    the same weights drawn the same way (``hf_model_from_minivllm`` copies them)."""
    from minivllm.model.llama import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, bos_token_id=None, eos_token_id=None, name="random-llama")
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g, device=device))
            elif "embed_tokens" in name:
                p.copy_(EMBED_STD * torch.randn(p.shape, generator=g, device=device))
            else:
                p.copy_(torch.randn(p.shape, generator=g, device=device) / p.shape[1] ** 0.5)
    return model.eval()
