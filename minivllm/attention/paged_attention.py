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
* ``paged_attention``: decodes in batched matmuls (a few groups of similar length); prefill chunks with PyTorch
  SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.nn.functional as F

from minivllm import custom_ops


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
        decode_token_idx / decode_block_table / decode_key_mask: all decode requests as one padded batch
            (``int64 [R]`` rows, ``int64 [R, nblk]`` blocks, ``bool [R, 1, 1, nblk * block_size]`` or ``[R, L]``,
            True for keys past ``seq_len``).
        decode_groups: the decode requests split into groups of similar length (``DecodeGroup``), so that less
            padding is gathered; ``None`` means one group made of the three fields above.
        decode_seq_lens: ``int64 [R]`` keys of each decode request, set when the step runs the CPU kernel
            ``custom_ops.paged_attention_decode`` (which needs no mask, groups or workspace).
        prefill_kernel_args: ``(block_table [P, nblk], query_start [P], query_lens [P], context_lens [P])`` of the
            prefill requests, set when the step runs ``custom_ops.paged_attention_prefill``.
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
    decode_groups: Optional[List["DecodeGroup"]] = None
    # Gather buffer of the decode path: allocated by the first layer, reused by the others.
    decode_workspace: Optional[torch.Tensor] = None
    decode_seq_lens: Optional[torch.Tensor] = None
    prefill_kernel_args: Optional[tuple] = None

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    def get_decode_groups(self) -> List["DecodeGroup"]:
        """``decode_groups``, or the whole decode batch as one group."""
        if self.decode_groups is None:
            self.decode_groups = [DecodeGroup(self.decode_token_idx, self.decode_block_table, self.decode_key_mask)]
        return self.decode_groups


@dataclass
class DecodeGroup:
    """Decode requests attended together, keys padded to the group's longest request.

    Attributes:
        token_idx: ``int64 [R]`` rows of these requests' query tokens in the flattened batch.
        block_table: ``int64 [R, nblk]`` their block ids (padding ids point anywhere; those keys are masked).
        key_mask: ``bool`` with ``R * nblk * block_size`` elements, True for keys past the request's ``seq_len``.
        kv_rows: ``decode_kv_rows`` of the group, built by the first layer and reused by the others.
    """

    token_idx: torch.Tensor
    block_table: torch.Tensor
    key_mask: torch.Tensor
    kv_rows: Optional[torch.Tensor] = None


