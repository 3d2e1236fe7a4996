"""float32 on the CPU through the C++ kernels and oneDNN-packed weights, as vLLM's CPU build runs float32
(``minivllm.custom_ops``, ``minivllm.model.packed_linear``): the default (``MINIVLLM_CPU_KERNELS_FP32=1``), what
``LLM()`` and ``serve`` give; ``0`` is the exact reference, which the course and this suite choose (conftest.py).
These tests check that the switch reaches every layer, changes numbers only in the last bits, and keeps SmolLM2's
greedy tokens, batched and at batch 1."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from minivllm import LLM, LLMEngine, SamplingParams, custom_ops
from minivllm.attention.selector import get_attn_backend
from minivllm.model.custom_op import CustomOp
from minivllm.model.loader import build_tiny_model
from minivllm.model import packed_linear
from minivllm.model.packed_linear import Linear, PackedWeight
from step_logits import run_keeping_logits

pytestmark = pytest.mark.skipif(not custom_ops.load(), reason="the CPU kernels cannot be built here")

KERNELS = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "paged_attention_decode",
           "skinny_gemm", "packed_gemm")


def _packed(model):
    return [m._packed_weight for m in model.modules() if isinstance(getattr(m, "_packed_weight", None), PackedWeight)]



def _run(monkeypatch, flag, prompts, max_tokens, config=None):
    """A tiny float32 engine (``config``: a ``tiny_llama_config``, else the default) built with
    ``MINIVLLM_CPU_KERNELS_FP32=flag`` at a token budget of 64 (chunked prefills mixed with decodes). Returns
    (engine, logits per step, tokens per request)."""
    monkeypatch.setenv("MINIVLLM_CPU_KERNELS", "1")
    monkeypatch.setenv("MINIVLLM_CPU_KERNELS_FP32", flag)
    eng = LLMEngine(build_tiny_model(config, dtype=torch.float32), max_num_batched_tokens=64,
                    enable_prefix_caching=False)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    logits, tokens = run_keeping_logits(eng, prompts, sp)
    return eng, logits, tokens


PROMPTS = [list(range(3, 3 + n)) for n in (5, 40, 90)]  # 90 tokens at a budget of 64: two chunks


def test_on_by_default_and_the_reference_is_chosen_explicitly(monkeypatch):
    monkeypatch.delenv("MINIVLLM_CPU_KERNELS_FP32", raising=False)
    assert custom_ops.kernel_dtypes() == (torch.bfloat16, torch.float32)  # LLM() and serve: the fast path
    monkeypatch.setenv("MINIVLLM_CPU_KERNELS_FP32", "0")
    assert custom_ops.kernel_dtypes() == (torch.bfloat16,)


def test_the_reference_keeps_float32_on_pytorch(monkeypatch, count_kernel_calls):
    calls = count_kernel_calls(KERNELS)
    eng, _, _ = _run(monkeypatch, "0", PROMPTS, 3)
    model = eng.model_runner.model
    assert {m.forward_method_name for m in model.modules() if isinstance(m, CustomOp)} == {"forward_native"}
    assert eng.model_runner.attn_backend.get_name() == "TORCH_SDPA"
    assert not any(p.float32 for p in _packed(model))
    assert calls == {name: 0 for name in KERNELS}


def test_the_switch_reaches_every_layer(monkeypatch, count_kernel_calls):
    calls = count_kernel_calls(KERNELS)
    eng, _, _ = _run(monkeypatch, "1", PROMPTS, 3)
    model = eng.model_runner.model
    ops = [m for m in model.modules() if isinstance(m, CustomOp)]
    assert {m.forward_method_name for m in ops} == {"forward_cpu"}
    assert {m.kernel_dtype for m in ops} == {torch.float32}
    assert eng.model_runner.attn_backend.get_name() == "CPU_ATTN"
    packed = _packed(model)
    assert len(packed) == 4 * model.config.num_hidden_layers + 1 and all(p.float32 for p in packed)
    for name in ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "paged_attention_decode", "silu_and_mul"):
        assert calls[name] > 0, name
    # Steps of 2 rows and more (all but a lone decode) multiply through packed_gemm where it is built.
    assert (calls["packed_gemm"] > 0) == custom_ops.packed_gemm_available()


def test_logits_agree_to_float32_rounding_and_tokens_are_equal(monkeypatch):
    _, off, tokens_off = _run(monkeypatch, "0", PROMPTS, 6)
    _, on, tokens_on = _run(monkeypatch, "1", PROMPTS, 6)
    assert len(on) == len(off) >= 7
    differs = False
    for a, b in zip(on, off):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
        differs |= not torch.equal(a, b)
    assert differs  # other kernels really ran: not bit-identical to the reference
    assert tokens_on == tokens_off


def test_float32_packing_from_one_row_where_packed_gemm_is_built():
    pw = PackedWeight()
    w = torch.randn(96, 64)
    with torch.no_grad():
        assert not pw.usable(torch.randn(16, 64), w)  # not switched on: MKL, the reference
        pw.set_float32(True)
        assert pw.gemm == custom_ops.packed_gemm_available()
        rows = (1, 2, 64, 1024, 1025, 2048)
        # packed_gemm from one row where it is built; else oneDNN for FP32_PACKED_TOKENS rows, one row on skinny_gemm
        expect = [True if pw.gemm else n in packed_linear.FP32_PACKED_TOKENS for n in rows]
        assert [pw.usable(torch.randn(n, 64), w) for n in rows] == expect
        assert pw.skinny(torch.randn(1, 64), w) == (not pw.gemm)
        assert not pw.usable(torch.randn(16, 64, dtype=torch.float64), w.double())
        x = torch.randn(16, 64)
        torch.testing.assert_close(pw.linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    assert not pw.usable(torch.randn(16, 64), w)  # autograd on: the packed op has no backward


@pytest.mark.skipif(not custom_ops.packed_gemm_available(), reason="no AVX2 and FMA on this CPU")
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (33, 7), (52, 64), (12, 1536), (1, 5), (200, 64)])
@pytest.mark.parametrize("rows", [*range(1, 26), 300])
def test_packed_gemm_equals_linear(out_features, in_features, rows):
    """Every row tile (6 rows with AVX2, 12 with AVX-512, and every shorter last one; one row by two panels at a
    time) and last panels of every kind (panels of 16 columns with AVX2, 32 with AVX-512: 33, 52, 12, 1, 5 and 200
    output features end in panels of 1, 4, 5, 8, 12 or 20 columns) against a float64 product; x a view with a row
    stride (a slice of a wider tensor)."""
    g = torch.Generator().manual_seed(rows + out_features)
    w = torch.randn(out_features, in_features, generator=g)
    wide = torch.randn(rows, in_features + 3, generator=g)
    x = wide[:, 2 : 2 + in_features]
    packed = custom_ops.pack_gemm_weight(w)
    out = custom_ops.packed_gemm(x, packed, out_features)
    ref = x.double() @ w.double().T
    assert out.shape == (rows, out_features)
    torch.testing.assert_close(out.double(), ref, atol=1e-5 * in_features ** 0.5, rtol=1e-6)


# Run in a process of its own: a process loads one build of the kernels.
AVX2_BUILD_CHECK = """
import torch
from minivllm import custom_ops
assert custom_ops.load(), custom_ops.build_error()
checked = 0
for threads in (1, 2):
    torch.set_num_threads(threads)
    for out_features, in_features in ((200, 64), (33, 7), (12, 1536), (1000, 96)):
        g = torch.Generator().manual_seed(out_features)
        w = torch.randn(out_features, in_features, generator=g)
        packed = custom_ops.pack_gemm_weight(w)
        assert packed.shape[2] == 16  # panels of 2 x 8 lanes: the AVX2 build, not an AVX-512 machine's own
        for rows in (*range(1, 41), 300):
            x = torch.randn(rows, in_features + 3, generator=g)[:, 2 : 2 + in_features]
            out = custom_ops.packed_gemm(x, packed, out_features)
            ref = x.double() @ w.double().T
            torch.testing.assert_close(out.double(), ref, atol=1e-5 * in_features ** 0.5, rtol=1e-6)
            one = [custom_ops.packed_gemm(x[i : i + 1], packed, out_features) for i in range(min(rows, 7))]
            assert all(torch.equal(r, out[i : i + 1]) for i, r in enumerate(one))
            checked += 1
