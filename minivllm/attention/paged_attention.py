"""The PyTorch building blocks of paged attention (PagedAttention, Kwon et al., SOSP 2023, section 4.1).

The KV cache of one layer is one tensor ``kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]``
(``[0]`` keys, ``[1]`` values: vLLM's FlashAttention layout). A token at position ``p`` of a request lives at
*slot* ``block_table[p // block_size] * block_size + p % block_size`` (``minivllm.worker.block_table``). Each
forward pass first writes the new tokens' K/V at their slots (``write_kv_cache``, vLLM
``reshape_and_cache_flash``), then every query token attends to keys ``0 .. its own position`` of its request,
read back through the block table. For a prefill chunk that is all earlier chunks' KV plus the causal part of the
chunk itself: a causal mask whose diagonal is shifted by the context length (bottom-right aligned,
``chunk_causal_mask``). ``F.scaled_dot_product_attention(is_causal=True)`` is top-left aligned, so it is only
right when the context length is 0.

The backends in ``minivllm/attention/backends/`` are built from these functions; they look
``chunk_causal_mask`` up in this module at every call, so a notebook can replace it (``mock.patch.object``) and
watch the engine's output change.
"""

from __future__ import annotations

import torch


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store this step's keys and values at their slots (vLLM ``reshape_and_cache_flash``).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, same dtype.
        slot_mapping: ``int64 [num_tokens]``.
    """
    _, nb, bs, h, d = kv_cache.shape
    flat = kv_cache.view(2, nb * bs, h, d)
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


def gather_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int):
    """Read one request's first ``seq_len`` keys and values back through its block table.

    Returns ``(k, v)``, each ``[seq_len, num_kv_heads, head_dim]`` (a copy).
    """
    _, nb, bs, h, d = kv_cache.shape
    nblk = -(-seq_len // bs)
    # index_select on a [2, num_blocks, block_bytes] view copies whole blocks; indexing the 5-d tensor
    # (kv_cache[0, ids]) copies element by element and was 5x slower.
    kv = kv_cache.view(2, nb, bs * h * d).index_select(1, block_ids[:nblk]).view(2, nblk * bs, h, d)
    return kv[0, :seq_len], kv[1, :seq_len]


def decode_kv_rows(block_table: torch.Tensor, block_size: int, num_kv_heads: int) -> torch.Tensor:
    """Row ids of a padded decode batch in the cache seen as rows of ``head_dim`` values.

    With ``kv_cache[k_or_v]`` viewed as ``[num_blocks * block_size * num_kv_heads, head_dim]``, key ``l`` of
    request ``r`` for KV head ``h`` is row ``slot(r, l) * num_kv_heads + h``. Listing the rows head-major
    (``[h, r, l]``) lets one ``index_select`` return every head's keys as one contiguous ``[L, head_dim]``
    matrix per (head, request), which is the layout batched matmul wants.

    Args:
        block_table: ``int64 [R, nblk]`` block ids of the decode requests (padding ids are masked later).
        block_size: tokens per block.
        num_kv_heads: KV heads per layer.

    Returns:
        ``int64 [num_kv_heads * R * nblk * block_size]``.
    """
    r, nblk = block_table.shape
    offsets = torch.arange(block_size, device=block_table.device)
    slots = (block_table[:, :, None] * block_size + offsets).reshape(r, nblk * block_size)
    heads = torch.arange(num_kv_heads, device=block_table.device)
    return (slots[None] * num_kv_heads + heads[:, None, None]).reshape(-1)


def chunk_causal_mask(num_computed: int, query_len: int, device=None) -> torch.Tensor:
    """``bool [query_len, num_computed + query_len]``: query row ``i`` (position ``num_computed + i``) may see
    keys ``0 .. num_computed + i``. The diagonal is shifted right by ``num_computed`` (bottom-right aligned)."""
    q_pos = torch.arange(num_computed, num_computed + query_len, device=device)
    k_pos = torch.arange(num_computed + query_len, device=device)
    return k_pos[None, :] <= q_pos[:, None]


