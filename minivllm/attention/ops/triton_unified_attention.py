"""Paged attention of a mixed batch (prefill chunks and decodes) in one Triton kernel.

Over 300 lines on purpose: the two kernels and their launcher share one tiling contract (block sizes, program
ids, segment buffers) that this docstring explains once; vLLM keeps them in one file too.

vLLM: ``vllm/v1/attention/ops/triton_unified_attention.py`` at v0.32.0 (``kernel_unified_attention`` and
``reduce_segments``), the kernel of vLLM's Triton attention backend. This is a shorter version of the same
algorithm, without sliding windows, ALiBi, soft-capping, sinks or fp8/int8 caches. minivllm's readable reference
is ``minivllm.attention.backends.reference.reference_paged_attention``: the results agree with it up to rounding.

**What it computes.** The batch is flattened (varlen): request ``i`` owns query rows
``cu_seqlens_q[i] : cu_seqlens_q[i+1]`` (``query_start_loc`` in minivllm) and has ``seqused_k[i]`` keys
(``seq_lens``: context + this step's tokens, already written to the cache). Its ``q_len`` query tokens sit at
positions ``seq_len - q_len .. seq_len - 1``; a query at position ``p`` sees keys ``0 .. p`` (the causal mask of a
chunk, shifted by its context: bottom-right aligned). A decode is the case ``q_len == 1``: no separate kernel.

**Tiling** (``G`` = query heads per KV head, grouped-query attention):

* One program handles ``BLOCK_Q`` consecutive query tokens of one request and one KV head. Its query tile stacks
  the ``G`` query heads that share this KV head under each token: ``BLOCK_M = BLOCK_Q * G`` rows (rounded up to
  16, ``tl.dot``'s smallest size; spare rows are masked). Row ``m`` is token ``m // G``, head
  ``kv_head * G + m % G``. So a decode (``q_len == 1``) still fills ``G`` rows, and every K/V tile loaded from
  memory serves ``BLOCK_M`` rows: the GQA reuse that makes decode cheaper in memory traffic.
* The program walks the keys in tiles of ``TILE_SIZE`` (32). Key ``j`` is read through the block table in
  place: block ``block_table[i, j // block_size]``, row ``j % block_size``. A tile may span several KV blocks or
  part of one; nothing is gathered into a contiguous copy.
* Online softmax (FlashAttention, Dao et al. 2022, algorithm 1; Milakov & Gimelshein 2018): per row a running
  maximum ``M``, a running sum ``L`` of ``exp(s - M)`` and an unnormalised output ``acc``; when a tile raises the
  maximum, ``L`` and ``acc`` are rescaled by ``exp(M_old - M_new)``. Scores, ``M``, ``L`` and ``acc`` are
  float32 for every input dtype; ``P`` is cast to the value dtype for the second ``tl.dot``.
* Program ids: axis 0 numbers the query blocks of all requests, request ``i``'s starting at
  ``cu_seqlens_q[i] // BLOCK_Q + i`` (an upper bound that needs no host-side prefix sum; some programs find
  themselves past their request's last token and return), found by a binary search in the kernel
  (``find_seq_idx``). Axis 1 is the KV head. Axis 2 is the context segment (below).

**Split over the context** (vLLM's "3D" kernel; FlashDecoding, Dao et al. 2023). A batch of a few long decodes
has few programs (``num_seqs * num_kv_heads``), too few to fill a GPU's 132 SMs, each looping over thousands of
keys. With ``NUM_SEGMENTS > 1`` each program handles only its ``1 / NUM_SEGMENTS`` share of the key tiles and
writes its partial ``acc``, ``M`` and ``L`` to float32 buffers; ``reduce_segments`` then combines them per
(token, head): ``out = sum_s exp(M_s - M) acc_s / sum_s exp(M_s - M) L_s`` with ``M = max_s M_s``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from minivllm.attention.ops.triton_utils import (
    check_device,
    check_index_tensor,
    check_interpreter_dtype,
    check_last_dim_contiguous,
    is_power_of_two,
    same_dtype,
)

TILE_SIZE = 32  # keys per inner-loop step
MAX_SEGMENTS = 16  # vLLM's NUM_PAR_SOFTMAX_SEGMENTS
SEGMENT_KEYS = 256  # auto split: about this many keys per segment at least
SPLIT_BELOW_PROGRAMS = 128  # auto split: only when the batch has fewer programs than this (an H200 has 132 SMs)


@triton.jit
def find_seq_idx(query_start_loc_ptr, q_block_global_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """The request ``i`` whose query blocks contain ``q_block_global_idx``: the largest ``i`` with
    ``query_start_loc[i] // BLOCK_Q + i <= q_block_global_idx`` (binary search)."""
    left = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= q_block_global_idx:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def kernel_unified_attention(
    output_ptr,  # [T, H, D], written when NUM_SEGMENTS == 1
    segm_output_ptr,  # float32 [T, H, NUM_SEGMENTS, D], written when NUM_SEGMENTS > 1
    segm_max_ptr,  # float32 [T, H, NUM_SEGMENTS]
    segm_expsum_ptr,  # float32 [T, H, NUM_SEGMENTS]
    query_ptr,  # [T, H, D]
    key_cache_ptr,  # [num_blocks, block_size, KVH, D]
    value_cache_ptr,  # [num_blocks, block_size, KVH, D]
    block_table_ptr,  # int [num_seqs, max_blocks]
    seq_lens_ptr,  # int [num_seqs]: keys per request (seqused_k)
    query_start_loc_ptr,  # int [num_seqs + 1] (cu_seqlens_q)
    scale,  # softmax scale, float
    num_seqs,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_k_blk,
    stride_k_slot,
    stride_k_head,
    stride_v_blk,
    stride_v_slot,
    stride_v_head,
    stride_bt,
    NUM_QUERY_HEADS: tl.constexpr,
    NUM_QUERIES_PER_KV: tl.constexpr,  # G
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows of the query tile, >= BLOCK_Q * G
    BLOCK_Q: tl.constexpr,  # query tokens per program
    TILE_SIZE: tl.constexpr,  # keys per loop step
    NUM_SEGMENTS: tl.constexpr,  # context segments per request (1: no split)
    IEEE_FP32_DOT: tl.constexpr,  # float32 inputs: full-precision dots, not TF32
):
    q_block_global_idx = tl.program_id(0)
    kv_head_idx = tl.program_id(1)
    segm_idx = tl.program_id(2)

    # --- which request and which of its query tokens -------------------------------------------------------
    seq_idx = find_seq_idx(query_start_loc_ptr, q_block_global_idx, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq_idx)
    q_len = tl.load(query_start_loc_ptr + seq_idx + 1) - q_start
    q_block_local_idx = q_block_global_idx - (q_start // BLOCK_Q + seq_idx)
    if q_block_local_idx * BLOCK_Q >= q_len:
        return  # a spare program of the upper-bound numbering
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    context_len = seq_len - q_len

    # --- the query tile: BLOCK_Q tokens x G heads stacked as BLOCK_M rows --------------------------------------
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_local = q_block_local_idx * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV  # token index within the request
    head = kv_head_idx * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV
    row_valid = (offs_m < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_local < q_len)
    token = (q_start + q_local).to(tl.int64)
    q = tl.load(query_ptr + token[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
                mask=row_valid[:, None], other=0.0)  # [BLOCK_M, D]
    query_pos = context_len + q_local  # absolute position: sees keys 0 .. query_pos

    # --- the key tiles this program visits -------------------------------------------------------------------
    # The block's last token sees the most keys; tiles past it are not read at all.
    num_keys = context_len + tl.minimum((q_block_local_idx + 1) * BLOCK_Q, q_len)
    num_tiles = tl.cdiv(num_keys, TILE_SIZE)
    tiles_per_segment = tl.cdiv(num_tiles, NUM_SEGMENTS)
    tile_lo = segm_idx * tiles_per_segment
    tile_hi = tl.minimum(tile_lo + tiles_per_segment, num_tiles)  # may be <= tile_lo: an empty segment

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max M
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum L
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    offs_t = tl.arange(0, TILE_SIZE)
    for tile in range(tile_lo, tile_hi):
        key_pos = tile * TILE_SIZE + offs_t  # [TILE]
        key_valid = key_pos < num_keys
        # Read through the block table in place: physical block and row of each key.
        block = tl.load(block_table_ptr + seq_idx * stride_bt + key_pos // BLOCK_SIZE, mask=key_valid, other=0)
        block = block.to(tl.int64)
        row = key_pos % BLOCK_SIZE
        k = tl.load(key_cache_ptr + block[:, None] * stride_k_blk + row[:, None] * stride_k_slot
                    + kv_head_idx * stride_k_head + offs_d[None, :], mask=key_valid[:, None], other=0.0)  # [TILE, D]
        v = tl.load(value_cache_ptr + block[:, None] * stride_v_blk + row[:, None] * stride_v_slot
                    + kv_head_idx * stride_v_head + offs_d[None, :], mask=key_valid[:, None], other=0.0)

        if IEEE_FP32_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale  # [BLOCK_M, TILE] float32
        visible = row_valid[:, None] & key_valid[None, :] & (key_pos[None, :] <= query_pos[:, None])
        s = tl.where(visible, s, float("-inf"))

        # Online softmax. A row with no visible key so far keeps M = -inf; subtracting 0 instead of -inf keeps
        # exp() at 0 rather than NaN (exp(-inf - -inf)).
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE_FP32_DOT:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if NUM_SEGMENTS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(output_ptr + token[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :],
                 out.to(output_ptr.dtype.element_ty), mask=row_valid[:, None])
    else:
        # Partial results of this segment; reduce_segments combines them.
        seg_row = (token * NUM_QUERY_HEADS + head) * NUM_SEGMENTS + segm_idx  # [BLOCK_M]
        tl.store(segm_output_ptr + seg_row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_valid[:, None])
        tl.store(segm_max_ptr + seg_row, m_i, mask=row_valid)
        tl.store(segm_expsum_ptr + seg_row, l_i, mask=row_valid)


@triton.jit
def reduce_segments(
    output_ptr,  # [T, H, D]
    segm_output_ptr,  # float32 [T, H, NUM_SEGMENTS, D]
    segm_max_ptr,  # float32 [T, H, NUM_SEGMENTS]
    segm_expsum_ptr,  # float32 [T, H, NUM_SEGMENTS]
    stride_o_tok,
    stride_o_head,
    NUM_QUERY_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    """One program per (token, query head): rescale every segment's partial output to the global maximum and
    normalise once. An empty segment has ``M = -inf`` and ``L = acc = 0`` and weighs ``exp(-inf) = 0``."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SEGMENTS)
    offs_d = tl.arange(0, HEAD_DIM)
    seg_row = (token * NUM_QUERY_HEADS + head) * NUM_SEGMENTS + offs_s
    m_s = tl.load(segm_max_ptr + seg_row)
    l_s = tl.load(segm_expsum_ptr + seg_row)
    m = tl.max(m_s, axis=0)
    w = tl.exp(m_s - m)  # [NUM_SEGMENTS]
    l_total = tl.sum(l_s * w, axis=0)
    acc = tl.load(segm_output_ptr + seg_row[:, None] * HEAD_DIM + offs_d[None, :])  # [NUM_SEGMENTS, D]
    out = tl.sum(acc * w[:, None], axis=0) / l_total
    tl.store(output_ptr + token * stride_o_tok + head * stride_o_head + offs_d, out.to(output_ptr.dtype.element_ty))


def choose_num_segments(num_seqs: int, num_kv_heads: int, max_seqlen_q: int, max_seqlen_k: int) -> int:
    """How many context segments a batch gets (1: no split). Split only pure-decode batches whose programs
    (``num_seqs * num_kv_heads``) are too few to fill the GPU, into ``<= MAX_SEGMENTS`` (a power of two)
    segments of at least ``SEGMENT_KEYS`` keys. vLLM decides the same way with ``seq_threshold_3D`` and
    ``num_par_softmax_segments`` (``vllm/v1/attention/backends/triton_attn.py``)."""
    if max_seqlen_q != 1 or num_seqs * num_kv_heads >= SPLIT_BELOW_PROGRAMS:
        return 1
    n = 1
    while n * 2 <= MAX_SEGMENTS and n * 2 * SEGMENT_KEYS <= max_seqlen_k:
        n *= 2
    return n


def _check_metadata_values(cu_seqlens_q, seqused_k, block_table, num_tokens, max_seqlen_q, max_seqlen_k,
                           num_blocks, block_size) -> None:
    qsl = cu_seqlens_q.tolist()
    lens = seqused_k.tolist()
    if qsl[0] != 0 or qsl[-1] != num_tokens:
        raise ValueError(f"cu_seqlens_q must run from 0 to num_tokens={num_tokens}, got {qsl[0]} .. {qsl[-1]}")
    for i, (a, b) in enumerate(zip(qsl, qsl[1:])):
        q_len = b - a
        if q_len < 1:
            raise ValueError(f"cu_seqlens_q must increase strictly: request {i} has {q_len} query tokens")
        if q_len > max_seqlen_q:
            raise ValueError(f"max_seqlen_q={max_seqlen_q} but request {i} has {q_len} query tokens")
        if lens[i] < q_len or lens[i] > max_seqlen_k:
            raise ValueError(f"seqused_k[{i}]={lens[i]} must lie in [query length {q_len}, max_seqlen_k="
                             f"{max_seqlen_k}]")
        need = -(-lens[i] // block_size)
        if need > block_table.shape[1]:
            raise ValueError(f"block_table has {block_table.shape[1]} columns but request {i} needs {need} blocks "
                             f"for {lens[i]} keys")
        ids = block_table[i, :need]
        if need and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
            raise ValueError(f"block_table[{i}] holds block ids outside [0, {num_blocks})")


def unified_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    seqused_k: torch.Tensor,
    max_seqlen_k: int,
    softmax_scale: float,
    block_table: torch.Tensor,
    num_par_softmax_segments: Optional[int] = None,
    check_metadata: Optional[bool] = None,
) -> torch.Tensor:
    """Causal paged attention of a flattened batch of prefill chunks and decodes; writes and returns ``out``.

    The arguments keep the names of vLLM's ``unified_attention`` (v0.32.0); minivllm's ``AttentionMetadata``
    calls them ``query_start_loc`` (``cu_seqlens_q``) and ``seq_lens`` (``seqused_k``). The attention is always
    causal (vLLM's ``causal=True``), without window, soft-cap or scales.

    Args:
        q: ``[T, H, D]`` queries, float32/float16/bfloat16; ``D`` a power of two in ``[16, 256]``.
        k, v: ``[num_blocks, block_size, KVH, D]`` key and value caches (``kv_cache[0]``, ``kv_cache[1]``),
            already holding this step's keys and values; ``H % KVH == 0``.
        out: ``[T, H, D]``, ``q``'s dtype. Rows of tokens past ``cu_seqlens_q[-1]`` get unspecified values.
        cu_seqlens_q: ``int [num_seqs + 1]``, query rows of each request.
        max_seqlen_q: the longest query length (a host int, so no device synchronisation is needed).
        seqused_k: ``int [num_seqs]``, keys of each request (context + its query tokens).
        max_seqlen_k: the largest ``seqused_k``.
        softmax_scale: usually ``D ** -0.5``.
        block_table: ``int [num_seqs, max_blocks]`` KV block ids of each request.
        num_par_softmax_segments: context segments (a power of two, ``<= 64``); ``None`` picks it with
            ``choose_num_segments``.
        check_metadata: also check the values of ``cu_seqlens_q``, ``seqused_k`` and ``block_table`` (a device
            synchronisation); default: on CPU tensors only.

    Returns:
        ``out``.

    Raises:
        ValueError: naming the parameter, for a wrong shape, dtype, device, layout or (when checked) value, and for
            bfloat16 under the interpreter; nothing is launched then.
    """
    check_device(kernel_unified_attention, q=q, k=k, v=v, out=out, cu_seqlens_q=cu_seqlens_q,
                 seqused_k=seqused_k, block_table=block_table)
    dtype = same_dtype([("q", q), ("k", k), ("v", v), ("out", out)])
    check_interpreter_dtype(kernel_unified_attention, "q", dtype)
    if q.dim() != 3 or out.shape != q.shape:
        raise ValueError(f"q and out must both be [num_tokens, num_heads, head_dim], got {tuple(q.shape)} and "
                         f"{tuple(out.shape)}")
    if k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"k and v must both be [num_blocks, block_size, num_kv_heads, head_dim], got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, kv_head_dim = k.shape
    if kv_head_dim != head_dim:
        raise ValueError(f"head_dim of k ({kv_head_dim}) differs from q's ({head_dim})")
    if not (is_power_of_two(head_dim) and 16 <= head_dim <= 256):
        raise ValueError(f"head_dim must be a power of two in [16, 256] (tl.dot tiles), got {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    check_index_tensor("cu_seqlens_q", cu_seqlens_q, 1)
    check_index_tensor("seqused_k", seqused_k, 1)
    check_index_tensor("block_table", block_table, 2)
    num_seqs = seqused_k.shape[0]
    if cu_seqlens_q.shape[0] != num_seqs + 1:
        raise ValueError(f"cu_seqlens_q must have num_seqs + 1 = {num_seqs + 1} entries, got {cu_seqlens_q.shape[0]}")
    if block_table.shape[0] != num_seqs:
        raise ValueError(f"block_table must have one row per request ({num_seqs}), got {block_table.shape[0]}")
    if block_table.stride(1) != 1:
        raise ValueError(f"block_table must be contiguous in its last dimension, got strides {block_table.stride()}")
    check_last_dim_contiguous(q=q, k=k, v=v, out=out)
    if k.stride() != v.stride():
        raise ValueError(f"k and v must have equal strides, got {k.stride()} and {v.stride()}")
    if not 1 <= max_seqlen_q <= max_seqlen_k:
        raise ValueError(f"need 1 <= max_seqlen_q <= max_seqlen_k, got max_seqlen_q={max_seqlen_q}, "
                         f"max_seqlen_k={max_seqlen_k}")
    if not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be > 0, got {softmax_scale}")
    if num_par_softmax_segments is None:
        num_segments = choose_num_segments(num_seqs, num_kv_heads, max_seqlen_q, max_seqlen_k)
    else:
        num_segments = int(num_par_softmax_segments)
        if not (is_power_of_two(num_segments) and num_segments <= 64):
            raise ValueError(f"num_par_softmax_segments must be a power of two <= 64, got {num_par_softmax_segments}")
    if check_metadata is None:
        check_metadata = q.device.type == "cpu"
    if check_metadata:
        _check_metadata_values(cu_seqlens_q, seqused_k, block_table, num_tokens, max_seqlen_q, max_seqlen_k,
                               num_blocks, block_size)
    if num_seqs == 0 or num_tokens == 0:
        return out

    group = num_heads // num_kv_heads
    block_m = 16 if group <= 16 else triton.next_power_of_2(group)
    block_q = block_m // group
    # Upper bound of the query blocks of all requests: sum_i ceil(q_len_i / BLOCK_Q) <= T // BLOCK_Q + num_seqs.
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_segments)
    if num_segments > 1:
        segm_output = torch.empty(num_tokens, num_heads, num_segments, head_dim, dtype=torch.float32, device=q.device)
        segm_max = torch.empty(num_tokens, num_heads, num_segments, dtype=torch.float32, device=q.device)
        segm_expsum = torch.empty_like(segm_max)
    else:
        segm_output = segm_max = segm_expsum = out  # not touched by the kernel
    kernel_unified_attention[grid](
        out, segm_output, segm_max, segm_expsum, q, k, v, block_table, seqused_k, cu_seqlens_q,
        softmax_scale, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), block_table.stride(0),
        NUM_QUERY_HEADS=num_heads,
        NUM_QUERIES_PER_KV=group,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE_SIZE=TILE_SIZE,
        NUM_SEGMENTS=num_segments,
        IEEE_FP32_DOT=dtype == torch.float32,
    )
    if num_segments > 1:
        reduce_segments[(num_tokens, num_heads)](
            out, segm_output, segm_max, segm_expsum, out.stride(0), out.stride(1),
            NUM_QUERY_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SEGMENTS=num_segments,
        )
    return out