print("checked", checked)
"""


@pytest.mark.skipif(not {"avx2", "fma"} <= set(custom_ops._cpu_id().split()), reason="no AVX2 and FMA on this CPU")
def test_avx2_build_packed_gemm_equals_linear():
    """The packed GEMM as the AVX2 class runs it (``MINIVLLM_CPU_ISA=avx2``, built here in a process of its own
    where this machine has AVX-512, so that a suite run on AVX-512 machines still checks that code): tiles of 6 rows,
    the first tile of a panel asking for the next panel when more tiles follow (``prefetch_next_panel``), rows 1 to
    40 and 300, last panels of 1, 8 and 12 columns, runs of up to 15 panels per work item, one and two threads,
    against a float64 product; single rows the same bits as inside the batch. A prefetch never changes a result, so
    where it points is measured (``bench``), not tested here."""
    env = dict(os.environ, MINIVLLM_CPU_ISA="avx2")
    r = subprocess.run([sys.executable, "-c", AVX2_BUILD_CHECK], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["checked", str(2 * 4 * 41)], r.stderr[-3000:]


@pytest.mark.skipif(not custom_ops.packed_gemm_available(), reason="no AVX2 and FMA on this CPU")
@pytest.mark.parametrize("threads", [1, 2])
def test_packed_gemm_one_row_is_the_same_bits_as_inside_a_batch(threads):
    """A batch-1 step's row (two panels at a time) sums each column in the same order as a row tile of a batch,
    so a request's products do not depend on what it is batched with."""
    g = torch.Generator().manual_seed(threads)
    w, x = torch.randn(200, 576, generator=g), torch.randn(13, 576, generator=g)
    packed = custom_ops.pack_gemm_weight(w)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch = custom_ops.packed_gemm(x, packed, 200)
        rows = [custom_ops.packed_gemm(x[i : i + 1], packed, 200) for i in range(13)]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(r, batch[i : i + 1]) for i, r in enumerate(rows))


