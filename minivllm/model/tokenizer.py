"""Tokenizer loading (transformers builds a fast tokenizer from GGUF metadata or from a model folder).

Building the tokenizer from a GGUF takes about 5 s, so the result is saved under ``~/.cache/minivllm/tokenizers``
(or ``$MINIVLLM_CACHE``) and later loads take well under a second. Nothing is downloaded: every
``from_pretrained`` call passes ``local_files_only=True``.
"""

from __future__ import annotations

import hashlib
import os

from minivllm import envs


def _cache_dir(model_path: str) -> str:
    st = os.stat(model_path)
    key = hashlib.sha256(f"{os.path.abspath(model_path)}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:16]
    root = envs.MINIVLLM_CACHE
    return os.path.join(root, "tokenizers", key)


def load_tokenizer(model_path: str):
    """Return a ``transformers`` fast tokenizer for a ``.gguf`` file or a Hugging Face folder.

    Raises:
        FileNotFoundError: if ``model_path`` does not exist.
    """
    from transformers import AutoTokenizer

    if not os.path.exists(model_path):
        raise FileNotFoundError(f"tokenizer: {model_path} does not exist")
    if not model_path.endswith(".gguf"):
        return AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    cache = _cache_dir(model_path)
    if os.path.exists(os.path.join(cache, "tokenizer.json")):
        try:
            return AutoTokenizer.from_pretrained(cache, local_files_only=True)
        except Exception:  # a broken cache is rebuilt below
            pass
    tok = AutoTokenizer.from_pretrained(os.path.dirname(model_path), gguf_file=os.path.basename(model_path),
                                        local_files_only=True)
    try:
        os.makedirs(cache, exist_ok=True)
        tok.save_pretrained(cache)
    except OSError:
        pass  # a read-only home only costs the 5 s next time
    return tok


def apply_chat_template(tokenizer, messages, add_generation_prompt: bool = True) -> list:
    """Token ids of ``messages`` (a list of ``{"role", "content"}``) rendered with the model's chat template."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)

