"""The Triton kernels of ``minivllm.attention.ops`` against the reference attention, on CPU tensors through
Triton's interpreter (``TRITON_INTERPRET=1``).

Float32 and float16 only: the interpreter's ``tl.dot`` of bfloat16 tiles returns garbage, so the entry point
refuses bfloat16 there (tested below); bfloat16 is checked on a GPU (``python -m minivllm.bench.gpu_check``).
Shapes are small: the interpreter runs each program instance in NumPy, about a second per launch here.
"""

import os
import subprocess
import sys

import pytest
import torch
from triton_child import run_under_interpreter, where_it_runs

pytest.importorskip("triton", reason="triton is not installed (pip install -r requirements.txt installs it on Linux)")

from minivllm.attention.ops import triton_reshape_and_cache_flash as rc  # noqa: E402
from minivllm.attention.ops import triton_unified_attention as ua  # noqa: E402
from minivllm.bench.gpu_check import paged_batch  # noqa: E402
from minivllm.attention.ops.triton_utils import (  # noqa: E402
    interpreter_problem,
    is_interpreted,
    triton_language_interpreted,
)
from minivllm.attention.backend import AttentionMetadata  # noqa: E402
from minivllm.attention.backends.reference import reference_paged_attention  # noqa: E402
from minivllm.attention.paged_attention import write_kv_cache  # noqa: E402

# The kernel tests run in a child process under TRITON_INTERPRET=1: tests/triton_child.py says why.
INTERPRETED_HERE = triton_language_interpreted() and is_interpreted(ua.kernel_unified_attention)
if interpreter_problem():
    pytest.skip(interpreter_problem(), allow_module_level=True)
OUTSIDE_THE_INTERPRETER = ("test_in_fresh_process", "test_kernels_compile_for_hopper")
_where_it_runs = where_it_runs(INTERPRETED_HERE, OUTSIDE_THE_INTERPRETER)


def test_in_fresh_process():
    run_under_interpreter(__file__, min_passed=25)


def test_kernels_compile_for_hopper():
    # What the interpreter cannot see: Triton lowers every kernel variant to an sm_90 (H200) cubin. No GPU is
    # needed (the wheel bundles ptxas), but a process without TRITON_INTERPRET is.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = env.get("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when unset
    proc = subprocess.run([sys.executable, "-m", "minivllm.attention.ops.compile_check", "--arch", "90"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "every variant compiled for sm_90" in proc.stdout
    assert proc.stdout.count("bytes of sm_90 cubin") == 8


TOL = {torch.float32: 2e-5, torch.float16: 3e-3}


def make_batch(ctxs, qlens, num_heads=6, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, seed=0):
    """A paged cache with random contents, each request's blocks scattered at random ids (plus unused blocks),
    and the matching ``AttentionMetadata`` (gpu_check's batch, on the CPU). Returns ``(query, kv_cache, md)``."""
    query, kv_cache, _, md = paged_batch(ctxs, qlens, num_heads, num_kv_heads, head_dim, block_size, dtype, "cpu",
                                         seed=seed)
    return query, kv_cache, md


def triton_attention(query, kv_cache, md, **kw):
    out = torch.full_like(query, float("nan"))  # any row the kernel forgets stays NaN and fails the comparison
    return ua.unified_attention(
        query, kv_cache[0], kv_cache[1], out, md.query_start_loc, max(md.query_lens_cpu), md.seq_lens,
        max(md.seq_lens_cpu), query.shape[-1] ** -0.5, md.block_table, **kw,
    )


def check_against_reference(ctxs, qlens, dtype=torch.float32, **kw):
    launch = {k: kw.pop(k) for k in ("num_par_softmax_segments",) if k in kw}
    query, kv_cache, md = make_batch(ctxs, qlens, dtype=dtype, **kw)
    ref = reference_paged_attention(query.float(), kv_cache.float(), md, query.shape[-1] ** -0.5)
    out = triton_attention(query, kv_cache, md, **launch)
    assert out.dtype == dtype
    err = (out.float() - ref).abs().max().item()
    assert err < TOL[dtype], f"max abs error {err} for ctxs={ctxs} qlens={qlens} {dtype} {kw} {launch}"


def test_kernels_are_interpreted():
    assert is_interpreted(ua.kernel_unified_attention) and is_interpreted(rc.reshape_and_cache_kernel_flash)


# ---- unified attention --------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(6, 2), (3, 3)], ids=["gqa3", "mha"])
def test_decode_only(block_size, heads):
    check_against_reference([5, 0, 40, 63], [1, 1, 1, 1], num_heads=heads[0], num_kv_heads=heads[1],
                            block_size=block_size)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(6, 2), (3, 3)], ids=["gqa3", "mha"])