@pytest.mark.skipif(not custom_ops.packed_gemm_available(), reason="no AVX2 and FMA on this CPU")
def test_packed_gemm_rejects_bad_input():
    w = torch.randn(40, 16)
    packed = custom_ops.pack_gemm_weight(w)
    with pytest.raises(RuntimeError, match="in_features"):
        custom_ops.packed_gemm(torch.randn(4, 17), packed, 40)
    with pytest.raises(RuntimeError, match="panels"):  # 40 features fit the panels, 200 do not
        custom_ops.packed_gemm(torch.randn(4, 16), packed, 200)
    with pytest.raises(RuntimeError, match="float32"):
        custom_ops.packed_gemm(torch.randn(4, 16, dtype=torch.float64), packed, 40)
    with pytest.raises(RuntimeError, match="contiguous"):
        custom_ops.pack_gemm_weight(w.t())
    with pytest.raises(RuntimeError, match="contiguous rows"):
        custom_ops.packed_gemm(torch.randn(16, 4).t(), packed, 40)
    op = custom_ops._ops().packed_gemm  # the operator itself, with an out of the caller's
    with pytest.raises(RuntimeError, match="out must be"):
        op(torch.empty(40), torch.randn(4, 16), packed)
    wide = torch.randn(4, 64)
    before = wide.clone()
    with pytest.raises(RuntimeError, match="share memory"):  # out = columns 0-39 of the rows x reads 0-15 of
        op(wide[:, :40], wide[:, :16], packed)
    assert torch.equal(wide, before)  # refused before anything was written


def test_float32_packed_rows_follow_the_vector_unit():
    """AVX2: MKL catches up at about 1024 rows; AVX-512: oneDNN's packed weight wins at every size measured."""
    assert packed_linear.fp32_packed_rows("AVX2") == range(2, 1025)
    assert packed_linear.fp32_packed_rows("DEFAULT") == range(2, 1025)
    avx512 = packed_linear.fp32_packed_rows("AVX512")
    assert 1 not in avx512 and all(n in avx512 for n in (2, 1024, 2048, 8192, 1 << 20))


def test_cpu_attn_by_name_takes_float32_and_refuses_float16():
    assert get_attn_backend(torch.device("cpu"), torch.float32, "CPU_ATTN").get_name() == "CPU_ATTN"
    with pytest.raises(ValueError, match="CPU_ATTN needs bfloat16 or float32"):
        get_attn_backend(torch.device("cpu"), torch.float16, "CPU_ATTN")


