"""Paged attention: the fast path equals the reference; the chunk mask is bottom-right aligned."""

import torch
import torch.nn.functional as F

from minivllm.attention.paged_attention import (
    AttentionMetadata,
    chunk_causal_mask,
    compute_slot_mapping,
    paged_attention,
    reference_paged_attention,
    write_kv_cache,
)


def _metadata(block_tables, computed, qlens, block_size):
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    positions, slots = [], []
    for bt, c, q in zip(block_tables, computed, qlens):
        pos = list(range(c, c + q))
        positions += pos
        slots += compute_slot_mapping(bt, pos, block_size)
    width = max(len(b) for b in block_tables)
    bt = torch.tensor([b + [0] * (width - len(b)) for b in block_tables])
    seq = [c + q for c, q in zip(computed, qlens)]
    md = AttentionMetadata(torch.tensor(qsl), torch.tensor(seq), torch.tensor(computed), bt, torch.tensor(slots),
                           torch.tensor(positions), block_size, qlens, seq, computed, qsl[:-1],
                           [i for i, q in enumerate(qlens) if q == 1], [i for i, q in enumerate(qlens) if q > 1])
    if md.decode_reqs:
        dl = [seq[i] for i in md.decode_reqs]
        nblk = -(-max(dl) // block_size)
        md.decode_token_idx = torch.tensor([qsl[i] for i in md.decode_reqs])
        md.decode_block_table = bt[md.decode_reqs, :nblk]
        md.decode_key_mask = (torch.arange(nblk * block_size)[None] >= torch.tensor(dl)[:, None])[:, None, None, :]
    return md


def test_slot_mapping_formula():
    assert compute_slot_mapping([7, 2, 9], [0, 3, 4, 9, 11], 4) == [28, 31, 8, 37, 39]


def test_chunk_mask_is_shifted_by_context():
    m = chunk_causal_mask(3, 2)
    assert m.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]


def test_sdpa_is_causal_is_top_left_aligned_and_wrong_for_chunks():
    q, k, v = torch.randn(1, 1, 2, 8), torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8)
    right = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk_causal_mask(3, 2))
    wrong = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert not torch.allclose(right, wrong)


def test_fast_path_equals_reference_on_mixed_batch():
    torch.manual_seed(0)
    bs, heads, kv_heads, d, nblocks = 4, 6, 2, 16, 40
    cache = torch.zeros(2, nblocks, bs, kv_heads, d)
    # Request 0: prefill chunk with context; 1: decode; 2: first chunk; 3: decode at a block boundary.
    tables = [[3, 17, 5, 9], [1, 2], [30, 31, 32], [20, 21, 22]]
    computed, qlens = [6, 6, 0, 8], [7, 1, 10, 1]
    # Fill the context tokens first (they would come from earlier steps).
    pre = _metadata(tables, [0] * 4, computed, bs)
    write_kv_cache(torch.randn(sum(computed), kv_heads, d), torch.randn(sum(computed), kv_heads, d), cache, pre.slot_mapping)
    md = _metadata(tables, computed, qlens, bs)
    t = sum(qlens)
    q, k, v = torch.randn(t, heads, d), torch.randn(t, kv_heads, d), torch.randn(t, kv_heads, d)
    write_kv_cache(k, v, cache, md.slot_mapping)
    ref = reference_paged_attention(q, cache, md, d ** -0.5)
    fast = paged_attention(q, k, v, cache, md, d ** -0.5)
    assert torch.allclose(ref, fast, atol=1e-5)
