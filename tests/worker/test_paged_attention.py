"""Paged attention: the fast path equals the reference; the chunk mask is bottom-right aligned."""

import torch
import torch.nn.functional as F

from minivllm.attention.backends.reference import reference_paged_attention
from minivllm.attention.backends.torch_sdpa import TorchSDPAImpl, TorchSDPAMetadataBuilder
from minivllm.attention.paged_attention import chunk_causal_mask, write_kv_cache
from minivllm.worker.block_table import compute_slot_mapping, create_common_attn_metadata


def _metadata(block_tables, computed, qlens, block_size, kv_heads=2, d=16):
    cm = create_common_attn_metadata(block_tables, computed, qlens, block_size)
    return TorchSDPAMetadataBuilder(block_size, 1, kv_heads, d, torch.float32, torch.device("cpu")).build(cm)


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
    fast = TorchSDPAImpl(heads, d, d ** -0.5, kv_heads).forward(q, k, v, cache, md)
    assert torch.allclose(ref, fast, atol=1e-5)


def test_pure_decode_step_in_batch_order_equals_reference():
    # Decode requests whose lengths are not sorted: the builder must keep batch order for a single group, since the
    # pure-decode path maps query row i to request i.
    torch.manual_seed(1)
    bs, heads, kv_heads, d = 4, 6, 2, 16
    cache = torch.randn(2, 24, bs, kv_heads, d)
    tables, computed = [[3, 17, 5, 9, 1, 2, 4], [20, 21, 22]], [25, 9]
    md = _metadata(tables, computed, [1, 1], bs)
    assert len(md.decode_groups) == 1 and not md.prefill_reqs
    q, k, v = torch.randn(2, heads, d), torch.randn(2, kv_heads, d), torch.randn(2, kv_heads, d)
    fast = TorchSDPAImpl(heads, d, d ** -0.5, kv_heads).forward(q, k, v, cache, md)
    assert torch.allclose(reference_paged_attention(q, cache, md, d ** -0.5), fast, atol=1e-5)
