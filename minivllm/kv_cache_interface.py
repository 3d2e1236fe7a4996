"""What one KV cache block holds, and how many blocks fit in a memory budget (vLLM 0.32:
``vllm/v1/kv_cache_interface.py``, ``FullAttentionSpec``; ``vllm/v1/core/kv_cache_utils.py``, ``get_num_blocks``).

Each worker describes its cache with a spec (``Worker.get_kv_cache_spec``); the engine core turns the workers'
available memory into one block count for all of them (``EngineCore._initialize_kv_caches``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FullAttentionSpec:
    """The cache of one full-attention layer, block by block.

    Args:
        block_size: tokens per block.
        num_kv_heads: KV heads this rank holds (a share under tensor parallelism).
        head_size: elements per head.
        dtype_size: bytes per element (4 for float32, 2 for bfloat16).
        num_layers: layers with such a cache.
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype_size: int
    num_layers: int

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block in one layer: K and V, ``block_size x num_kv_heads x head_size`` each."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype_size


def get_num_blocks(available_memory: int, spec: FullAttentionSpec) -> int:
    """Blocks that fit in ``available_memory`` bytes across all layers (vLLM ``get_num_blocks``:
    ``available_memory // page_size // num_layers``), at least 0."""
    return max(int(available_memory // spec.page_size_bytes // spec.num_layers), 0)
