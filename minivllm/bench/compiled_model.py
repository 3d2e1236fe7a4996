"""``bench --compile``: minivllm's model under ``torch.compile``, the way vLLM 0.32's CPU build compiles its own, to
measure what compilation is worth for minivllm (issue 27; ``OPTIMISATIONS.md``, "torch.compile and OpenMP binding").

vLLM 0.32 on the CPU (``check_and_update_config`` in ``vllm/platforms/cpu.py``) turns its default ``VLLM_COMPILE``
into `CompilationMode.DYNAMO_TRACE_ONCE
<https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/platforms/cpu.py#L366>`_ with the ``inductor`` backend and
the options in ``INDUCTOR_OPTIONS``: one Dynamo trace of the whole model (``fullgraph=True``,
`TorchCompileWithNoGuardsWrapper <https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/compilation/wrapper.py#L64>`_).
In that graph each layer's attention is two opaque ops, `unified_kv_cache_update
<https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/model_executor/layers/attention/attention.py#L724>`_ and
`unified_attention_with_output
<https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/model_executor/layers/attention/attention.py#L767>`_, which
find the KV cache and the step's metadata in the forward context (``vllm/forward_context.py``), and each linear layer
is another, oneDNN's ``onednn_mm`` (a C++ op; `dispatch_cpu_unquantized_gemm
<https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/model_executor/layers/utils.py#L470>`_). Inductor generates
the code between them: with the inductor backend vLLM's ``custom_ops`` is ``"none"``, so SiLU-and-mul and RoPE are
traced as their ``forward_native``; RMSNorm's ``forward_native`` calls vLLM's IR ops, whose CPU implementation is
the PyTorch formula, traced inline (``ir_enable_torch_wrap = False``); the embedding is a plain gather.

``compile_model(model)`` does the same to a ``LlamaForCausalLM``: its ``forward`` becomes one compiled graph of all
decoder layers in which each attention (``minivllm_bench::attention``: the model runner's backend implementation,
which writes the step's K/V and attends in one call) and each linear layer (``minivllm_bench::linear``: the layer's
own forward, oneDNN's packed product or ``skinny_gemm`` for one row) is an opaque op, with RMSNorm, SiLU-and-mul and
RoPE as their ``forward_native`` for inductor to fuse. The ops are registered as vLLM registers its Python ops
(`direct_register_custom_op
<https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/utils/torch_utils.py#L1068>`_: ``Library.define`` and
``Library.impl`` on the dispatch key, not ``torch.library.custom_op``, whose dispatch costs more per call) and,
like vLLM's, take the KV caches and the metadata from a forward context instead of as arguments, so the graph
mutates none of its inputs.
The products and the paged attention are thus the engine's own; what changes is everything between them and the
Python that calls them. Logits and greedy tokens stay the eager engine's (``tests/bench/test_compiled_model.py``).

Where it differs from vLLM 0.32: Dynamo's guards are kept (``dynamic=True``: one graph for every step size, and a
second for one-token steps, which Dynamo specialises), where vLLM marks the token dimension dynamic and drops every
guard; the attention is one op, not two, because minivllm's ``AttentionImpl.forward`` writes the KV cache itself;
and the linear op is Python calling the engine's layer, where vLLM's ``onednn_mm`` is C++.

It lives in the benchmark, not the engine: measured back to back it was level with the eager engine on this
project's machines (a few per cent faster at batch 1 at best), for 100-240 MiB more resident memory and a compile
before the first step: about a minute for SmolLM2 on two cores, 30 s once inductor's cache
(``TORCHINDUCTOR_CACHE_DIR``) holds the kernels (``OPTIMISATIONS.md``).
"""

from __future__ import annotations

import types
from typing import Any, Callable, Dict, List

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.library import infer_schema

# vLLM 0.32's inductor options on the CPU (vllm/platforms/cpu.py, check_and_update_config; and
# enable_auto_functionalized_v2, which CompilationConfig.__post_init__ adds: vllm/config/compilation.py).
INDUCTOR_OPTIONS: Dict[str, Any] = {"dce": True, "size_asserts": False, "nan_asserts": False, "epilogue_fusion": True,
                                    "cpp.dynamic_threads": True, "enable_auto_functionalized_v2": False}

# The forward context of the step being run (vLLM: vllm/forward_context.py): the opaque ops find the attention
# metadata, the KV caches and the modules here, by layer index, since an op takes tensors and numbers only. One
# step at a time per process: the engine steps one model at a time.
_CONTEXT: Dict[str, Any] = {}
_LIB = torch.library.Library("minivllm_bench", "FRAGMENT")  # the ops live as long as this object


def _register(name: str, fn: Callable, fake: Callable) -> Any:
    """Register ``fn`` as ``minivllm_bench::name`` on the CPU with ``fake`` for tracing, as vLLM's
    ``direct_register_custom_op`` does; returns the op."""
    _LIB.define(name + infer_schema(fn, mutates_args=()))
    _LIB.impl(name, fn, "CPU")
    _LIB._register_fake(name, fake)
    return getattr(torch.ops.minivllm_bench, name)


