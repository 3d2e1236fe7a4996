"""minivllm's C++ CPU kernels (``minivllm/csrc``, ``minivllm.custom_ops``) against the PyTorch code they replace."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm import LLMEngine, SamplingParams, custom_ops
from minivllm.attention.backends.reference import ReferenceAttentionMetadataBuilder, reference_paged_attention
from minivllm.worker.block_table import create_common_attn_metadata
from minivllm.model.layers.layernorm import RMSNorm
from minivllm.model.layers.rotary_embedding import RotaryEmbedding, _rotate
from minivllm.model.loader import build_tiny_model
from minivllm.model.packed_linear import PackedWeight, onednn_bf16_available

pytestmark = pytest.mark.skipif(os.environ.get("MINIVLLM_CPU_KERNELS") == "0", reason="kernels switched off")


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler")
def test_kernels_build_here():
    # With a compiler present, a build failure must not go unnoticed (the engine would silently fall back).
    assert custom_ops.load(), custom_ops.build_error()


def _copy_of_the_built_library(tmp_path):
    """This process's built kernels copied (times kept, so ninja has nothing to do) under a fresh
    ``TORCH_EXTENSIONS_DIR``; returns that root and the library's folder in it."""
    assert custom_ops.load(), custom_ops.build_error()
    name = custom_ops._build_name(custom_ops.cflags())
    root = tmp_path / "extensions"
    folder = root / name
    shutil.copytree(custom_ops.build_directory(name), folder,
                    ignore=shutil.ignore_patterns("lock", "minivllm.lock"))
    return root, folder


