"""The package's own implementation of each exercise of notebooks 01-03, in the learner's signature.

Later cells of 01-03 build on the learner's functions (01's forward pass and generation, 02's cached generation,
03's paged demo). ``use_yours_or_reference`` (in ``_harness.py``) hands those cells the learner's function when it
passes its checker and the function of the same name from this module otherwise, so the notebooks run top to
bottom with the exercises unfilled and show the same results either way. Each function here wraps the code the
checkers take their expected values from (``_reference.py``, ``minivllm.attention.paged_attention``,
``minivllm.worker.block_table``); only ``KVCache`` and ``greedy_generate`` have no counterpart in the engine (the
engine's cache is paged, its loop is ``LLMEngine.step``) and are written here.

Shapes and dtypes are those stated in the exercises' notebook cells and in their checkers' docstrings.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch

from minivllm.attention.paged_attention import gather_kv as _package_gather_kv
from minivllm.attention.paged_attention import write_kv_cache
from minivllm.course.exercises._reference import (
    contiguous_attention,
    layer_from_parts,
    rms_norm_ref,
    rope_ref,
    swiglu_ref,
)
from minivllm.worker.block_table import compute_slot_mapping


# ---- notebook 01 -----------------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: ``x [..., hidden]``, ``weight [hidden]`` -> ``x``'s shape and dtype."""
    return rms_norm_ref(x, weight, eps)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding, Llama's half-split (NeoX) pairing: ``x [T, heads, head_dim]``, ``positions int64 [T]``."""
    return rope_ref(x, positions, theta)


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal grouped-query attention, no context: ``q [T, H, D]``, ``k, v [T, Hkv, D]`` -> ``[T, H, D]``."""
    return contiguous_attention(q, k, v, 0)


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """``(silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T``; ``x [T, hidden]``, weights in ``nn.Linear`` layout."""
    return swiglu_ref(x, w_gate, w_up, w_down)


def decoder_layer(x: torch.Tensor, positions: torch.Tensor, w: dict, cfg) -> torch.Tensor:
    """One Llama decoder layer from the separate weights of ``split_layer_weights``; ``x [T, hidden]``."""
    return layer_from_parts(x, positions, w, cfg)


def greedy_generate(forward: Callable[[List[int]], torch.Tensor], prompt_ids: Sequence[int], max_new_tokens: int,
                    eos_token_id: Optional[int] = None) -> List[int]:
    """Greedy decoding without a cache: ``forward(seq)`` over the whole sequence each step, arg-max of its last
    row; returns only the new tokens, the EOS token included (as vLLM's ``token_ids``)."""
    seq, new = list(prompt_ids), []
    for _ in range(max_new_tokens):
        token = int(forward(seq)[-1].argmax())
        new.append(token)
        seq.append(token)
        if token == eos_token_id:
            break
    return new


# ---- notebook 02 -----------------------------------------------------------------------------------------------
class KVCache:
    """A contiguous KV cache that reserves ``max_model_len`` slots per layer up front (the scheme paging replaces).

    Storage ``[num_layers, 2, max_model_len, num_kv_heads, head_dim]`` in ``dtype``; each layer keeps its own length.
    """

    def __init__(self, num_layers: int, max_model_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32):
        self.max_model_len = max_model_len
        self.kv = torch.zeros(num_layers, 2, max_model_len, num_kv_heads, head_dim, dtype=dtype)
        self.lengths = [0] * num_layers

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v [T, num_kv_heads, head_dim]`` after the layer's tokens; return all of them so far.

        Raises:
            ValueError: if the layer would hold more than ``max_model_len`` tokens (nothing is written).
        """
        start, end = self.lengths[layer], self.lengths[layer] + k.shape[0]
        if end > self.max_model_len:
            raise ValueError(f"cannot hold {end} tokens: max_model_len is {self.max_model_len}")
        self.kv[layer, 0, start:end] = k
        self.kv[layer, 1, start:end] = v
        self.lengths[layer] = end
        return self.kv[layer, 0, :end], self.kv[layer, 1, :end]


def cached_attention(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, num_computed: int) -> torch.Tensor:
    """Attention of ``q [T, H, D]`` (positions ``num_computed ..``) over ``k_all, v_all [num_computed + T, Hkv, D]``."""
    return contiguous_attention(q, k_all, v_all, num_computed)


# ---- notebook 03 -----------------------------------------------------------------------------------------------
def slot_mapping(block_table: Sequence[int], positions: Sequence[int], block_size: int) -> List[int]:
    """Cache slot of each position: ``block_table[p // block_size] * block_size + p % block_size``."""
    return compute_slot_mapping(block_table, positions, block_size)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``k, v [N, Hkv, D]`` into ``kv_cache [2, num_blocks, block_size, Hkv, D]`` at ``slot_mapping [N]``."""
    write_kv_cache(k, v, kv_cache, torch.as_tensor(slot_mapping, dtype=torch.int64))


def gather_kv(kv_cache: torch.Tensor, block_table, seq_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The first ``seq_len`` keys and values of a request, ``[seq_len, Hkv, D]`` each, read through its table."""
    return _package_gather_kv(kv_cache, torch.as_tensor(block_table, dtype=torch.int64), seq_len)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table, num_computed: int) -> torch.Tensor:
    """Attention of ``q [T, H, D]`` over the request's keys and values in the paged ``kv_cache``."""
    k_all, v_all = gather_kv(kv_cache, block_table, num_computed + q.shape[0])
    return contiguous_attention(q, k_all, v_all, num_computed)