def split_decode_groups(seq_lens: List[int], max_groups: int = 4, min_group_size: int = 16) -> List[List[int]]:
    """Split decode requests into at most ``max_groups`` groups of similar ``seq_lens`` (each at least
    ``min_group_size`` requests, so a few long ones do not make everyone gather padding).

    Returns lists of indices into ``seq_lens``, shortest requests first. For 64 contexts of 100-430 tokens,
    padding everyone to the longest gathered 58% more keys than needed; four groups cut that to 14% (see
    ``minivllm/bench/OPTIMISATIONS.md``). vLLM's kernels read each request's own blocks and need no such split.
    """
    n = len(seq_lens)
    k = max(1, min(max_groups, n // min_group_size))
    order = sorted(range(n), key=seq_lens.__getitem__)
    return [order[i * n // k : (i + 1) * n // k] for i in range(k)]


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

    In bfloat16 on the CPU, when the model runner prepared ``md.decode_seq_lens`` (``md.prefill_kernel_args``), the
    decode requests (prefill chunks) run through the C++ kernel ``custom_ops.paged_attention_decode``
    (``paged_attention_prefill``), which reads each request's blocks in place. Otherwise, decode requests (one query token each) are split into groups of similar length (``md.get_decode_groups``);
    each group's keys are gathered into a padded batch and handled by two batched matmuls with a key-length mask
    (``paged_decode_attention``). Each prefill chunk goes through PyTorch's
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
    out = query.new_empty(query.shape)
    # The model runner decided once per step whether the kernels run (it then prepared no mask or groups).
    if md.decode_reqs and md.decode_seq_lens is not None:
        custom_ops.paged_attention_decode(
            out, query, kv_cache, md.decode_block_table, md.decode_seq_lens, md.decode_token_idx, scale
        )
        groups = []
    else:
        groups = md.get_decode_groups() if md.decode_reqs else []
        if len(groups) == 1 and not md.prefill_reqs:
            # Pure decode step: token i is request i's only token, so no row selection is needed.
            return paged_decode_attention(query, kv_cache, groups[0], md, scale)
    for g in groups:
        out[g.token_idx] = paged_decode_attention(query[g.token_idx], kv_cache, g, md, scale)
    if md.prefill_reqs and md.prefill_kernel_args is not None:
        custom_ops.paged_attention_prefill(out, query, kv_cache, *md.prefill_kernel_args, scale)
        return out
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


def paged_decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, group: DecodeGroup, md: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Attention of decode requests (one query token each): all requests and heads of a group in two batched
    matmuls.

    The keys are padded to the group's longest request (``L = nblk * block_size``) and masked by
    ``group.key_mask``. One ``index_select`` gathers K and V head-major (``decode_kv_rows``) into a workspace
    shared by all layers of the step, so ``bmm`` reads contiguous ``[L, head_dim]`` matrices; reading a head out of
    the ``[L, kv_heads, head_dim]`` block layout directly makes ``bmm`` copy it first (see
    ``minivllm/bench/OPTIMISATIONS.md``). Scores and softmax are float32 for every dtype. This is the job of vLLM's
    ``paged_attention_v1`` kernel (``csrc/attention/attention_kernels.cuh``), which reads the blocks in place
    instead of gathering them.

    Args:
        q: ``[R, num_heads, head_dim]``, the group's query rows.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, contiguous.
        group: the group's block table and key mask.
        md: the step's metadata (``block_size``; holds the shared workspace).
        scale: softmax scale.

    Returns:
        ``[R, num_heads, head_dim]`` in ``q``'s dtype.
    """
    r, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    group_size = num_heads // num_kv_heads
    if group.kv_rows is None:
        group.kv_rows = decode_kv_rows(group.block_table, md.block_size, num_kv_heads)
    rows = group.kv_rows
    need = 2 * rows.numel() * head_dim
    ws = md.decode_workspace
    if ws is None or ws.numel() < need or ws.dtype != kv_cache.dtype or ws.device != kv_cache.device:
        ws = md.decode_workspace = kv_cache.new_empty(need)
    kv = ws[:need].view(2, rows.numel(), head_dim)
    flat = kv_cache.view(2, -1, head_dim)
    if kv_cache.device.type == "cpu" and torch.get_num_threads() > 1 and rows.numel() >= 16384:
        # On the CPU, index_select along dim 0 splits the rows over threads; along dim 1 (below) it runs on one
        # thread but is faster there (measured: 1 thread 3.5 vs 2.2 ms, 2 threads 1.6 vs 2.2 ms for 64 requests).
        # A small gather is not worth waking the other threads (a batch-1 step waits for them on a busy machine).
        torch.index_select(flat[0], 0, rows, out=kv[0])
        torch.index_select(flat[1], 0, rows, out=kv[1])
    else:
        torch.index_select(flat, 1, rows, out=kv)
    length = rows.numel() // (num_kv_heads * r)
    k = kv[0].view(num_kv_heads * r, length, head_dim)
    v = kv[1].view(num_kv_heads * r, length, head_dim)
    qh = q.view(r, num_kv_heads, group_size, head_dim).transpose(0, 1).reshape(num_kv_heads * r, group_size, head_dim)
    scores = torch.bmm(qh, k.transpose(1, 2)).float().view(num_kv_heads, r, group_size, length)
    scores.mul_(scale).masked_fill_(group.key_mask.reshape(1, r, 1, length), float("-inf"))
    probs = scores.softmax(-1).to(v.dtype).view(num_kv_heads * r, group_size, length)
    o = torch.bmm(probs, v).view(num_kv_heads, r, group_size, head_dim)
    return o.transpose(0, 1).reshape(r, num_heads, head_dim)