def _load_in_a_new_process(root, stale_after=None):
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(root),
               PYTHONPATH=os.pathsep.join([str(Path(custom_ops.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    code = ("from minivllm import custom_ops; print('loading', flush=True); "
            + (f"custom_ops.STALE_LOCK_S = {stale_after}; " if stale_after is not None else "")
            + "print(custom_ops.load())")
    return subprocess.Popen([sys.executable, "-W", "always", "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(proc, timeout=180):
    """The process's (stdout, stderr); killed and reaped if it is still running after ``timeout`` s."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise


@pytest.mark.parametrize("hip, cuda", [(None, None), (None, "12.8"), ("6.4.43482", None)])
@pytest.mark.parametrize("extensions_dir", [False, True])
def test_build_directory_is_torchs(monkeypatch, tmp_path, hip, cuda, extensions_dir):
    """The folder load() passes to torch is the one torch would choose itself, so a cached build is found again."""
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(cpp_extension, "get_default_build_root", lambda: str(tmp_path / "root"))
    if extensions_dir:
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "chosen"))
    else:
        monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    name = custom_ops._build_name(custom_ops.cflags())
    assert custom_ops.build_directory(name) == Path(cpp_extension._get_build_directory(name, False))


def test_a_lock_left_by_a_killed_build_is_removed(tmp_path):
    """torch's build lock, left by a process killed mid-build, made every later start wait forever."""
    root, folder = _copy_of_the_built_library(tmp_path)
    (folder / "lock").touch()
    old = time.time() - custom_ops.STALE_LOCK_S - 10
    os.utime(folder / "lock", (old, old))
    out, err = _finish(_load_in_a_new_process(root))
    assert out.split() == ["loading", "True"], err
    assert f"removed {folder / 'lock'}, left by a build that was interrupted" in err
    assert "waiting for" not in err
    assert not (folder / "lock").exists()


def test_a_recent_lock_is_waited_on_until_stale(tmp_path):
    """A lock younger than STALE_LOCK_S may belong to a build that does not take minivllm's flock: waited on, with a
    message, and removed only once it is that old."""
    root, folder = _copy_of_the_built_library(tmp_path)
    (folder / "lock").touch()
    out, err = _finish(_load_in_a_new_process(root, stale_after=3))
    assert out.split() == ["loading", "True"], err
    assert f"waiting for {folder / 'lock'}" in err
    assert f"removed {folder / 'lock'}" in err
    assert not (folder / "lock").exists()


def test_a_build_in_progress_is_waited_for(tmp_path):
    """While another process holds the build (our flock and torch's lock file), a new process waits and removes
    nothing, even a lock older than STALE_LOCK_S; when that build ends, it loads the library."""
    import fcntl
    import select

    root, folder = _copy_of_the_built_library(tmp_path)
    with open(folder / "minivllm.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (folder / "lock").touch()
        old = time.time() - custom_ops.STALE_LOCK_S - 10
        os.utime(folder / "lock", (old, old))
        proc = _load_in_a_new_process(root)
        try:
            assert select.select([proc.stdout], [], [], 120)[0], "the new process did not start"
            assert proc.stdout.readline().strip() == "loading"
            time.sleep(2.0)
            assert proc.poll() is None and (folder / "lock").exists()
            (folder / "lock").unlink()  # what torch's FileBaton.release does when its build ends
            fcntl.flock(held, fcntl.LOCK_UN)
            out, err = _finish(proc)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert out.split() == ["True"], err
    assert "interrupted" not in err and "waiting for" not in err


def test_engine_falls_back_when_the_kernels_cannot_be_built(monkeypatch):
    """A machine without a compiler: load() reports False, the bf16 engine runs PyTorch operators only."""
    monkeypatch.setitem(custom_ops._state, "loaded", False)
    monkeypatch.setitem(custom_ops._state, "error", "simulated: no compiler")
    called = []
    monkeypatch.setattr(custom_ops, "_ops", lambda: called.append(1))
    eng = LLMEngine(build_tiny_model(dtype=torch.bfloat16), enable_prefix_caching=False)
    eng.add_request("a", {"prompt_token_ids": list(range(3, 40))}, SamplingParams(temperature=0, max_tokens=3))
    while eng.has_unfinished_requests():
        eng.step()
    assert not called and not custom_ops.usable(torch.zeros(1, dtype=torch.bfloat16))


def _one_row_layers(llm_or_engine):
    eng = getattr(llm_or_engine, "llm_engine", llm_or_engine)
    model = eng.model_runner.model
    return eng, [m._packed_weight for m in model.modules() if isinstance(getattr(m, "_packed_weight", None),
                                                                       PackedWeight)]


@pytest.mark.parametrize("kernels", ["1", "0"])
def test_bfloat16_batch1_rows_take_skinny_gemm(monkeypatch, count_kernel_calls, kernels):
    """A bfloat16 engine at batch 1: every linear layer and the LM head of a decode step (one row), and the LM head
    of the prefill's last token, go to ``skinny_gemm``; the prefill's other rows do not; with
    ``MINIVLLM_CPU_KERNELS=0`` none do (PyTorch operators)."""
    monkeypatch.setenv("MINIVLLM_CPU_KERNELS", kernels)
    calls = count_kernel_calls(["skinny_gemm"])
    eng = LLMEngine(build_tiny_model(dtype=torch.bfloat16), enable_prefix_caching=False)
    eng.add_request("a", {"prompt_token_ids": list(range(3, 40))}, SamplingParams(temperature=0, max_tokens=5,
                                                                               ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    layers = eng.hf_config.num_hidden_layers
    assert calls["skinny_gemm"] == ((4 * layers + 1) * 4 + 1 if kernels == "1" else 0)


def test_a_bfloat16_row_with_a_bias_is_rounded_once(count_kernel_calls):
    """One bfloat16 row of a layer with a bias does not take ``skinny_gemm`` (which rounds before the bias is
    added): the result is ``F.linear``'s float32 sum plus the bias, rounded once; without the bias it does."""
    calls = count_kernel_calls(["skinny_gemm"])
    g = torch.Generator().manual_seed(11)
    w, x, b = (torch.randn(64, 96, generator=g).bfloat16(), torch.randn(1, 96, generator=g).bfloat16(),
               torch.randn(64, generator=g).bfloat16())
    pw = PackedWeight()
    pw.set_kernels(True)
    with torch.no_grad():
        got = pw.linear(x, w, b)
        assert calls["skinny_gemm"] == 0
        pw.linear(x, w)
        assert calls["skinny_gemm"] == 1
    ref = (F.linear(x.float(), w.float()) + b.float())
    scale = (w.float().abs() @ x.float().abs().T).T + b.float().abs()
    assert ((got.float() - ref).abs() <= 1e-5 * scale + 2 ** -8 * ref.abs() + 1e-6).all()


@pytest.mark.skipif(not onednn_bf16_available(), reason="no native bfloat16 matmuls (AVX512-BF16) on this CPU")
def test_smollm2_bfloat16_batch1_tokens_as_with_onednn(monkeypatch, count_kernel_calls):
    """The real model in bfloat16, one request at a time: the same greedy tokens with ``skinny_gemm`` as with
    oneDNN's one-row matmul on the packed weights (what ran before the kernel took one bfloat16 row)."""
    monkeypatch.setenv("MINIVLLM_CPU_KERNELS", "1")
    from minivllm import LLM

    prompts = ["The capital of France is", "def fibonacci(n):", "Paged attention stores the KV cache in"]
    sp = SamplingParams(temperature=0, max_tokens=24)
    llm = LLM(dtype="bfloat16")
    eng, packed = _one_row_layers(llm)
    assert packed and all(p.bf16_row for p in packed)
    calls = count_kernel_calls(["skinny_gemm"])
    ours = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    layers = eng.hf_config.num_hidden_layers
    one_row = sum((4 * layers + 1) * (len(t) - 1) + 1 for t in ours)  # each decode step's layers, each prefill's head
    assert calls["skinny_gemm"] == one_row
    for p in packed:
        p.set_kernels(False)
    onednn = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert calls["skinny_gemm"] == one_row  # none more
    assert ours == onednn


def _reference_metadata(tables, ctxs, qlens, block_size):
    """The REFERENCE backend's metadata of requests with block tables ``tables`` (rows padded alike)."""
    cm = create_common_attn_metadata(tables, ctxs, qlens, block_size)
    return ReferenceAttentionMetadataBuilder(block_size, 1, 1, 1, torch.float32, torch.device("cpu")).build(cm)


def _decode_case(g, dtype, lens, heads, kv_heads, head_dim, block_size, num_blocks=64, extra_rows=0):
    """A cache of random blocks and one decode query per request, the requests' blocks scattered."""
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    width = max(-(-n // block_size) for n in lens)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for n in lens:
        need = -(-n // block_size)
        tables.append(perm[used : used + need] + [0] * (width - need))  # padding ids must never be read
        used += need
    num_tokens = len(lens) + extra_rows
    query = torch.randn(num_tokens, heads, head_dim, generator=g).to(dtype)
    rows = torch.randperm(num_tokens, generator=g)[: len(lens)]
    return cache, torch.tensor(tables), query, rows


def _reference(query, cache, tables, lens, rows, block_size, scale):
    """reference_paged_attention on the decode rows only."""
    q = query[rows]
    n = len(lens)
    md = _reference_metadata(tables.tolist(), [x - 1 for x in lens], [1] * n, block_size)
    return reference_paged_attention(q, cache, md, scale)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-6), (torch.bfloat16, 8e-3)])
@pytest.mark.parametrize("block_size", [16, 5, 32])
# GQA groups 1, 2, 3, 4, 5 and 8 (5: no compiled instance, the generic loop), head_dim 40 (the generic loop)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 128), (6, 2, 40), (4, 2, 64), (8, 2, 64),
                                                     (10, 2, 64), (16, 2, 128)])
def test_paged_attention_decode_equals_reference(dtype, atol, block_size, heads, kv_heads, head_dim):
    g = torch.Generator().manual_seed(heads * head_dim + block_size)
    lens = [1, 15, 16, 17, 64, 100]  # one key, block boundaries on both sides, several blocks
    cache, tables, query, rows = _decode_case(g, dtype, lens, heads, kv_heads, head_dim, block_size, num_blocks=80,
                                              extra_rows=3)
    out = torch.full_like(query, 7.0)
    scale = head_dim ** -0.5
    custom_ops.paged_attention_decode(out, query, cache, tables, torch.tensor(lens), rows, scale)
    ref = _reference(query, cache, tables, lens, rows, block_size, scale)
    torch.testing.assert_close(out[rows].float(), ref.float(), atol=atol, rtol=0)
    others = torch.ones(len(query), dtype=torch.bool)
    others[rows] = False
    assert (out[others] == 7.0).all()  # rows of other requests (prefill tokens) are not written


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.integers(1, 70), min_size=1, max_size=6),
    block_size=st.sampled_from([1, 4, 16]),
    group=st.sampled_from([1, 3]),
    seed=st.integers(0, 2**16),
)
def test_paged_attention_decode_random(lens, block_size, group, seed):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    cache, tables, query, rows = _decode_case(g, torch.float32, lens, 2 * group, 2, 64, block_size, num_blocks)
    out = torch.zeros_like(query)
    custom_ops.paged_attention_decode(out, query, cache, tables, torch.tensor(lens), rows, 0.125)
    ref = _reference(query, cache, tables, lens, rows, block_size, 0.125)
    torch.testing.assert_close(out[rows], ref, atol=2e-6, rtol=0)


def test_paged_attention_decode_reads_strided_query_rows():
    # The model hands it q as a view of the fused qkv output: rows 960 values apart, heads contiguous.
    g = torch.Generator().manual_seed(1)
    lens = [20, 33]
    cache, tables, _, rows = _decode_case(g, torch.float32, lens, 9, 3, 64, 16)
    qkv = torch.randn(2, 960, generator=g)
    q = qkv[:, :576].view(2, 9, 64)
    out = torch.empty(2, 9, 64)
    custom_ops.paged_attention_decode(out, q, cache, tables, torch.tensor(lens), rows, 0.125)
    torch.testing.assert_close(out[rows], _reference(q, cache, tables, lens, rows, 16, 0.125), atol=2e-6, rtol=0)


def test_paged_attention_decode_rejects_bad_input_before_writing():
    g = torch.Generator().manual_seed(2)
    cache, tables, query, rows = _decode_case(g, torch.float32, [20, 5], 9, 3, 64, 16)
    out = torch.zeros_like(query)
    with pytest.raises(RuntimeError, match="seq_lens"):  # more keys than the block table holds
        custom_ops.paged_attention_decode(out, query, cache, tables, torch.tensor([20, 33]), rows, 0.1)
    bad = tables.clone()
    bad[1, 0] = 64  # one past the last block
    with pytest.raises(RuntimeError, match="block_table"):
        custom_ops.paged_attention_decode(out, query, cache, bad, torch.tensor([20, 5]), rows, 0.1)
    with pytest.raises(RuntimeError, match="query_rows"):
        custom_ops.paged_attention_decode(out, query, cache, tables, torch.tensor([20, 5]), torch.tensor([0, 9]), 0.1)
    with pytest.raises(RuntimeError, match="twice"):  # two requests writing one row would race
        custom_ops.paged_attention_decode(out, query, cache, tables, torch.tensor([20, 5]), torch.tensor([1, 1]), 0.1)
    with pytest.raises(RuntimeError, match="dtype"):
        custom_ops.paged_attention_decode(out.double(), query.double(), cache.double(), tables, torch.tensor([20, 5]),
                                          rows, 0.1)
    assert (out == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_fused_add(dtype):
    g = torch.Generator().manual_seed(3)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576, generator=g)
    norm = norm.to(dtype)
    x, res = torch.randn(37, 576, generator=g).to(dtype), torch.randn(37, 576, generator=g).to(dtype)
    # The float32 sum of squares is added in another order than PyTorch's: equal up to float rounding, which in
    # bfloat16 can move a result by one unit in the last place.
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0, rtol=2 ** -7)
    torch.testing.assert_close(custom_ops.rms_norm(x, norm.weight, 1e-5), norm.forward_native(x), **tol)
    xk, rk = x.clone(), res.clone()
    custom_ops.fused_add_rms_norm(xk, rk, norm.weight, 1e-5)
    assert torch.equal(rk, x + res)  # the residual add rounds exactly as PyTorch's
    torch.testing.assert_close(xk, norm.forward_native(x + res), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    g = torch.Generator().manual_seed(4)
    x = (4 * torch.randn(33, 2 * 1539, generator=g)).to(dtype)  # 1539: a tail after the 16-wide loop
    ref = F.silu(x[:, :1539]) * x[:, 1539:]
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=0, rtol=2 ** -7)
    torch.testing.assert_close(custom_ops.silu_and_mul(x), ref, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n_out, k", [(960, 576), (49152, 576), (576, 1536), (7, 19), (1003, 577), (4, 16), (1, 5),
                                      (65, 45), (3, 160), (2, 63), (3, 0)])
def test_skinny_gemm_equals_linear(n_out, k, threads, dtype):
    """The batch-1 linear kernel against ``F.linear`` in float32 on the same values: other summation order, so
    equal to float32 rounding (relative 1e-5 of the row's magnitude), with tails after the wide loop (four
    accumulators: 32 float32 or 128 bfloat16 values), after one register (8 float32, 32 bfloat16 pairs), a masked
    bfloat16 tail (k % 32), and a last work item of fewer than 4 rows. bfloat16 results are rounded once, at the
    end: within half a unit in bfloat16's last place (at most 2^-8 relative) of the float32 sum."""
    g = torch.Generator().manual_seed(n_out + k)
    w, x = torch.randn(n_out, k, generator=g).to(dtype), torch.randn(1, k, generator=g).to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = custom_ops.skinny_gemm(x, w)
    finally:
        torch.set_num_threads(before)
    assert got.shape == (1, n_out) and got.dtype == dtype
    ref = F.linear(x.float(), w.float())
    scale = (w.float().abs() @ x.float().abs().T).T  # the size of the terms each output sums
    rounding = 2 ** -8 * ref.abs() if dtype == torch.bfloat16 else 0
    assert ((got.float() - ref).abs() <= 1e-5 * scale + 1e-6 + rounding).all()


def test_skinny_gemm_rejects_what_it_cannot_take():
    w = torch.randn(8, 16)
    for x, wt, match in [(torch.randn(2, 16), w, "x must be \\[1, in\\]"), (torch.randn(1, 15), w, "in = weight.size\\(1\\) = 16"),
                         (torch.randn(1, 16).half(), w.half(), "all float32 or all bfloat16"),
                         (torch.randn(1, 16).bfloat16(), w, "all float32 or all bfloat16"),
                         (torch.randn(1, 16), torch.randn(16, 8).T, "contiguous")]:
        with pytest.raises(RuntimeError, match=match):
            custom_ops.skinny_gemm(x, wt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embedding_is_bit_identical(dtype):
    g = torch.Generator().manual_seed(5)
    rope = RotaryEmbedding(64, 4096, 100000.0)
    pos = torch.randint(0, 4096, (50,), generator=g)
    qkv = torch.randn(50, 960, generator=g).to(dtype)
    qk = qkv[:, :768].view(50, 12, 64)
    expected = _rotate(qk, rope.cos_cache[pos].unsqueeze(1), rope.sin_cache[pos].unsqueeze(1))
    v_before = qkv[:, 768:].clone()
    custom_ops.rotary_embedding(pos, qk, 12, rope.cos_cache, rope.sin_cache)
    assert torch.equal(qk, expected)
    assert torch.equal(qkv[:, 768:], v_before)  # v is not touched
    bad = pos.clone()
    bad[-1] = 4096  # one past the table: nothing is rotated, not even the rows before it
    before = qk.clone()
    with pytest.raises(RuntimeError, match="position"):
        custom_ops.rotary_embedding(bad, qk, 12, rope.cos_cache, rope.sin_cache)
    assert torch.equal(qk, before)


def _logits_with_and_without_kernels(monkeypatch, model, kernel_name, prompts, max_tokens):
    """Step two engines (MINIVLLM_CPU_KERNELS=1, then 0) through the same requests at a token budget of 64.

    Returns ``{"1": [logits per step], "0": [...]}`` and asserts that ``custom_ops.<kernel_name>`` ran in the
    first engine only.
    """
    calls = []
    kernel = getattr(custom_ops, kernel_name)
    monkeypatch.setattr(custom_ops, kernel_name, lambda *a: (calls.append(1), kernel(*a)))
    logits = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("MINIVLLM_CPU_KERNELS", flag)
        calls.clear()
        eng = LLMEngine(model, max_num_batched_tokens=64, enable_prefix_caching=False)
        eng.model_runner.keep_logits = True
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            eng.add_request(str(i), {"prompt_token_ids": prompt}, sp)
        rows = []
        while eng.has_unfinished_requests():
            eng.step()
            rows.append(eng.model_runner.last_inputs.logits.clone())
        logits[flag] = rows
        assert bool(calls) == (flag == "1")
    return logits


def test_bf16_engine_with_and_without_kernels(monkeypatch):
    """The whole bf16 forward (norms, RoPE, SwiGLU, decode attention through the kernels) against the PyTorch
    operators, on steps mixing decodes with prefill chunks: the logits agree to bf16 precision."""
    model = build_tiny_model(dtype=torch.bfloat16)
    # 90 tokens at a budget of 64: chunked, and mixed with the others' decodes
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 90)]
    logits = _logits_with_and_without_kernels(monkeypatch, model, "paged_attention_decode", prompts, max_tokens=4)
    assert len(logits["1"]) == len(logits["0"]) >= 5
    for a, b in zip(logits["1"], logits["0"]):
        torch.testing.assert_close(a, b, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-6), (torch.bfloat16, 8e-3)])
