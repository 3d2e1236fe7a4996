"""``bench --compile``: minivllm's model under ``torch.compile``, the way vLLM 0.32's CPU build compiles its own, to
measure what compilation is worth for minivllm (issue 27; ``OPTIMISATIONS.md``, "torch.compile and OpenMP binding").

vLLM 0.32 on the CPU (``vllm/platforms/cpu.py``, ``check_and_update_config``) turns its default ``VLLM_COMPILE``
into ``CompilationMode.DYNAMO_TRACE_ONCE`` with the ``inductor`` backend and the options in ``INDUCTOR_OPTIONS``:
one Dynamo trace of the whole model (``fullgraph=True``, ``vllm/compilation/wrapper.py``,
``TorchCompileWithNoGuardsWrapper``). In that graph the attention is one opaque custom op,
``unified_attention_with_output`` (``vllm/model_executor/layers/attention/attention.py``), which finds the step's
metadata in the forward context (``vllm/forward_context.py``), and each linear layer is another, oneDNN's
``onednn_mm`` (``dispatch_cpu_unquantized_gemm``, ``vllm/model_executor/layers/utils.py``). Inductor generates code
for what lies between them: the residual add and RMSNorm, SiLU-and-mul, RoPE, the embedding gather (vLLM's own
kernels for those are off under inductor, so their ``forward_native`` is what gets traced).

``compile_model(model)`` does the same to a ``LlamaForCausalLM``: its ``forward`` becomes one compiled graph of all
decoder layers in which every attention (``minivllm_bench::attention``, the model runner's backend implementation)
and every linear layer (``minivllm_bench::linear``, the layer's own forward: oneDNN's packed product, or
``skinny_gemm`` for one row) is an opaque op, with RMSNorm, SiLU-and-mul and RoPE as their ``forward_native`` for
inductor to fuse. The products and the paged attention are thus the engine's own; what changes is everything
between them and the Python that calls them. The greedy tokens stay the eager engine's
(``tests/bench/test_compiled_model.py``).

Where it differs from vLLM 0.32: Dynamo's guards are kept (``dynamic=True``: one graph for every step size, and a
second for one-token steps, which Dynamo specialises), where vLLM marks the token dimension dynamic and drops every
guard; and the opaque ops are Python custom ops (``torch.library.custom_op``), which cost about 12-22 µs per call
more than calling their bodies (measured on a 2-core AMD EPYC, ``OPTIMISATIONS.md``), where vLLM's are C++.

It lives in the benchmark, not the engine: measured back to back it was not faster than the eager engine on this
project's machines (``OPTIMISATIONS.md``), and compiling SmolLM2 takes about a minute on two cores (inductor caches
the result under ``TORCHINDUCTOR_CACHE_DIR``, so a second process compiles faster).
"""

from __future__ import annotations

import types
from typing import Any, Dict, List

import torch
import torch.nn.functional as F
from torch import Tensor

# vLLM 0.32's inductor options on the CPU (vllm/platforms/cpu.py, check_and_update_config).
INDUCTOR_OPTIONS: Dict[str, Any] = {"dce": True, "size_asserts": False, "nan_asserts": False, "epilogue_fusion": True,
                    "cpp.dynamic_threads": True}

# The forward context of the step being run (vLLM: vllm/forward_context.py): the opaque ops find the attention
# metadata and the modules here, by index, since a custom op takes tensors and numbers only.
_CONTEXT: Dict[str, Any] = {}


@torch.library.custom_op("minivllm_bench::attention", mutates_args=("kv_cache",))
def attention(query: Tensor, key: Tensor, value: Tensor, kv_cache: Tensor, layer: int) -> Tensor:
    """Layer ``layer``'s attention implementation on ``query [T, H, D]``, ``key, value [T, Hkv, D]``; writes their K/V
    into ``kv_cache`` first and returns ``[T, H, D]`` (vLLM: ``unified_attention_with_output``)."""
    return _CONTEXT["attn"][layer].impl.forward(query, key, value, kv_cache, _CONTEXT["md"])


@attention.register_fake
def _attention_fake(query, key, value, kv_cache, layer):
    return torch.empty_like(query)