def test_prefill_chunks_with_context(block_size, heads):
    # A first chunk (no context), a chunk after 37 cached tokens, a chunk crossing a block boundary.
    check_against_reference([0, 37, 30], [20, 9, 6], num_heads=heads[0], num_kv_heads=heads[1],
                            block_size=block_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mixed_batch(dtype):
    check_against_reference([37, 0, 3, 70], [9, 17, 1, 1], dtype=dtype)


@pytest.mark.parametrize("head_dim", [32, 128])
def test_other_head_dims(head_dim):
    check_against_reference([20, 0], [1, 7], head_dim=head_dim)


def test_split_context_decode():
    # Long decodes: the kernel splits each context into 4 segments and reduce_segments combines them. Request 2
    # is so short that some of its segments are empty (M = -inf, weight 0 in the reduction).
    check_against_reference([300, 150, 10], [1, 1, 1], num_par_softmax_segments=4)


def test_split_context_mixed_batch():
    # The split is also exact for prefill chunks, whose first rows see no key in the later segments.
    check_against_reference([200, 0], [5, 40], num_par_softmax_segments=4, block_size=32)


def test_automatic_split_for_one_long_decode():
    assert ua.choose_num_segments(num_seqs=1, num_kv_heads=2, max_seqlen_q=1, max_seqlen_k=600) == 2
    check_against_reference([599], [1], num_heads=2, num_kv_heads=2)


def test_choose_num_segments():
    assert ua.choose_num_segments(1, 3, 1, 100) == 1  # short: no split
    assert ua.choose_num_segments(1, 3, 1, 4096) == 16
    assert ua.choose_num_segments(1, 3, 1, 1024) == 4
    assert ua.choose_num_segments(1, 3, 8, 4096) == 1  # prefill in the batch
    assert ua.choose_num_segments(64, 3, 1, 4096) == 1  # enough programs already


def test_refuses_bfloat16_under_interpreter():
    query, kv_cache, md = make_batch([3], [1], dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 is not supported under TRITON_INTERPRET=1"):
        triton_attention(query, kv_cache, md)


def test_bad_inputs_are_named():
    query, kv_cache, md = make_batch([3, 8], [1, 2])
    with pytest.raises(ValueError, match="k is torch.float16 but q is torch.float32"):
        triton_attention(query, kv_cache.half(), md)
    with pytest.raises(ValueError, match="num_heads \\(6\\) must be a multiple of num_kv_heads \\(4\\)"):
        q4, kv4, _ = make_batch([3, 8], [1, 2], num_kv_heads=4)
        triton_attention(query, kv4, md)
    with pytest.raises(ValueError, match="head_dim must be a power of two"):
        q, kv, md2 = make_batch([3], [1], head_dim=48)
        triton_attention(q, kv, md2)
    bad = AttentionMetadata(**{**md.__dict__, "seq_lens": torch.tensor([4, 1])})
    with pytest.raises(ValueError, match=r"seqused_k\[1\]=1 must lie in \[query length 2"):
        ua.unified_attention(query, kv_cache[0], kv_cache[1], torch.empty_like(query), md.query_start_loc, 2,
                             bad.seq_lens, 10, 0.125, md.block_table)
    with pytest.raises(ValueError, match="block_table\\[0\\] holds block ids outside"):
        bt = md.block_table.clone()
        bt[0, 0] = kv_cache.shape[1]
        ua.unified_attention(query, kv_cache[0], kv_cache[1], torch.empty_like(query), md.query_start_loc, 2,
                             md.seq_lens, 10, 0.125, bt)
    with pytest.raises(ValueError, match="num_par_softmax_segments must be a power of two"):
        triton_attention(query, kv_cache, md, num_par_softmax_segments=3)


# ---- KV write ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_reshape_and_cache_matches_write_kv_cache(dtype, block_size):
    # A plain copy, no tl.dot: exact under the interpreter in bfloat16 too.
    g = torch.Generator().manual_seed(1)
    num_blocks, kvh, d = 6, 3, 64
    key = torch.randn(7, kvh, d, generator=g).to(dtype)
    value = torch.randn(7, kvh, d, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:7]
    kv_cache = torch.randn(2, num_blocks, block_size, kvh, d, generator=g).to(dtype)
    expected = kv_cache.clone()
    write_kv_cache(key, value, expected, slots)
    rc.triton_reshape_and_cache_flash(key, value, kv_cache[0], kv_cache[1], slots)
    assert torch.equal(kv_cache, expected)


def test_reshape_and_cache_skips_padding_slots():
    # vLLM's PAD_SLOT_ID (-1): the token is not stored anywhere (minivllm's CUDA graphs use a scratch block).
    key = torch.randn(4, 2, 32)
    value = torch.randn(4, 2, 32)
    slots = torch.tensor([5, -1, 40, -1])
    kv_cache = torch.zeros(2, 4, 16, 2, 32)
    rc.triton_reshape_and_cache_flash(key, value, kv_cache[0], kv_cache[1], slots)
    expected = torch.zeros_like(kv_cache)
    write_kv_cache(key[[0, 2]], value[[0, 2]], expected, slots[[0, 2]])
    assert torch.equal(kv_cache, expected)


def test_reshape_and_cache_bad_inputs_are_named():
    key = torch.randn(2, 2, 32)
    kv_cache = torch.zeros(2, 4, 16, 2, 32)
    with pytest.raises(ValueError, match=r"slot_mapping values must lie in \[-1, 64\)"):
        rc.triton_reshape_and_cache_flash(key, key, kv_cache[0], kv_cache[1], torch.tensor([3, 64]))
    assert not kv_cache.any()  # nothing written before the error
    with pytest.raises(ValueError, match="slot_mapping has 1 entries for 2 tokens"):
        rc.triton_reshape_and_cache_flash(key, key, kv_cache[0], kv_cache[1], torch.tensor([3]))
    with pytest.raises(ValueError, match="slot_mapping must be int32 or int64"):
        rc.triton_reshape_and_cache_flash(key, key, kv_cache[0], kv_cache[1], torch.tensor([3.0, 4.0]))
    with pytest.raises(ValueError, match="key_cache is torch.float16 but key is torch.float32"):
        rc.triton_reshape_and_cache_flash(key, key, kv_cache[0].half(), kv_cache[1].half(), torch.tensor([3, 4]))


def test_write_then_attend_like_a_layer():
    # One layer's step as a backend will run it: write the step's K/V by slot mapping, then attend.
    query, kv_cache, md = make_batch([21, 0], [3, 5], block_size=16, seed=3)
    g = torch.Generator().manual_seed(4)
    key = torch.randn(8, 2, 64, generator=g)
    value = torch.randn(8, 2, 64, generator=g)
    bt = md.block_table
    slots = torch.cat([bt[i, p // 16] * 16 + p % 16 for i, p in
                       ((0, torch.arange(21, 24)), (1, torch.arange(0, 5)))])
    expected_cache = kv_cache.clone()
    write_kv_cache(key, value, expected_cache, slots)
    rc.triton_reshape_and_cache_flash(key, value, kv_cache[0], kv_cache[1], slots)
    assert torch.equal(kv_cache, expected_cache)
    ref = reference_paged_attention(query, expected_cache, md, 0.125)
    assert (triton_attention(query, kv_cache, md) - ref).abs().max() < TOL[torch.float32]