@pytest.mark.parametrize("threads,num_reqs", [(1, 3), (1, 9), (2, 3), (2, 13)])
def test_paged_attention_decode_work_items(dtype, atol, threads, num_reqs):
    # A work item is a whole request (all KV heads) when there are at least 4 per thread, else one
    # (request, KV head): both splits, each with one and two threads.
    g = torch.Generator().manual_seed(6 + num_reqs)
    lens = torch.randint(1, 200, (num_reqs,), generator=g).tolist()
    cache, tables, query, rows = _decode_case(g, dtype, lens, 9, 3, 64, 16, num_blocks=sum(-(-n // 16) for n in lens))
    out = torch.zeros_like(query)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        custom_ops.paged_attention_decode(out, query, cache, tables, torch.tensor(lens), rows, 0.125)
    finally:
        torch.set_num_threads(before)
    ref = _reference(query, cache, tables, lens, rows, 16, 0.125)
    torch.testing.assert_close(out[rows].float(), ref.float(), atol=atol, rtol=0)


def _prefill_case(g, qlens, ctxs, heads, kv_heads, head_dim, block_size, dtype=torch.bfloat16):
    """Random cache in ``dtype``; prefill chunks of qlens tokens after ctxs tokens of context, blocks scattered."""
    need = [-(-(q + c) // block_size) for q, c in zip(qlens, ctxs)]
    num_blocks = sum(need) + 2
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for n in need:
        tables.append(perm[used : used + n] + [0] * (max(need) - n))
        used += n
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    query = torch.randn(qsl[-1], heads, head_dim, generator=g).to(dtype)
    md = _reference_metadata(tables, list(ctxs), list(qlens), block_size)
    return cache, md, query


def _needs_prefill_kernel(dtype):
    return pytest.mark.skipif(not custom_ops.prefill_kernel_available(dtype),
                              reason=f"no {dtype} prefill kernel on this CPU (bfloat16: AVX512-BF16; float32: AVX2)")


needs_prefill_kernel = _needs_prefill_kernel(torch.bfloat16)
PREFILL_DTYPES = [pytest.param(torch.bfloat16, marks=needs_prefill_kernel),
                  pytest.param(torch.float32, marks=_needs_prefill_kernel(torch.float32))]


@pytest.mark.parametrize("dtype", PREFILL_DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 128), (4, 1, 64), (16, 2, 64)])
@pytest.mark.parametrize("block_size", [16, 5, 32])
def test_paged_attention_prefill_equals_reference(dtype, heads, kv_heads, head_dim, block_size):
    g = torch.Generator().manual_seed(heads + block_size)
    # whole prompts (no context), chunks after earlier chunks, one token after context, tile edges (32, 33), a
    # chunk of 40 whose context ends inside a block
    qlens, ctxs = [70, 33, 2, 32, 17, 1, 40], [0, 64, 40, 0, 3, 7, 21]
    cache, md, query = _prefill_case(g, qlens, ctxs, heads, kv_heads, head_dim, block_size, dtype)
    out = torch.full_like(query, 5.0)
    custom_ops.paged_attention_prefill(out, query, cache, md.block_table, md.query_start_loc[:-1],
                                       torch.tensor(qlens), torch.tensor(ctxs), head_dim ** -0.5)
    # The reference backend (PyTorch's einsum and softmax, in float32 whatever the dtype), rounded to neither dtype.
    ref = reference_paged_attention(query.float(), cache.float(), md, head_dim ** -0.5)
    if dtype == torch.bfloat16:
        # P is rounded to bf16 before P.V (as in PyTorch's bf16 flash attention): about 3 significant digits.
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=0)
        assert (out.float() - ref).abs().mean() < 2e-3
    else:  # the same float32 sums in another order: a few ulps of values of order 1
        torch.testing.assert_close(out, ref, atol=2e-6, rtol=0)


@pytest.mark.parametrize("dtype", PREFILL_DTYPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_paged_attention_prefill_work_items_and_threads(dtype, threads):
    """One long chunk (tiles of many lengths, most keys first) beside short ones, on one and two threads; rows of
    ``out`` that no request claims (a decode row's, say) are left as they were."""
    g = torch.Generator().manual_seed(40 + threads)
    qlens, ctxs = [300, 5, 64, 1], [100, 0, 250, 0]
    cache, md, query = _prefill_case(g, qlens, ctxs, 9, 3, 64, 16, dtype)
    query = torch.cat([query, torch.randn(3, 9, 64, generator=g).to(dtype)])  # 3 rows past the requests'
    out = torch.zeros_like(query)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        custom_ops.paged_attention_prefill(out, query, cache, md.block_table, md.query_start_loc[:-1],
                                           torch.tensor(qlens), torch.tensor(ctxs), 0.125)
    finally:
        torch.set_num_threads(before)
    ref = reference_paged_attention(query[:-3].float(), cache.float(), md, 0.125)
    torch.testing.assert_close(out[:-3].float(), ref, atol=2e-2 if dtype == torch.bfloat16 else 2e-6, rtol=0)
    assert (out[-3:] == 0).all()


@pytest.mark.parametrize("dtype", PREFILL_DTYPES)
def test_paged_attention_prefill_rejects_bad_input(dtype):
    g = torch.Generator().manual_seed(7)
    cache, md, query = _prefill_case(g, [20], [10], 9, 3, 64, 16, dtype)
    out = torch.zeros_like(query)
    bad = md.block_table.clone()
    bad[0, 1] = 10_000
    with pytest.raises(RuntimeError, match="block_table"):
        custom_ops.paged_attention_prefill(out, query, cache, bad, torch.tensor([0]), torch.tensor([20]),
                                           torch.tensor([10]), 0.125)
    with pytest.raises(RuntimeError, match="overlap"):  # the same 20 rows for two requests
        custom_ops.paged_attention_prefill(out, query, cache, md.block_table.repeat(2, 1), torch.tensor([0, 0]),
                                           torch.tensor([20, 20]), torch.tensor([10, 10]), 0.125)
    with pytest.raises(RuntimeError, match="blocks"):  # 2 blocks hold 32 keys, not 45
        custom_ops.paged_attention_prefill(out, query, cache, md.block_table, torch.tensor([0]), torch.tensor([20]),
                                           torch.tensor([25]), 0.125)
    with pytest.raises(RuntimeError, match="kv_cache must be"):  # no KV heads: refused, not a division by zero
        custom_ops.paged_attention_prefill(out, query, cache[:, :, :, :0], md.block_table, torch.tensor([0]),
                                           torch.tensor([20]), torch.tensor([10]), 0.125)
    with pytest.raises(RuntimeError, match="rows that do not overlap"):  # one row written by every position
        custom_ops.paged_attention_prefill(out[:1].expand_as(out), query, cache, md.block_table, torch.tensor([0]),
                                           torch.tensor([20]), torch.tensor([10]), 0.125)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(RuntimeError, match="all bfloat16 or all float32"):  # a cache of another dtype
        custom_ops.paged_attention_prefill(out, query, cache.to(other), md.block_table, torch.tensor([0]),
                                           torch.tensor([20]), torch.tensor([10]), 0.125)
    with pytest.raises(RuntimeError, match="all bfloat16 or all float32"):
        custom_ops.paged_attention_prefill(out.half(), query.half(), cache.half(), md.block_table, torch.tensor([0]),
                                           torch.tensor([20]), torch.tensor([10]), 0.125)
    assert (out == 0).all()


def test_prefill_kernel_available_names_its_dtypes():
    assert not custom_ops.prefill_kernel_available(torch.float16)
    flags = custom_ops._cpu_id().split()
    if custom_ops.load() and not os.environ.get("MINIVLLM_CPU_ISA"):  # built with -march=native
        assert custom_ops.prefill_kernel_available(torch.float32) == ({"avx2", "fma"} <= set(flags))
        assert custom_ops.prefill_kernel_available(torch.bfloat16) == ("avx512_bf16" in flags)


@pytest.mark.parametrize("dtype", PREFILL_DTYPES)
def test_engine_prefill_kernel_on_head_dim_64(monkeypatch, dtype):
    """A random model with head_dim 64 (a kernel size): chunked prefill + decodes through both attention kernels
    give logits within the dtype's precision of the PyTorch operators (float32: the fast path,
    ``MINIVLLM_CPU_KERNELS_FP32=1``)."""
    from minivllm.model.loader import tiny_llama_config

    monkeypatch.setenv("MINIVLLM_CPU_KERNELS_FP32", "1")
    model = build_tiny_model(tiny_llama_config(hidden_size=128, num_attention_heads=2, num_key_value_heads=1),
                             dtype=dtype)
    prompts = [[(5 * i) % 500 + 3 for i in range(n)] for n in (7, 50, 100)]
    logits = _logits_with_and_without_kernels(monkeypatch, model, "paged_attention_prefill", prompts, max_tokens=3)
    assert len(logits["1"]) == len(logits["0"]) >= 5
    tol = dict(atol=0.1, rtol=0.05) if dtype == torch.bfloat16 else dict(atol=2e-5, rtol=1e-4)
    for a, b in zip(logits["1"], logits["0"]):
        torch.testing.assert_close(a, b, **tol)