def _attention(query: Tensor, key: Tensor, value: Tensor, layer: int) -> Tensor:
    """Layer ``layer``'s attention on ``query [T, H, D]``, ``key, value [T, Hkv, D]`` (the model's dtype): writes
    their K/V into the layer's KV cache, then returns ``[T, H, D]`` (vLLM: ``unified_kv_cache_update`` followed by
    ``unified_attention_with_output``)."""
    return _CONTEXT["attn"][layer].impl.forward(query, key, value, _CONTEXT["kv_caches"][layer], _CONTEXT["md"])


def _linear(x: Tensor, layer: int) -> Tensor:
    """``x [T, in]`` through linear layer number ``layer`` of the model (its eager forward) -> ``[T, out]``
    (vLLM: ``onednn_mm``)."""
    return _CONTEXT["linears"][layer](x)


attention = _register("attention", _attention, lambda query, key, value, layer: torch.empty_like(query))
linear = _register("linear", _linear,
                   lambda x, layer: x.new_empty(x.shape[0], _CONTEXT["linears"][layer].out_features))


def _linears(model) -> List[torch.nn.Module]:
    return [m for layer in model.model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                        layer.mlp.gate_up_proj, layer.mlp.down_proj)]


def _graph(model, input_ids: Tensor, positions: Tensor) -> Tensor:
    """``LlamaModel.forward`` with the attention and the linear layers as opaque ops and the rest as PyTorch
    formulas (``forward_native``): what Dynamo traces. ``input_ids, positions: int64 [T]`` -> the final hidden
    states ``[T, hidden_size]`` in the model's dtype; the KV caches are the forward context's."""
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
        o = attention(q.contiguous(), k.contiguous(), v.contiguous(), i)
        hidden = linear(o.reshape(t, a.q_size), 4 * i + 1)
        hidden, residual = layer.post_attention_layernorm.forward_native(hidden, residual)
        hidden = linear(layer.mlp.act_fn.forward_native(linear(hidden, 4 * i + 2)), 4 * i + 3)
    return m.norm.forward_native(hidden, residual)[0]


def _drop_global_state_guards(entries) -> List[bool]:
    """Dynamo's guard filter: keep every guard but the global-state one, which checks among others the thread count;
    the engine's thread governor changes it between steps (``minivllm/worker/cpu_threads.py``), and each change would
    recompile the graph, whose code reads the thread count when it runs (``cpp.dynamic_threads``). vLLM drops every
    guard (``torch.compiler.skip_all_guards_unsafe``, ``vllm/compilation/wrapper.py``)."""
    return [entry.guard_type != "GLOBAL_STATE" for entry in entries]


def compile_model(model) -> None:
    """Run ``model`` (a ``LlamaForCausalLM`` on the CPU, one tensor-parallel rank) through one ``torch.compile`` graph
    from its next forward on (module doc). The first steps compile (about a minute for SmolLM2 on two cores); a
    step whose KV connector saves layer by layer (``model.layer_hooks``) runs eagerly. Each call compiles afresh
    and tracks its recompilations on its own (``torch.compile``'s ``isolate_recompiles``). ``uncompile_model``
    undoes it.

    Raises:
        TypeError: for a model that is not a ``LlamaForCausalLM``.
        ValueError: for a model that is not on the CPU, or whose layers are split across tensor-parallel ranks
            (their all-reduces are not in the graph). Raised before the model is changed.
    """
    from minivllm.model.llama import LlamaForCausalLM

    if not isinstance(model, LlamaForCausalLM):
        raise TypeError(f"compile_model: model must be a LlamaForCausalLM, got {type(model).__name__}")
    device = model.model.embed_tokens.weight.device
    if device.type != "cpu":
        raise ValueError(f"compile_model: the model must be on the CPU (vLLM's CPU compilation), it is on {device}")
    if model.model.layers[0].mlp.down_proj.tp_size != 1:
        raise ValueError("compile_model: tensor_parallel_size must be 1 (the all-reduces are not in the graph)")
    for layer in model.model.layers:
        # Fill the rotary embedding's per-device tables now (one call fills them; the layers may share one): traced
        # empty, Dynamo would guard on the branch that fills them and recompile once they are filled.
        rope = layer.self_attn.rotary_emb
        rope.forward_native(torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, rope.head_size))
    compiled = torch.compile(lambda ids, pos: _graph(model, ids, pos), dynamic=True, fullgraph=True,
                             options={**INDUCTOR_OPTIONS, "guard_filter_fn": _drop_global_state_guards},
                             isolate_recompiles=True)
    eager = type(model).forward
    attn = [layer.self_attn for layer in model.model.layers]
    linears = _linears(model)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: List[Tensor], md) -> Tensor:
        if self.layer_hooks:
            return eager(self, input_ids, positions, kv_caches, md)
        _CONTEXT.update(md=md, kv_caches=kv_caches, attn=attn, linears=linears)
        try:
            return compiled(input_ids, positions)
        finally:
            _CONTEXT.clear()  # the step's metadata, caches and modules are not kept past it

    setattr(model, "forward", types.MethodType(forward, model))  # an instance attribute: nn.Module calls it


def uncompile_model(model) -> None:
    """Give ``model`` back its eager forward (after ``compile_model``; a no-op otherwise)."""
    model.__dict__.pop("forward", None)


def is_compiled(model) -> bool:
    """Whether ``compile_model`` was applied to ``model`` and not undone."""
    return "forward" in model.__dict__
