"""``bench --compile`` (``minivllm/bench/compiled_model.py``): the model compiled as one graph, as vLLM's CPU build
compiles its own, computes what the eager engine computes on chunked prefills mixed with decodes, on the fast path
and on the reference; the steps really run through compiled graphs (at most two: every step size, and one-token
steps); a step whose KV connector saves layer by layer runs eagerly; and bad models are refused before anything
changes. The tiny random-weight model; no timing asserted."""

import pytest
import torch

from minivllm import LLMEngine, SamplingParams
from minivllm.bench import cli
from minivllm.distributed.kv_transfer import OffloadConnector
from minivllm.bench.compiled_model import compile_model, is_compiled, uncompile_model
from minivllm.model.loader import build_tiny_model
from step_logits import run_keeping_logits

PROMPTS = [list(range(3, 3 + n)) for n in (5, 40, 90)]  # 90 tokens at a budget of 64: two chunks


def _run(model, **engine_kwargs):
    """Greedy, 12 tokens each, token budget 64: (logits of every step, tokens per request)."""
    eng = LLMEngine(model, max_num_batched_tokens=64, enable_prefix_caching=False, **engine_kwargs)
    return run_keeping_logits(eng, PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))


def _assert_same(compiled, eager):
    (compiled_logits, compiled_tokens), (eager_logits, eager_tokens) = compiled, eager
    assert len(compiled_logits) == len(eager_logits) >= 3  # chunked prefill steps, then decodes
    for e, c in zip(eager_logits, compiled_logits):
        # inductor's fused norm, SiLU and RoPE sum in another order than the kernels or PyTorch's operators
        torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-4)
    assert compiled_tokens == eager_tokens


@pytest.mark.parametrize("fast_path", ["1", "0"])
def test_the_compiled_graph_computes_the_eager_engines_logits_and_tokens(monkeypatch, fast_path):
    # fast_path 1: the engine's float32 kernels and packed products (what bench measures); 0: the exact reference.
    monkeypatch.setenv("MINIVLLM_CPU_KERNELS", "1")
    monkeypatch.setenv("MINIVLLM_CPU_KERNELS_FP32", fast_path)
    model = build_tiny_model(dtype=torch.float32)
    eager = _run(model)
    torch._dynamo.utils.counters.clear()
    compile_model(model)
    assert is_compiled(model)
    compiled = _run(model)
    # The steps ran through compiled graphs, not the eager forward, and not one graph per step size.
    assert 1 <= torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2
    _assert_same(compiled, eager)
    uncompile_model(model)
    assert not is_compiled(model)


def test_a_step_whose_connector_saves_layer_by_layer_runs_eagerly():
    # The model runner sets layer hooks for a step with a KV connector; the graph has no place to call them.
    model = build_tiny_model(dtype=torch.float32)
    eager = _run(model, kv_connector=OffloadConnector(16))
    compile_model(model)
    torch._dynamo.utils.counters.clear()
    compiled = _run(model, kv_connector=OffloadConnector(16))
    assert not torch._dynamo.utils.counters["stats"]["unique_graphs"]  # nothing compiled: every step was eager
    _assert_same(compiled, eager)


def test_compile_refuses_other_models_and_devices_before_changing_them(capsys):
    model = build_tiny_model(dtype=torch.float32).to("meta")
    with pytest.raises(ValueError, match="on the CPU"):
        compile_model(model)
    assert not is_compiled(model)
    with pytest.raises(TypeError, match="LlamaForCausalLM"):
        compile_model(torch.nn.Linear(2, 2))
    assert cli.main(["--compile", "--device", "cuda", "--model", "tiny"]) == 2
    assert "--compile runs on the CPU only" in capsys.readouterr().err