@torch.library.custom_op("minivllm_bench::linear", mutates_args=())
def linear(x: Tensor, layer: int) -> Tensor:
    """``x [T, in]`` through linear layer number ``layer`` of the model (its eager forward) -> ``[T, out]``
    (vLLM: ``onednn_mm``)."""
    return _CONTEXT["linears"][layer](x)


@linear.register_fake
def _linear_fake(x, layer):
    return x.new_empty(x.shape[0], _CONTEXT["linears"][layer].weight.shape[0])


def _linears(model) -> List[torch.nn.Module]:
    return [m for layer in model.model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                        layer.mlp.gate_up_proj, layer.mlp.down_proj)]


def _graph(model, input_ids: Tensor, positions: Tensor, kv_caches: List[Tensor]) -> Tensor:
    """``LlamaModel.forward`` with the attention and the linear layers as opaque ops and the rest as PyTorch
    formulas (``forward_native``): what Dynamo traces."""
    m = model.model
    hidden = F.embedding(input_ids, m.embed_tokens.weight)
    t = hidden.shape[0]
    residual = None
    for i, layer in enumerate(m.layers):
        a = layer.self_attn
        if residual is None:
            residual, hidden = hidden, layer.input_layernorm.forward_native(hidden)
        else:
            hidden, residual = layer.input_layernorm.forward_native(hidden, residual)
        qkv = linear(hidden, 4 * i)
        qk = qkv[:, : a.q_size + a.kv_size].view(t, a.num_heads + a.num_kv_heads, a.head_dim)
        q, k = a.rotary_emb.forward_native(positions, qk)[0].split([a.num_heads, a.num_kv_heads], dim=1)
        v = qkv[:, a.q_size + a.kv_size:].view(t, a.num_kv_heads, a.head_dim)
        o = attention(q.contiguous(), k.contiguous(), v.contiguous(), kv_caches[i], i)
        hidden = linear(o.reshape(t, a.q_size), 4 * i + 1)
        hidden, residual = layer.post_attention_layernorm.forward_native(hidden, residual)
        hidden = linear(layer.mlp.act_fn.forward_native(linear(hidden, 4 * i + 2)), 4 * i + 3)
    return m.norm.forward_native(hidden, residual)[0]


def compile_model(model) -> None:
    """Run ``model`` (a ``LlamaForCausalLM`` on the CPU, one tensor-parallel rank) through one ``torch.compile`` graph
    from its next forward on (module doc). The first steps compile (about a minute for SmolLM2 on two cores); a
    step whose KV connector saves layer by layer (``model.layer_hooks``) runs eagerly. ``uncompile_model`` undoes it.

    Raises:
        ValueError: for a model that is not on the CPU, or whose layers are split across tensor-parallel ranks
            (their all-reduces are not in the graph).
    """
    from minivllm.model.llama import LlamaForCausalLM

    if not isinstance(model, LlamaForCausalLM):
        raise ValueError(f"compile_model: model must be a LlamaForCausalLM, got {type(model).__name__}")
    device = model.model.embed_tokens.weight.device
    if device.type != "cpu":
        raise ValueError(f"compile_model: the model must be on the CPU (vLLM's CPU compilation), it is on {device}")
    if getattr(model.model.layers[0].mlp, "down_proj").tp_size != 1:
        raise ValueError("compile_model: tensor_parallel_size must be 1 (the all-reduces are not in the graph)")
    compiled = torch.compile(lambda ids, pos, kvs: _graph(model, ids, pos, kvs), dynamic=True, fullgraph=True,
                             options=INDUCTOR_OPTIONS)
    eager = type(model).forward
    attn = [layer.self_attn for layer in model.model.layers]
    linears = _linears(model)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: List[Tensor], md) -> Tensor:
        if self.layer_hooks:
            return eager(self, input_ids, positions, kv_caches, md)
        _CONTEXT.update(md=md, attn=attn, linears=linears)
        try:
            return compiled(input_ids, positions, kv_caches)
        finally:
            _CONTEXT.clear()  # the step's metadata and modules are not kept past it

    setattr(model, "forward", types.MethodType(forward, model))  # an instance attribute: nn.Module calls it


def uncompile_model(model) -> None:
    """Give ``model`` back its eager forward (after ``compile_model``; a no-op otherwise)."""
    model.__dict__.pop("forward", None)


def is_compiled(model) -> bool:
    """Whether ``compile_model`` was applied to ``model`` and not undone."""
    return "forward" in model.__dict__
