"""Paged attention over a flattened (varlen) batch (PagedAttention, Kwon et al., SOSP 2023, section 4.1).

The KV cache of one layer is one tensor ``kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]``
(``[0]`` keys, ``[1]`` values: vLLM's FlashAttention layout). A token at position ``p`` of a request lives at
*slot* ``block_table[p // block_size] * block_size + p % block_size``. Each forward pass first writes the new
tokens' K/V at their slots (``write_kv_cache``, vLLM ``reshape_and_cache_flash``), then every query token
attends to keys ``0 .. its own position`` of its request, read back through the block table. For a prefill
chunk that is all earlier chunks' KV plus the causal part of the chunk itself: a causal mask whose diagonal is
shifted by the context length (bottom-right aligned). ``F.scaled_dot_product_attention(is_causal=True)`` is
top-left aligned, so it is only right when the context length is 0.

Two implementations compute the same thing:

* ``reference_paged_attention``: one request at a time, explicit gather and mask; the one to read.
* ``paged_attention``: decodes of all requests in one batched matmul; prefill chunks with PyTorch SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, shared by all layers (vLLM ``FlashAttentionMetadata``).

    Attributes:
        query_start_loc: ``int64 [num_reqs + 1]``; request ``i``'s query tokens are rows
            ``query_start_loc[i] : query_start_loc[i+1]`` of the flattened batch.
        seq_lens: ``int64 [num_reqs]``; context + this step's tokens, i.e. keys each request attends to.
        num_computed_tokens: ``int64 [num_reqs]``; context length (tokens already in the cache before this step).
        block_table: ``int64 [num_reqs, max_num_blocks]``; block ids per request, padded with 0.
        slot_mapping: ``int64 [num_tokens]``; cache slot of every query token.
        positions: ``int64 [num_tokens]``; absolute position of every query token.
        block_size: tokens per block.
        query_lens / seq_lens_list / computed_list: the same numbers as Python lists (for per-request loops
            without device synchronisation).
        decode_reqs: indices of requests with exactly one query token (batched together).
        prefill_reqs: indices of requests with more than one query token.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    num_computed_tokens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    block_size: int
    query_lens: List[int]
    seq_lens_list: List[int]
    computed_list: List[int]
    query_start_list: List[int]
    decode_reqs: List[int] = field(default_factory=list)
    prefill_reqs: List[int] = field(default_factory=list)
    # Cached tensors for the batched decode path (built once per step, reused by every layer).
    decode_token_idx: Optional[torch.Tensor] = None
    decode_block_table: Optional[torch.Tensor] = None
    decode_key_mask: Optional[torch.Tensor] = None

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)


def compute_slot_mapping(block_table_row: List[int], positions: List[int], block_size: int) -> List[int]:
    """Cache slots of ``positions`` for one request: ``block_table[p // block_size] * block_size + p % block_size``.

    Raises ``IndexError`` if a position lies past the blocks in ``block_table_row``.
    """
    return [block_table_row[p // block_size] * block_size + p % block_size for p in positions]


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
    _, _, bs, h, d = kv_cache.shape
    nblk = -(-seq_len // bs)
    k = kv_cache[0, block_ids[:nblk]].reshape(nblk * bs, h, d)[:seq_len]
    v = kv_cache[1, block_ids[:nblk]].reshape(nblk * bs, h, d)[:seq_len]
    return k, v


def chunk_causal_mask(num_computed: int, query_len: int, device=None) -> torch.Tensor:
    """``bool [query_len, num_computed + query_len]``: query row ``i`` (position ``num_computed + i``) may see
    keys ``0 .. num_computed + i``. The diagonal is shifted right by ``num_computed`` (bottom-right aligned)."""
    q_pos = torch.arange(num_computed, num_computed + query_len, device=device)
    k_pos = torch.arange(num_computed + query_len, device=device)
    return k_pos[None, :] <= q_pos[:, None]


def reference_paged_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Attention for every request of the batch, one request at a time, written for reading.

    Args:
        query: ``[num_tokens, num_heads, head_dim]``.
        kv_cache: the layer's cache, already holding this step's keys and values.
        md: the step's metadata.
        scale: ``1 / sqrt(head_dim)``.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``query``'s dtype (computed in float32).
    """
    out = torch.empty_like(query)
    num_heads = query.shape[1]
    for i in range(md.num_reqs):
        s, q_len, ctx = md.query_start_list[i], md.query_lens[i], md.computed_list[i]
        k, v = gather_kv(kv_cache, md.block_table[i], ctx + q_len)
        group = num_heads // k.shape[1]
        k = k.repeat_interleave(group, dim=1).float()  # grouped-query attention: share each KV head
        v = v.repeat_interleave(group, dim=1).float()
        q = query[s : s + q_len].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        scores = scores.masked_fill(~chunk_causal_mask(ctx, q_len, query.device), float("-inf"))
        out[s : s + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(query.dtype)
    return out


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """The fast path: equal to ``reference_paged_attention`` up to float rounding.

    Decode requests (one query token each) are gathered into a padded ``[R, kv_heads, L, head_dim]`` batch and
    handled by two batched matmuls with a key-length mask. Each prefill chunk goes through PyTorch's
    ``scaled_dot_product_attention``: with ``is_causal=True`` straight on this step's keys when the chunk has no
    context (then top-left and bottom-right alignment coincide), otherwise on keys gathered through the block
    table with the shifted causal mask.

    Args:
        query: ``[num_tokens, num_heads, head_dim]``.
        key, value: this step's ``[num_tokens, num_kv_heads, head_dim]`` (already written to ``kv_cache``).
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
        md: the step's metadata.
        scale: softmax scale.

    Returns:
        ``[num_tokens, num_heads, head_dim]``.
    """
    out = torch.empty_like(query)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    if md.decode_reqs:
        tok = md.decode_token_idx
        r = tok.shape[0]
        bt = md.decode_block_table  # [R, nblk]
        nblk = bt.shape[1]
        k = kv_cache[0, bt].view(r, nblk * md.block_size, num_kv_heads, head_dim).transpose(1, 2)
        v = kv_cache[1, bt].view(r, nblk * md.block_size, num_kv_heads, head_dim).transpose(1, 2)
        q = query[tok].view(r, num_kv_heads, group, head_dim)
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [R, kv_heads, group, L]
        scores.masked_fill_(md.decode_key_mask, float("-inf"))
        probs = scores.softmax(-1).to(v.dtype)
        out[tok] = torch.matmul(probs, v).view(r, num_heads, head_dim)
    for i in md.prefill_reqs:
        s, q_len, ctx = md.query_start_list[i], md.query_lens[i], md.computed_list[i]
        q = query[s : s + q_len].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        if ctx == 0:
            k = key[s : s + q_len].transpose(0, 1).unsqueeze(0)
            v = value[s : s + q_len].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            k, v = gather_kv(kv_cache, md.block_table[i], ctx + q_len)
            k = k.transpose(0, 1).unsqueeze(0)
            v = v.transpose(0, 1).unsqueeze(0)
            mask = chunk_causal_mask(ctx, q_len, query.device)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[s : s + q_len] = o.squeeze(0).transpose(0, 1)
    return out