def test_smollm2_greedy_tokens_unchanged(monkeypatch, real_llm, count_kernel_calls):
    """The real model: the same greedy tokens with the float32 kernels as with the PyTorch reference."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Paged attention stores the KV cache in"]
    sp = SamplingParams(temperature=0, max_tokens=24)
    expected = [o.outputs[0].token_ids for o in real_llm.generate(prompts, sp, use_tqdm=False)]
    monkeypatch.setenv("MINIVLLM_CPU_KERNELS_FP32", "1")
    prefills = count_kernel_calls(["paged_attention_prefill"])
    llm = LLM(dtype="float32")
    assert llm.llm_engine.model_runner.attn_backend.get_name() == "CPU_ATTN"
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == expected
    # The three prompts' prefill, one step through every layer, where the float32 prefill kernel is built.
    layers = llm.llm_engine.hf_config.num_hidden_layers
    assert prefills["paged_attention_prefill"] == (layers if custom_ops.prefill_kernel_available(torch.float32) else 0)
    # One at a time: every decode step is one row, through packed_gemm's panels where it is built (the layers'
    # weights are removed: the panels alone), else through the batch-1 kernel (skinny_gemm).
    calls = count_kernel_calls(["skinny_gemm", "packed_gemm"])
    alone = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    per_step = 4 * llm.llm_engine.hf_config.num_hidden_layers + 1  # qkv, o, gate_up, down per layer; the LM head
    # ... and the prefill's LM head, which reads one row: the prompt's last.
    one_row = sum(per_step * (len(t) - 1) + 1 for t in expected)
    assert alone == expected
    if custom_ops.packed_gemm_available():
        model = llm.llm_engine.model_runner.model
        assert all(m.weight_removed for m in model.modules() if isinstance(m, Linear))
        # Parameter counts and the course's reading of a layer's weights see through the removal.
        from minivllm.course.exercises._reference import split_layer_weights

        ref_model = real_llm.llm_engine.model_runner.model
        assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref_model.parameters())
        ours, ref = split_layer_weights(model.model.layers[0]), split_layer_weights(ref_model.model.layers[0])
        assert all(torch.equal(ours[k], ref[k]) for k in ref)
        assert calls["skinny_gemm"] == 0
        assert calls["packed_gemm"] == one_row + len(prompts) * 4 * layers  # and each prefill's layers
    else:
        assert calls["skinny_gemm"] == one_row


@pytest.mark.skipif(not custom_ops.prefill_kernel_available(torch.float32), reason="no AVX2 and FMA on this CPU")
def test_float32_prefills_take_the_prefill_kernel_where_it_is_built(monkeypatch, count_kernel_calls):
    """head_dim 64, a size of ``paged_attention_prefill``: float32 prefill chunks (first and later: 90 tokens at a
    budget of 64) run through the kernel on the fast path; where the kernel is not built for float32 (stood in for)
    through SDPA. Both agree with the reference to float32 rounding, with the same tokens."""
    from minivllm.model.loader import tiny_llama_config

    config = tiny_llama_config(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    calls = count_kernel_calls(["paged_attention_prefill"])
    _, kernel, tokens_kernel = _run(monkeypatch, "1", PROMPTS, 4, config)
    # At a budget of 64: prompts 5 + 40 + 19 of the 90, then 62 beside two decodes, then the last 9: three steps
    # with prefill chunks, through 2 layers.
    assert calls["paged_attention_prefill"] == 6
    available = custom_ops.prefill_kernel_available
    monkeypatch.setattr(custom_ops, "prefill_kernel_available",
                        lambda dtype: dtype != torch.float32 and available(dtype))
    _, sdpa, tokens_sdpa = _run(monkeypatch, "1", PROMPTS, 4, config)
    assert calls["paged_attention_prefill"] == 6
    _, ref, tokens_ref = _run(monkeypatch, "0", PROMPTS, 4, config)
    assert tokens_kernel == tokens_sdpa == tokens_ref
    for a, b, c in zip(kernel, sdpa, ref):
        torch.testing.assert_close(a, c, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(b, c, atol=2e-5, rtol=1e-4)


def test_packed_weight_follows_a_dtype_round_trip():
    """``model.to(dtype)`` replaces a parameter's data without bumping its version: the packed copy must not
    keep multiplying by the old values."""
    from minivllm.model.packed_linear import Linear

    layer = Linear(64, 96, bias=False)
    layer._packed_weight.set_float32(True)
    x = torch.randn(4, 64)
    with torch.no_grad():
        before = layer(x)
        layer.to(torch.bfloat16).to(torch.float32)  # the weights are now rounded to bfloat16
        after = layer(x)
        expected = F.linear(x, layer.weight)
    assert not torch.equal(before, expected)  # the rounding changed the product
    torch.testing.assert_close(after, expected, atol=1e-5, rtol=1e-5)


def test_a_float32_engine_leaves_a_bfloat16_model_its_rope_kernel(monkeypatch, count_kernel_calls):
    """Equal models share one ``RotaryEmbedding`` (``get_rope``), whose dispatch is the last runner's. A float32
    engine built under the switch must not send a bfloat16 model's RoPE back to PyTorch (the kernel is
    bit-identical in both dtypes, so only the time is at stake)."""
    monkeypatch.setenv("MINIVLLM_CPU_KERNELS", "1")
    monkeypatch.setenv("MINIVLLM_CPU_KERNELS_FP32", "1")
    bf16 = LLMEngine(build_tiny_model(dtype=torch.bfloat16), enable_prefix_caching=False)
    LLMEngine(build_tiny_model(dtype=torch.float32), enable_prefix_caching=False)
    calls = count_kernel_calls(KERNELS)
    bf16.add_request("0", {"prompt_token_ids": PROMPTS[1]}, SamplingParams(temperature=0, max_tokens=2))
    while bf16.has_unfinished_requests():
        bf16.step()
    assert calls["rotary_embedding"] > 0


def test_two_engines_sharing_a_model_each_keep_their_choice(monkeypatch):
    """Notebook 09's pattern: one model object, one engine built with the switch and one without, stepped in
    turns. Each step re-applies its runner's choice (kernels, packed weights, attention backend), so the engine
    without the switch gives the reference's exact logits while the other runs the kernels."""
    monkeypatch.setenv("MINIVLLM_CPU_KERNELS", "1")
    model = build_tiny_model(dtype=torch.float32)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setenv("MINIVLLM_CPU_KERNELS_FP32", "1")
    on = LLMEngine(model, max_num_batched_tokens=64, enable_prefix_caching=False)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    # The fast path's engine keeps the layers' float32 weights as panels alone where packed_gemm is built; a second
    # engine moving the model to the device it is on leaves them so.
    removed = custom_ops.packed_gemm_available()
    assert all(m.weight_removed == removed for m in linears)
    LLMEngine(model, max_num_batched_tokens=64, enable_prefix_caching=False)
    assert all(m.weight_removed == removed for m in linears)
    monkeypatch.setenv("MINIVLLM_CPU_KERNELS_FP32", "0")
    off = LLMEngine(model, max_num_batched_tokens=64, enable_prefix_caching=False)
    assert all(m.weight_removed == removed for m in linears)  # built, not yet stepped
    ref = LLMEngine(build_tiny_model(dtype=torch.float32), max_num_batched_tokens=64, enable_prefix_caching=False)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for eng in (on, off, ref):
        eng.model_runner.keep_logits = True
        for i, p in enumerate(PROMPTS):
            eng.add_request(str(i), {"prompt_token_ids": p}, sp)
    on_differs = False
    while ref.has_unfinished_requests():
        on.step()
        assert model.attn_backend.get_name() == "CPU_ATTN"
        off.step()
        assert model.attn_backend.get_name() == "TORCH_SDPA"
        ref.step()
        reference = ref.model_runner.last_inputs.logits
        assert torch.equal(off.model_runner.last_inputs.logits, reference)
        torch.testing.assert_close(on.model_runner.last_inputs.logits, reference, atol=2e-5, rtol=1e-4)
        on_differs |= not torch.equal(on.model_runner.last_inputs.logits, reference)
    assert on_differs
    # The reference engine's first step took the weights back, bit for bit, and the model keeps them.
    assert not any(m.weight_removed for m in linears)
    names = {m: n for n, m in model.named_modules()}
    assert all(torch.equal(m.weight.detach(), weights[names[m] + ".weight"]) for m in linears)
    assert not any(m.remove_weight() for m in linears)


