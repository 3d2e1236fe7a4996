"""The model layer's loading paths: load formats, the "tiny" shorthand, RoPE sharing through get_rope, tied heads.

Guards ``minivllm/model/loader/``, ``minivllm/config.py`` (``LoadConfig``) and
``minivllm/model/layers/rotary_embedding.py``. Everything here runs on the tiny architecture or on small
Hugging Face folders written to ``tmp_path``; nothing reads the 135M model.
"""

import dataclasses
import json

import pytest
import torch

from minivllm import LLMEngine, SamplingParams
from minivllm.config import LoadConfig
from minivllm.model.config import tiny_llama_config
from minivllm.model.layers.rotary_embedding import get_rope
from minivllm.model.llama import LlamaForCausalLM
from minivllm.model.loader import (build_tiny_model, create_model_and_load_config, get_model, get_model_loader,
                                   load_model)


def _write_hf_folder(path, model: LlamaForCausalLM, with_weights: bool = True) -> None:
    """Save ``model`` as a Hugging Face Llama checkpoint: config.json and one safetensors file, q/k/v and
    gate/up split back into separate matrices."""
    from safetensors.torch import save_file

    c = model.config
    cfg = {k: v for k, v in dataclasses.asdict(c).items() if k != "name"}
    cfg["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(cfg))
    if not with_weights:
        return
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    out = {}
    for name, w in model.state_dict().items():
        w = w.detach().clone().contiguous()
        if name.endswith("qkv_proj.weight"):
            base = name[: -len("qkv_proj.weight")]
            for part, t in zip(("q", "k", "v"), w.split([q, kv, kv])):
                out[f"{base}{part}_proj.weight"] = t.contiguous()
        elif name.endswith("gate_up_proj.weight"):
            base = name[: -len("gate_up_proj.weight")]
            out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = (t.contiguous() for t in w.chunk(2))
        elif not (name == "lm_head.weight" and c.tie_word_embeddings):
            out[name] = w
    save_file(out, str(path / "model.safetensors"))


def _greedy(engine: LLMEngine, prompt, n: int = 8):
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=n))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out.outputs[0].token_ids


def test_tiny_is_the_builtin_config_with_dummy_weights():
    model_config, load_config = create_model_and_load_config("tiny")
    assert load_config.load_format == "dummy"
    assert model_config.tokenizer is None
    assert model_config.hf_config == tiny_llama_config()
    engine_model = LLMEngine("tiny").model
    reference = build_tiny_model()
    for (name, p), (ref_name, ref) in zip(engine_model.named_parameters(), reference.named_parameters()):
        assert name == ref_name and torch.equal(p, ref), name


def test_load_format_errors_name_the_parameter():
    with pytest.raises(ValueError, match="load_format must be one of"):
        LoadConfig("pt")
    with pytest.raises(ValueError, match="load_format must be one of"):
        LLMEngine("tiny", load_format="bin")
    with pytest.raises(ValueError, match="built-in config without weight files"):
        create_model_and_load_config("tiny", load_format="gguf")
    with pytest.raises(ValueError, match="resolve 'auto'"):
        get_model_loader(LoadConfig("auto"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        create_model_and_load_config("/nonexistent/model.gguf")


def test_every_attention_layer_shares_one_cached_rope():
    model = build_tiny_model()
    ropes = {id(layer.self_attn.rotary_emb) for layer in model.model.layers}
    assert len(ropes) == 1
    cfg = model.config
    assert model.model.layers[0].self_attn.rotary_emb is get_rope(cfg.head_dim, cfg.max_position_embeddings,
                                                                   cfg.rope_theta)
    assert build_tiny_model(seed=1).model.layers[1].self_attn.rotary_emb is model.model.layers[0].self_attn.rotary_emb
    other = build_tiny_model(tiny_llama_config(rope_theta=500000.0))
    assert other.model.layers[0].self_attn.rotary_emb is not model.model.layers[0].self_attn.rotary_emb
    # The shared tables are not shared numbers: another theta gives other angles.
    assert not torch.equal(other.model.layers[0].self_attn.rotary_emb.cos_cache,
                           model.model.layers[0].self_attn.rotary_emb.cos_cache)


@pytest.mark.parametrize("tied", [False, True])
def test_safetensors_folder_round_trip(tmp_path, tied):
    """A tiny model saved in Hugging Face's layout and loaded back gives the same logits and greedy tokens."""
    original = build_tiny_model(tiny_llama_config(tie_word_embeddings=tied), seed=2)
    _write_hf_folder(tmp_path, original)
    loaded = load_model(str(tmp_path))
    assert loaded.config.tie_word_embeddings is tied
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) is tied
    hidden = torch.randn(5, original.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded.compute_logits(hidden), original.compute_logits(hidden))
    prompt = [3, 14, 15, 92, 65, 35]
    assert _greedy(LLMEngine(loaded), prompt) == _greedy(LLMEngine(original), prompt)


def test_dummy_format_with_a_path_reads_only_the_architecture(tmp_path):
    """load_format="dummy" with a folder that has no weights: its config.json's shape with seeded random weights."""
    shape = build_tiny_model(tiny_llama_config(num_hidden_layers=3, intermediate_size=96))
    _write_hf_folder(tmp_path, shape, with_weights=False)
    model_config, load_config = create_model_and_load_config(str(tmp_path), load_format="dummy")
    assert (load_config.load_format, model_config.tokenizer) == ("dummy", str(tmp_path))
    model = get_model(model_config, load_config)
    assert len(model.model.layers) == 3 and model.model.layers[0].mlp.down_proj.in_features == 96
    for (name, p), (_, ref) in zip(model.named_parameters(), shape.named_parameters()):
        assert torch.equal(p, ref), name  # the same seed and draw order as build_tiny_model of that config
    with pytest.raises(ValueError, match="does not match"):
        create_model_and_load_config(str(tmp_path), load_format="gguf")


def test_hf_config_reads_the_rope_base_of_transformers_4_and_5(tmp_path):
    from minivllm.model.config import get_config

    cfg = {k: v for k, v in dataclasses.asdict(tiny_llama_config()).items() if k not in ("name", "rope_theta")}
    cfg["model_type"] = "llama"
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 123456.0}  # transformers 5
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert get_config(str(tmp_path)).rope_theta == 123456.0
    cfg["rope_theta"] = 5000.0  # transformers 4's top-level key
    del cfg["rope_parameters"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert get_config(str(tmp_path)).rope_theta == 5000.0
