"""The CustomOp layers (RMSNorm, SiluAndMul, RoPE; ``minivllm/model/custom_op.py``) run the implementation their
model runner chose when it was built, not one decided per call from ``MINIVLLM_CPU_KERNELS`` (notebook 09 switches
it between two engines that share one model)."""

import pytest
import torch

from minivllm import LLMEngine, SamplingParams, custom_ops
from minivllm.model.custom_op import CustomOp
from minivllm.model.loader import build_tiny_model

KERNELS = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding")

needs_kernels = pytest.mark.skipif(not custom_ops.load(), reason="the CPU kernels cannot be built here")


def _methods(model):
    return {type(m).__name__: m.forward_method_name for m in model.modules() if isinstance(m, CustomOp)}



def _run(eng, req_id):
    eng.add_request(req_id, {"prompt_token_ids": list(range(3, 30))}, SamplingParams(temperature=0, max_tokens=3))
    tokens = []
    while eng.has_unfinished_requests():
        tokens += [t for o in eng.step() for t in o.outputs[0].token_ids]
    return tokens


@needs_kernels
def test_the_runner_chooses_once_and_two_engines_share_a_model(monkeypatch, count_kernel_calls):
    model = build_tiny_model(dtype=torch.bfloat16)
    calls = count_kernel_calls(KERNELS)
    monkeypatch.setenv("MINIVLLM_CPU_KERNELS", "1")
    with_kernels = LLMEngine(model, enable_prefix_caching=False)
    assert set(_methods(model).values()) == {"forward_cpu"}
    monkeypatch.setenv("MINIVLLM_CPU_KERNELS", "0")  # after the runner was built: changes nothing for it
    _run(with_kernels, "a")
    assert all(calls[name] > 0 for name in KERNELS), calls

    without = LLMEngine(model, enable_prefix_caching=False)  # same model, kernels off
    assert set(_methods(model).values()) == {"forward_native"}
    calls.update({name: 0 for name in KERNELS})
    _run(without, "b")
    assert calls == {name: 0 for name in KERNELS}

    _run(with_kernels, "c")  # the first engine again: its runner re-applies its own choice
    assert set(_methods(model).values()) == {"forward_cpu"}
    assert all(calls[name] > 0 for name in KERNELS), calls


def test_float32_never_dispatches_to_the_kernels(monkeypatch):
    monkeypatch.setenv("MINIVLLM_CPU_KERNELS", "1")
    monkeypatch.setenv("MINIVLLM_CPU_KERNELS_FP32", "0")  # the default (tests/worker/test_fp32_kernels.py: set to 1)
    model = build_tiny_model(dtype=torch.float32)
    LLMEngine(model, enable_prefix_caching=False)
    assert set(_methods(model).values()) == {"forward_native"}
    assert model.custom_op_dispatch == ("cpu", False)


@needs_kernels
def test_forward_cpu_falls_back_for_inputs_its_kernel_does_not_take(monkeypatch, count_kernel_calls):
    """A layer dispatched to its kernel still computes float32 input (a shared RoPE, say) and autograd on the
    PyTorch formula, with the same result as ``forward_native``."""
    model = build_tiny_model(dtype=torch.bfloat16)
    model.set_custom_op_dispatch("cpu", True)
    calls = count_kernel_calls(KERNELS)
    norm = model.model.norm
    x = torch.randn(5, norm.weight.shape[0])
    with torch.no_grad():
        assert torch.equal(norm.float()(x), norm.forward_native(x))  # float32: no kernel
    xb = x.bfloat16()
    assert torch.equal(norm.bfloat16()(xb), norm.forward_native(xb))  # grad enabled: no kernel
    assert calls == {name: 0 for name in KERNELS}
    with torch.no_grad():
        norm(xb)
    assert calls["rms_norm"] == 1


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this PyTorch has no oneDNN")
def test_onednn_packing_is_read_when_the_model_is_built_not_at_import(monkeypatch):
    """``MINIVLLM_ONEDNN_PACKING`` is read as ``envs.py`` says every variable is: when it is used (a layer built, a
    model loaded), not once when ``packed_linear`` was imported; ``packed_linear.ENABLED`` stays the course's switch
    for every layer at once (notebook 09)."""
    from minivllm.model import packed_linear

    x = torch.randn(4, 64)  # float32 rows in FP32_PACKED_TOKENS: the packed path exists on any oneDNN CPU

    def packs(layer):
        layer._packed_weight.set_float32(True)
        with torch.no_grad():  # the packed op has no backward
            return layer._packed_weight.usable(x, layer.weight)

    monkeypatch.delenv("MINIVLLM_ONEDNN_PACKING", raising=False)
    assert packs(packed_linear.Linear(64, 32))
    monkeypatch.setenv("MINIVLLM_ONEDNN_PACKING", "0")  # set after the module was imported
    assert not packs(packed_linear.Linear(64, 32))
    model = build_tiny_model(dtype=torch.bfloat16)  # the loader sets the dispatch: every packed weight reads it
    assert not any(m._packed_weight.enabled for m in model.modules() if hasattr(m, "_packed_weight"))
    monkeypatch.setenv("MINIVLLM_ONEDNN_PACKING", "1")
    layer = packed_linear.Linear(64, 32)
    monkeypatch.setattr(packed_linear, "ENABLED", False)
    assert not packs(layer)
