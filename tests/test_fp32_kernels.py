"""``MINIVLLM_CPU_KERNELS_FP32=1``: float32 on the CPU through the C++ kernels and oneDNN-packed weights, as vLLM's
CPU build runs float32 (``minivllm.custom_ops``, ``minivllm.model.packed_linear``). Off by default: float32 is
the exact reference. These tests check that the switch reaches every layer, changes numbers only in the last bits,
and keeps SmolLM2's greedy tokens."""

import pytest
import torch
import torch.nn.functional as F

from minivllm import LLM, LLMEngine, SamplingParams, custom_ops
from minivllm.attention.selector import get_attn_backend
from minivllm.model.custom_op import CustomOp
from minivllm.model.loader import build_tiny_model
from minivllm.model.packed_linear import PackedWeight

pytestmark = pytest.mark.skipif(not custom_ops.load(), reason="the CPU kernels cannot be built here")

KERNELS = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "paged_attention_decode")


def _packed(model):
    out = []
    for m in model.modules():
        for p in (getattr(m, "_packed_weight", None), getattr(m, "_packed", None)):
            if isinstance(p, PackedWeight):
                out.append(p)
    return out


def _count_kernel_calls(monkeypatch):
    calls = {name: 0 for name in KERNELS}
    for name in KERNELS:
        kernel = getattr(custom_ops, name)

        def counted(*a, _name=name, _kernel=kernel):
            calls[_name] += 1
            return _kernel(*a)

        monkeypatch.setattr(custom_ops, name, counted)
    return calls


def _run(monkeypatch, flag, prompts, max_tokens):
    """A tiny float32 engine built with ``MINIVLLM_CPU_KERNELS_FP32=flag`` at a token budget of 64 (chunked
    prefills mixed with decodes). Returns (engine, logits per step, tokens per request)."""
    monkeypatch.setenv("MINIVLLM_CPU_KERNELS", "1")
    monkeypatch.setenv("MINIVLLM_CPU_KERNELS_FP32", flag)
    eng = LLMEngine(build_tiny_model(dtype=torch.float32), max_num_batched_tokens=64, enable_prefix_caching=False)
    eng.model_runner.keep_logits = True
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), {"prompt_token_ids": p}, sp)
    logits, tokens = [], {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            tokens[o.request_id] = list(o.outputs[0].token_ids)
        logits.append(eng.model_runner.last_inputs.logits.clone())
    return eng, logits, tokens


PROMPTS = [list(range(3, 3 + n)) for n in (5, 40, 90)]  # 90 tokens at a budget of 64: two chunks


def test_off_by_default_float32_stays_on_pytorch(monkeypatch):
    monkeypatch.delenv("MINIVLLM_CPU_KERNELS_FP32", raising=False)
    assert custom_ops.kernel_dtypes() == (torch.bfloat16,)
    calls = _count_kernel_calls(monkeypatch)
    eng, _, _ = _run(monkeypatch, "0", PROMPTS, 3)
    model = eng.model_runner.model
    assert {m.forward_method_name for m in model.modules() if isinstance(m, CustomOp)} == {"forward_native"}
    assert eng.model_runner.attn_backend.get_name() == "TORCH_SDPA"
    assert not any(p.float32 for p in _packed(model))
    assert calls == {name: 0 for name in KERNELS}


def test_the_switch_reaches_every_layer(monkeypatch):
    calls = _count_kernel_calls(monkeypatch)
    eng, _, _ = _run(monkeypatch, "1", PROMPTS, 3)
    model = eng.model_runner.model
    ops = [m for m in model.modules() if isinstance(m, CustomOp)]
    assert {m.forward_method_name for m in ops} == {"forward_cpu"}
    assert {m.kernel_dtype for m in ops} == {torch.float32}
    assert eng.model_runner.attn_backend.get_name() == "CPU_ATTN"
    packed = _packed(model)
    assert len(packed) == 4 * model.config.num_hidden_layers + 1 and all(p.float32 for p in packed)
    for name in ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "paged_attention_decode"):
        assert calls[name] > 0, name
    assert calls["silu_and_mul"] == 0  # slower than PyTorch's SiLU on AVX2 (SiluAndMul's doc)


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


def test_float32_packing_only_for_the_rows_where_onednn_wins():
    pw = PackedWeight()
    w = torch.randn(96, 64)
    with torch.no_grad():
        assert not pw.usable(torch.randn(16, 64), w)  # not switched on: MKL, the reference
        pw.set_float32(True)
        assert [pw.usable(torch.randn(n, 64), w) for n in (1, 2, 64, 1024, 1025)] == [False, True, True, True, False]
        assert not pw.usable(torch.randn(16, 64, dtype=torch.float64), w.double())
        x = torch.randn(16, 64)
        torch.testing.assert_close(pw.linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    assert not pw.usable(torch.randn(16, 64), w)  # autograd on: the packed op has no backward


def test_cpu_attn_by_name_takes_float32_and_refuses_float16():
    assert get_attn_backend(torch.device("cpu"), torch.float32, "CPU_ATTN").get_name() == "CPU_ATTN"
    with pytest.raises(ValueError, match="CPU_ATTN needs bfloat16 or float32"):
        get_attn_backend(torch.device("cpu"), torch.float16, "CPU_ATTN")


def test_smollm2_greedy_tokens_unchanged(monkeypatch, real_llm):
    """The real model: the same greedy tokens with the float32 kernels as with the PyTorch reference."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Paged attention stores the KV cache in"]
    sp = SamplingParams(temperature=0, max_tokens=24)
    expected = [o.outputs[0].token_ids for o in real_llm.generate(prompts, sp, use_tqdm=False)]
    monkeypatch.setenv("MINIVLLM_CPU_KERNELS_FP32", "1")
    llm = LLM(dtype="float32")
    assert llm.llm_engine.model_runner.attn_backend.get_name() == "CPU_ATTN"
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == expected