def test_kernels_off_wins_over_the_float32_switch(monkeypatch):
    """``MINIVLLM_CPU_KERNELS=0`` keeps everything on PyTorch even with ``MINIVLLM_CPU_KERNELS_FP32=1`` (envs.py)."""
    monkeypatch.setenv("MINIVLLM_CPU_KERNELS", "0")
    monkeypatch.setenv("MINIVLLM_CPU_KERNELS_FP32", "1")
    eng = LLMEngine(build_tiny_model(dtype=torch.float32), enable_prefix_caching=False)
    model = eng.model_runner.model
    assert {m.forward_method_name for m in model.modules() if isinstance(m, CustomOp)} == {"forward_native"}
    assert eng.model_runner.attn_backend.get_name() == "TORCH_SDPA"
    assert not any(p.float32 for p in _packed(model))


@pytest.mark.skipif(not custom_ops.packed_gemm_available(), reason="no AVX2 and FMA on this CPU")
def test_a_removed_weight_lives_in_the_panels_and_comes_back_bit_for_bit():
    """``Linear.remove_weight`` (vLLM's ``remove_weight=True``): the float32 weight is freed and every fast-path call
    reads the panels; ``state_dict`` still gives the exact weight, and each path that needs the ``[out, in]``
    tensor (autograd, ``.to``, ``load_state_dict``) gets it back unpacked, bit for bit."""
    from minivllm.model.packed_linear import Linear

    torch.manual_seed(0)
    layer = Linear(64, 100, bias=True)  # 100 columns: the last panel is partly zeros
    layer._packed_weight.set_float32(True)
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    assert torch.equal(custom_ops.unpack_gemm_weight(custom_ops.pack_gemm_weight(w), 100), w)
    with torch.no_grad():
        assert layer.remove_weight() and layer.weight.is_meta and layer.weight.shape == (100, 64)
        assert sum(p.numel() for p in layer.parameters()) == 100 * 64 + 100  # counts and shapes stay right
        layer.to(torch.float32)  # nothing to convert: the weight stays removed
        assert layer.weight_removed
        for rows in (1, 2, 13):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(layer(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
        x = torch.randn(9, 64)
        assert torch.equal(layer(x)[3:4], layer(x[3:4]))  # one row sums as it does inside a batch
        assert torch.equal(layer.state_dict()["weight"], w) and layer.weight_removed
    layer(torch.randn(3, 64))  # autograd on: F.linear, on the restored weight
    assert not layer.weight_removed and torch.equal(layer.weight.detach(), w)
    assert not layer.remove_weight()  # restored for a call the panels could not serve: kept from then on

    in_step = Linear(64, 100)
    in_step._packed_weight.set_float32(True)
    assert in_step.remove_weight()
    with torch.inference_mode():  # as inside a step: the weight comes back as a normal tensor all the same
        in_step.restore_weight()
    assert not in_step.weight.is_inference()
    in_step(torch.randn(2, 64)).sum().backward()
    assert in_step.remove_weight()  # restored without keep: it may go again

    moved = Linear(64, 100)
    moved._packed_weight.set_float32(True)
    moved.weight.data.copy_(w)
    assert moved.remove_weight()
    moved.to(torch.bfloat16)
    assert torch.equal(moved.weight.detach(), w.to(torch.bfloat16))

    loaded = Linear(64, 100)
    loaded._packed_weight.set_float32(True)
    assert loaded.remove_weight()
    loaded.load_state_dict({"weight": w, "bias": b})
    assert torch.equal(loaded.weight.detach(), w)
    with pytest.raises(ValueError, match="out_features=101"):
        custom_ops.unpack_gemm_weight(custom_ops.pack_gemm_weight(w[:33]), 101)


@pytest.mark.skipif(not custom_ops.packed_gemm_available(), reason="no AVX2 and FMA on this CPU")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages are asked of Linux")
def test_panels_of_two_mib_and_more_start_on_a_huge_page_and_are_unmapped_when_dropped():
    """The panels a batch-1 step streams live in a mapping of their own, starting at a 2 MiB boundary and advised
    for huge pages (``csrc/packed_gemm.cpp``); smaller ones come from PyTorch's allocator. Dropping them unmaps
    them: packing a 7 MB weight 100 times leaves the resident memory where it was."""

    def rss_mib():
        return int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS")).split()[1]) // 1024

    w = torch.randn(3072, 576)
    x = torch.randn(3, 576)
    packed = custom_ops.pack_gemm_weight(w)
    assert packed.data_ptr() % (2 << 20) == 0
    torch.testing.assert_close(custom_ops.packed_gemm(x, packed, 3072), x @ w.T, atol=1e-4, rtol=1e-5)
    assert torch.equal(custom_ops.unpack_gemm_weight(packed.clone(), 3072), w)
    before = rss_mib()
    for _ in range(100):
        packed = custom_ops.pack_gemm_weight(w)
    del packed
    assert rss_mib() - before < 32
