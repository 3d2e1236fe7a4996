"""Checkers for notebook 01: the parts of a Llama decoder layer, and the layer built from them.

Expected values come from ``minivllm.model.llama`` (``RMSNorm``, ``RotaryEmbedding``, ``LlamaMLP``,
``LlamaDecoderLayer``) and from ``reference_paged_attention``; see ``_reference.py``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from minivllm.course.exercises._harness import Variant, check_cases, checker
from minivllm.i18n import N_, _
from minivllm.course.exercises._reference import (
    attention_ref,
    contiguous_attention,
    layer_from_parts,
    rms_norm_ref,
    rope_ref,
    run_reference_layer,
    split_layer_weights,
    swiglu_ref,
)
from minivllm.model.llama import LlamaForCausalLM, LlamaMLP, RMSNorm, RotaryEmbedding


def _rand(g: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * scale


# ---- RMSNorm ---------------------------------------------------------------------------------------------------
@checker("rms_norm")
def check_rms_norm(fn: Callable) -> int:
    """Check ``fn(x, weight, eps) -> y``: RMSNorm over the last dimension (Zhang & Sennrich 2019).

    ``x [..., hidden]`` float32, ``weight [hidden]``, ``eps`` a float; ``y`` has ``x``'s shape and dtype:
    ``y = x / sqrt(mean(x**2 over the last dim) + eps) * weight``. Expected values: ``minivllm.model.llama.RMSNorm``.

    Raises:
        ExerciseFailed: naming the failing input, expected and actual values, and a hint for known mistakes.
    """
    g = torch.Generator().manual_seed(1)

    def ref(x, w, eps):
        m = RMSNorm(x.shape[-1], eps)
        with torch.no_grad():
            m.weight.copy_(w)
            return m(x)

    raw = [
        (_("x [4, 8] random, weight random, eps=1e-5"), _rand(g, 4, 8), _rand(g, 8), 1e-5),
        (_("x [2, 3, 16] (3-D: normalise over the last dimension only), eps=1e-6"), _rand(g, 2, 3, 16, scale=3.0),
         _rand(g, 16), 1e-6),
        (_("x [2, 8] all zeros, weight random, eps=1e-5 (eps keeps 0 / 0 away)"), torch.zeros(2, 8), _rand(g, 8), 1e-5),
        (_("x [3, 8] with values near 1e-3, eps=1e-2 (eps inside the square root matters here)"),
         _rand(g, 3, 8, scale=1e-3), _rand(g, 8), 1e-2),
    ]
    cases = [(d, (x, w, e), ref(x, w, e)) for d, x, w, e in raw]
    variants = [
        Variant(lambda x, w, e: rms_norm_ref(x, w, e, subtract_mean=True),
                N_("this is LayerNorm: RMSNorm does not subtract the mean. Divide x by sqrt(mean(x**2) + eps) directly.")),
        Variant(lambda x, w, e: rms_norm_ref(x, w, 0.0),
                N_("eps is missing: sqrt(mean(x**2) + eps), so an all-zero row gives 0 instead of 0 / 0 = nan.")),
        Variant(lambda x, w, e: rms_norm_ref(x, w, e, eps_outside=True),
                N_("eps goes inside the square root: x / sqrt(mean(x**2) + eps), not x / (sqrt(mean(x**2)) + eps).")),
        Variant(lambda x, w, e: rms_norm_ref(x, w, e, use_weight=False),
                N_("multiply the normalised x by `weight` (one learned scale per hidden dimension).")),
        Variant(lambda x, w, e: rms_norm_ref(x, w, e, over_all=True),
                N_("take the mean over the last dimension only: x.pow(2).mean(dim=-1, keepdim=True).")),
    ]
    return check_cases("rms_norm", fn, cases, variants)


# ---- RoPE ------------------------------------------------------------------------------------------------------
@checker("rope")
def check_rope(fn: Callable) -> int:
    """Check ``fn(x, positions, theta) -> rotated x``: rotary position embedding, half-split (NeoX) style.

    ``x [T, num_heads, head_dim]`` float32, ``positions`` int64 ``[T]`` (absolute positions, not necessarily
    ``0..T-1``), ``theta`` the RoPE base. Dimension ``i`` and ``i + head_dim/2`` form a pair rotated by the angle
    ``position * theta ** (-2i / head_dim)``. Expected values: ``minivllm.model.llama.RotaryEmbedding``.

    Raises:
        ExerciseFailed: naming the failing input, expected and actual values, and a hint for known mistakes.
    """
    g = torch.Generator().manual_seed(2)

    def ref(x, pos, theta):
        return RotaryEmbedding(x.shape[-1], 4096, theta)(pos, x, x)[0]

    raw = [
        (_("x [4, 2, 8], positions [0, 1, 2, 3], theta=10000"), _rand(g, 4, 2, 8), torch.arange(4), 10000.0),
        (_("x [5, 3, 16], positions [7, 0, 31, 2, 100] (rotate by `positions`, not by row number), theta=100000"),
         _rand(g, 5, 3, 16), torch.tensor([7, 0, 31, 2, 100]), 100000.0),
        (_("x [1, 1, 64], positions [4000] (one decode token far into the sequence), theta=100000"),
         _rand(g, 1, 1, 64), torch.tensor([4000]), 100000.0),
    ]
    cases = [(d, (x, p, t), ref(x, p, t)) for d, x, p, t in raw]
    variants = [
        Variant(lambda x, p, t: rope_ref(x, p, t, interleaved=True),
                N_("Llama (Hugging Face; vLLM's is_neox_style=True) pairs dimension i with i + head_dim/2 (the two "
                "halves), not with i + 1 (that is GPT-J's interleaved style).")),
        Variant(lambda x, p, t: rope_ref(x, p, t, sign=-1.0),
                N_("the rotation goes the wrong way: out = cat(x1*cos - x2*sin, x2*cos + x1*sin) with x1, x2 the halves.")),
        Variant(lambda x, p, t: rope_ref(x, p, t, bad_freqs=True),
                N_("pair i turns at theta ** (-2i / head_dim): the exponents are torch.arange(0, head_dim, 2) / head_dim.")),
        Variant(lambda x, p, t: rope_ref(x, p, t, ignore_positions=True),
                N_("rotate each row by its entry of `positions`, not by its row number.")),
    ]
    return check_cases("rope", fn, cases, variants)


# ---- grouped-query attention -----------------------------------------------------------------------------------
_ATTN_VARIANTS = [
    ("none", None, "interleave",
     N_("a query may only see keys at its own position or earlier: mask scores where key index > query index with "
     "-inf before the softmax (causal mask).")),
    ("flipped", None, "interleave", N_("the mask is flipped: query i may see keys 0..i (the lower triangle).")),
    ("bottom_right", None, "repeat",
     N_("query head j shares KV head j // (num_heads // num_kv_heads): expand k and v with "
     "repeat_interleave(group, dim=1), not repeat (which gives head j the KV head j % num_kv_heads).")),
    ("bottom_right", "1/D", "interleave", N_("scale the scores by 1 / sqrt(head_dim), not 1 / head_dim.")),
    ("bottom_right", "1", "interleave", N_("scale the scores q·k by 1 / sqrt(head_dim) before the softmax.")),
]


def _attn_variants(with_context: bool):
    out = []
    for mask, scale, head_map, hint in _ATTN_VARIANTS:
        def f(q, k, v, n=0, _m=mask, _s=scale, _h=head_map):
            d = q.shape[-1]
            s = {None: None, "1/D": 1.0 / d, "1": 1.0}[_s]
            return attention_ref(q, k, v, n, mask=_m, scale=s, head_map=_h)

        out.append(Variant(f if with_context else (lambda q, k, v, _f=f: _f(q, k, v, 0)), hint))
    return out


@checker("gqa_attention")
def check_gqa_attention(fn: Callable) -> int:
    """Check ``fn(q, k, v) -> out``: causal grouped-query attention over the tokens of one sequence.

    ``q [T, num_heads, head_dim]``, ``k, v [T, num_kv_heads, head_dim]`` (float32), ``out [T, num_heads,
    head_dim]``. Scores are scaled by ``1/sqrt(head_dim)``; query head ``j`` uses KV head
    ``j // (num_heads // num_kv_heads)`` (GQA, Ainslie et al. 2023). Expected: ``reference_paged_attention``.

    Raises:
        ExerciseFailed: naming the failing input, expected and actual values, and a hint for known mistakes.
    """
    g = torch.Generator().manual_seed(3)
    shapes = [
        (_("T=5 tokens, 2 query heads, 2 KV heads, head_dim 8 (plain multi-head attention)"), 5, 2, 2, 8),
        (_("T=6 tokens, 4 query heads sharing 2 KV heads, head_dim 8"), 6, 4, 2, 8),
        (_("T=7 tokens, 9 query heads sharing 3 KV heads (SmolLM2's shape), head_dim 16"), 7, 9, 3, 16),
        (_("T=1 token, 4 query heads, 2 KV heads, head_dim 8"), 1, 4, 2, 8),
    ]
    cases = []
    for desc, t, h, hkv, d in shapes:
        q, k, v = _rand(g, t, h, d), _rand(g, t, hkv, d), _rand(g, t, hkv, d)
        cases.append((desc, (q, k, v), contiguous_attention(q, k, v, 0)))
    return check_cases("gqa_attention", fn, cases, _attn_variants(with_context=False))


# ---- SwiGLU MLP -----------------------------------------------------------------------------------------------
@checker("swiglu")
def check_swiglu(fn: Callable) -> int:
    """Check ``fn(x, w_gate, w_up, w_down) -> y``: the SwiGLU feed-forward ``down(silu(gate(x)) * up(x))``.

    ``x [T, hidden]``; weights in ``nn.Linear`` layout ``[out_features, in_features]``: ``w_gate, w_up
    [intermediate, hidden]``, ``w_down [hidden, intermediate]``. Expected: ``minivllm.model.llama.LlamaMLP``.

    Raises:
        ExerciseFailed: naming the failing input, expected and actual values, and a hint for known mistakes.
    """
    g = torch.Generator().manual_seed(4)

    def ref(x, wg, wu, wd):
        from minivllm.model.llama import LlamaConfig

        cfg = LlamaConfig(hidden_size=x.shape[-1], intermediate_size=wg.shape[0], num_attention_heads=1,
                          num_key_value_heads=1)
        m = LlamaMLP(cfg)
        with torch.no_grad():
            m.gate_up_proj.weight.copy_(torch.cat([wg, wu]))
            m.down_proj.weight.copy_(wd)
            return m(x)

    cases = []
    for desc, t, hid, inter in [(_("x [3, 8], intermediate size 12"), 3, 8, 12), (_("x [1, 16], intermediate size 24"), 1, 16, 24)]:
        args = (_rand(g, t, hid), _rand(g, inter, hid, scale=hid ** -0.5), _rand(g, inter, hid, scale=hid ** -0.5),
                _rand(g, hid, inter, scale=inter ** -0.5))
        cases.append((desc, args, ref(*args)))
    variants = [
        Variant(lambda x, a, b, c: swiglu_ref(x, a, b, c, act="silu_up"),
                N_("SiLU goes on the gate projection: silu(x @ w_gate.T) * (x @ w_up.T).")),
        Variant(lambda x, a, b, c: swiglu_ref(x, a, b, c, act="none"),
                N_("apply SiLU (torch.nn.functional.silu) to the gate projection before multiplying by the up projection.")),
        Variant(lambda x, a, b, c: swiglu_ref(x, a, b, c, act="gelu"),
                N_("the activation is SiLU (x * sigmoid(x)), not GELU.")),
        Variant(lambda x, a, b, c: swiglu_ref(x, a, b, c, act="silu_only"),
                N_("multiply silu(gate) element-wise by the up projection x @ w_up.T before the down projection.")),
    ]
    return check_cases("swiglu", fn, cases, variants)


# ---- the whole layer ------------------------------------------------------------------------------------------
@checker("decoder_layer")
def check_decoder_layer(fn: Callable, model: Optional[LlamaForCausalLM] = None) -> int:
    """Check ``fn(x, positions, w, cfg) -> out``: one Llama decoder layer built from separate weights.

    ``x [T, hidden]`` float32 hidden states of one sequence, ``positions`` int64 ``[T]``, ``w`` the dict of
    separate weights from ``split_layer_weights(layer)`` (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
    ``gate_proj``, ``up_proj``, ``down_proj``, ``input_layernorm``, ``post_attention_layernorm``), ``cfg`` the
    model's ``LlamaConfig``. Expected: minivllm's ``LlamaDecoderLayer`` (fused weights) on the same input.

    Tests two layers of the tiny random model (``build_tiny_model()``) and, when ``model`` is given, its first and
    last layer on the embeddings of real tokens.

    Raises:
        ExerciseFailed: naming the failing input, expected and actual values, and a hint for known mistakes.
    """
    from minivllm.model.loader import build_tiny_model

    g = torch.Generator().manual_seed(5)
    tiny = build_tiny_model()
    cases = []
    # A constant shift of all positions cancels in q·k (RoPE scores depend on distances only), so the second case
    # has gaps: a layer that rotates by torch.arange(T) instead of `positions` fails it.
    for desc, idx, pos in [(_("tiny model layer 0, T=6 tokens at positions 0..5"), 0, torch.arange(6)),
                           (_("tiny model layer 1, T=5 tokens at positions [0, 3, 4, 8, 9] (use `positions`)"), 1,
                            torch.tensor([0, 3, 4, 8, 9]))]:
        layer, x = tiny.model.layers[idx], _rand(g, len(pos), tiny.config.hidden_size)
        cases.append((desc, (x, pos, split_layer_weights(layer), tiny.config), run_reference_layer(layer, x, pos)))
    atol, rtol = 1e-4, 1e-4
    if model is not None:
        n = model.config.num_hidden_layers
        ids = torch.randint(0, model.config.vocab_size, (7,), generator=g)
        with torch.no_grad():
            x = model.model.embed_tokens(ids).float()
        for idx in sorted({0, n - 1}):
            layer = model.model.layers[idx]
            desc = _("{model} layer {idx}, embeddings of 7 random tokens at positions 0..6").format(
                model=repr(model.config.name), idx=idx)
            pos = torch.arange(7)
            cases.append((desc, (x, pos, split_layer_weights(layer), model.config), run_reference_layer(layer, x, pos)))
    variants = [
        Variant(lambda x, p, w, c: layer_from_parts(x, p, w, c, residual=False),
                N_("add the residual connections: x = x + attention(...), then x = x + mlp(...).")),
        Variant(lambda x, p, w, c: layer_from_parts(x, p, w, c, prenorm=False),
                N_("Llama normalises *before* each sub-layer (pre-norm): x + attn(rms_norm(x)), not rms_norm(x + attn(x)).")),
        Variant(lambda x, p, w, c: layer_from_parts(x, p, w, c, swap_gate_up=True),
                N_("gate and up are swapped: silu goes on x @ gate_proj.T.")),
        Variant(lambda x, p, w, c: layer_from_parts(x, p, w, c, causal=False),
                N_("attention must be causal: token i sees tokens 0..i only.")),
        Variant(lambda x, p, w, c: layer_from_parts(x, p, w, c, use_positions=False),
                N_("rotate q and k by `positions`, not by torch.arange(T).")),
    ]
    general = (_("run the part checkers first (check_rms_norm, check_rope, check_gqa_attention, check_swiglu); the "
               "layer is h = x + o_proj(attention(rope(q), rope(k), v)) of rms_norm(x), then h + mlp(rms_norm(h))."))
    return check_cases("decoder_layer", fn, cases, variants, atol=atol, rtol=rtol, general_hint=general)

