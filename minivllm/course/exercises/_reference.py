"""Expected values for the checkers, computed with minivllm's own modules on one request.

The checkers never compare against a second hand-written solution when the package has the real thing: an RMSNorm
output comes from ``minivllm.model.llama.RMSNorm``, an attention output from
``minivllm.attention.backends.reference.reference_paged_attention``, a layer output from ``LlamaDecoderLayer``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional, Sequence

import torch

from minivllm.attention.backends.reference import reference_paged_attention
from minivllm.attention.backends.torch_sdpa import TorchSDPAMetadata, TorchSDPAMetadataBuilder
from minivllm.attention.paged_attention import write_kv_cache
from minivllm.worker.block_table import create_common_attn_metadata
from minivllm.model.llama import LlamaDecoderLayer


def one_request_metadata(
    block_table: Sequence[int], num_computed: int, num_new: int, block_size: int,
    positions: Optional[torch.Tensor] = None, num_kv_heads: int = 1, head_dim: int = 1,
) -> TorchSDPAMetadata:
    """Attention metadata for a batch of one request that computes ``num_new`` tokens after ``num_computed``.

    Built as the model runner builds it: ``create_common_attn_metadata``, then the ``TORCH_SDPA`` backend's
    builder (the backend of a float32 model on the CPU). Any backend's metadata carries ``block_table``,
    ``slot_mapping``, ``positions``, ``query_start_loc`` and ``seq_lens``, and ``reference_paged_attention`` reads
    any of them.

    Args:
        block_table: the request's block ids, in position order; must cover ``num_computed + num_new`` tokens.
        num_computed: tokens whose K/V are already in the cache (the context), >= 0.
        num_new: tokens computed in this step (the query length), >= 1.
        block_size: tokens per block.
        positions: ``int64 [num_new]``; default ``num_computed .. num_computed + num_new - 1``.
        num_kv_heads, head_dim: the attention layer's, needed only when a decode step (``num_new == 1``) runs
            through the model's layers.

    Raises:
        ValueError: if ``num_new < 1``, ``num_computed < 0`` or the block table is too short.
    """
    if num_new < 1:
        raise ValueError(f"num_new must be >= 1, got {num_new}")
    if num_computed < 0:
        raise ValueError(f"num_computed must be >= 0, got {num_computed}")
    seq_len = num_computed + num_new
    if len(block_table) * block_size < seq_len:
        raise ValueError(
            f"block_table has {len(block_table)} blocks of {block_size} tokens, too few for {seq_len} tokens"
        )
    cm = create_common_attn_metadata([[int(b) for b in block_table]], [num_computed], [num_new], block_size)
    if positions is not None:
        cm = dataclasses.replace(cm, positions=positions)
    builder = TorchSDPAMetadataBuilder(block_size, 1, num_kv_heads, head_dim, torch.float32, torch.device("cpu"))
    return builder.build(cm)


def contiguous_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_computed: int = 0) -> torch.Tensor:
    """Causal grouped-query attention of ``q [T, H, D]`` over ``k, v [num_computed + T, Hkv, D]``.

    Query row ``i`` is the token at position ``num_computed + i`` and sees keys ``0 .. num_computed + i``.
    Computed by minivllm's ``reference_paged_attention`` on a scratch cache whose blocks are simply 0, 1, 2, ...
    """
    seq_len, hkv, d = k.shape
    t = q.shape[0]
    if seq_len != num_computed + t:
        raise ValueError(f"k has {seq_len} rows; expected num_computed + T = {num_computed} + {t}")
    bs = 16
    nblk = -(-seq_len // bs)
    cache = torch.zeros(2, nblk, bs, hkv, d, dtype=k.dtype)
    all_slots = torch.arange(seq_len)
    write_kv_cache(k, v, cache, all_slots)
    md = one_request_metadata(list(range(nblk)), num_computed, t, bs)
    return reference_paged_attention(q, cache, md, 1.0 / math.sqrt(d))


def run_reference_layer(layer: LlamaDecoderLayer, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``LlamaDecoderLayer`` on the tokens ``x [T, hidden]`` of one request at ``positions [T]``, no context."""
    attn = layer.self_attn
    t = x.shape[0]
    bs = 16
    nblk = -(-t // bs)
    cache = torch.zeros(2, nblk, bs, attn.num_kv_heads, attn.head_dim, dtype=x.dtype)
    md = one_request_metadata(list(range(nblk)), 0, t, bs, positions=positions, num_kv_heads=attn.num_kv_heads,
                              head_dim=attn.head_dim)
    with torch.no_grad():
        out, residual = layer(positions, x.clone(), cache, md)  # the kernels may write their inputs in place
        return out + residual


def split_layer_weights(layer: LlamaDecoderLayer) -> Dict[str, torch.Tensor]:
    """The fused weights of a minivllm (vLLM-layout) layer, sliced into Hugging Face's separate matrices.

    ``qkv_proj.weight`` is ``[q_size + 2 * kv_size, hidden]``: the q rows, then k, then v. ``gate_up_proj.weight``
    is ``[2 * intermediate, hidden]``: the gate rows, then up. All matrices are ``[out_features, in_features]``
    (``nn.Linear`` layout: ``y = x @ W.T``).

    Returns:
        Copies, keyed ``input_layernorm, q_proj, k_proj, v_proj, o_proj, post_attention_layernorm, gate_proj,
        up_proj, down_proj``.
    """
    attn = layer.self_attn
    # Through state_dict: an engine on the float32 fast path keeps a linear layer's weight as packed panels alone
    # (packed_linear.Linear.remove_weight), and state_dict gives its values back.
    sd = {name: t.detach() for name, t in layer.state_dict().items()}
    q, k, v = sd["self_attn.qkv_proj.weight"].split([attn.q_size, attn.kv_size, attn.kv_size], dim=0)
    gate, up = sd["mlp.gate_up_proj.weight"].chunk(2, dim=0)
    return {
        "input_layernorm": sd["input_layernorm.weight"].clone(),
        "q_proj": q.clone(),
        "k_proj": k.clone(),
        "v_proj": v.clone(),
        "o_proj": sd["self_attn.o_proj.weight"].clone(),
        "post_attention_layernorm": sd["post_attention_layernorm.weight"].clone(),
        "gate_proj": gate.clone(),
        "up_proj": up.clone(),
        "down_proj": sd["mlp.down_proj.weight"].clone(),
    }


# ---- parts, with switches that produce the classic mistakes (used to recognise them) ------------------------
def rms_norm_ref(x, weight, eps, *, subtract_mean=False, eps_outside=False, use_weight=True, over_all=False):
    dims = tuple(range(x.dim())) if over_all else (-1,)
    if subtract_mean:
        x = x - x.mean(dims, keepdim=True)
    ms = x.pow(2).mean(dims, keepdim=True)
    y = x / (ms.sqrt() + eps) if eps_outside else x * torch.rsqrt(ms + eps)
    return y * weight if use_weight else y


def rope_ref(x, positions, theta, *, interleaved=False, sign=1.0, bad_freqs=False, ignore_positions=False):
    d = x.shape[-1]
    exps = torch.arange(d // 2, dtype=torch.float64) / d if bad_freqs else torch.arange(0, d, 2, dtype=torch.float64) / d
    inv_freq = 1.0 / (theta ** exps)
    pos = torch.arange(x.shape[0]) if ignore_positions else positions
    ang = sign * torch.outer(pos.to(torch.float64), inv_freq)
    cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = xf.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


def attention_ref(q, k, v, num_computed=0, *, mask="bottom_right", scale=None, head_map="interleave"):
    """Causal GQA attention with switchable mistakes.

    ``mask``: ``bottom_right`` (right: row i is position num_computed + i), ``top_left`` (row i treated as position
    i, the ``is_causal=True`` mistake once there is context), ``flipped`` (upper triangle) or ``none``.
    ``head_map``: ``interleave`` (right: query head j reads KV head j // group) or ``repeat`` (j % num_kv_heads).
    """
    t, h, d = q.shape
    s, hkv, _ = k.shape
    group = h // hkv
    if head_map == "interleave":
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    else:  # query head j reads kv head j % hkv: the `repeat` mistake
        k, v = k.repeat(1, group, 1), v.repeat(1, group, 1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if mask == "flipped":
        allowed = torch.arange(s)[None, :] >= (torch.arange(t)[:, None] + num_computed)
        scores = scores.masked_fill(~allowed, float("-inf"))
    elif mask != "none":
        shift = num_computed if mask == "bottom_right" else 0
        allowed = torch.arange(s)[None, :] <= (torch.arange(t)[:, None] + shift)
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(q.dtype)


def swiglu_ref(x, w_gate, w_up, w_down, *, act="silu_gate"):
    g, u = x @ w_gate.T, x @ w_up.T
    if act == "silu_gate":
        h = torch.nn.functional.silu(g) * u
    elif act == "silu_up":
        h = g * torch.nn.functional.silu(u)
    elif act == "none":
        h = g * u
    elif act == "gelu":
        h = torch.nn.functional.gelu(g) * u
    else:  # "silu_only": no up projection
        h = torch.nn.functional.silu(g)
    return h @ w_down.T


def layer_from_parts(x, positions, w, cfg, *, residual=True, prenorm=True, swap_gate_up=False, causal=True,
                     use_positions=True) -> torch.Tensor:
    """A Llama decoder layer from separate weights; with all switches at default it equals ``LlamaDecoderLayer``."""
    t = x.shape[0]
    h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def norm(y, wt):
        return rms_norm_ref(y, wt, cfg.rms_norm_eps)

    a_in = norm(x, w["input_layernorm"]) if prenorm else x
    q = (a_in @ w["q_proj"].T).view(t, h, d)
    k = (a_in @ w["k_proj"].T).view(t, hkv, d)
    v = (a_in @ w["v_proj"].T).view(t, hkv, d)
    q = rope_ref(q, positions, cfg.rope_theta, ignore_positions=not use_positions)
    k = rope_ref(k, positions, cfg.rope_theta, ignore_positions=not use_positions)
    o = attention_ref(q, k, v, mask="bottom_right" if causal else "none").reshape(t, h * d) @ w["o_proj"].T
    x = x + o if residual else o
    if not prenorm:
        x = norm(x, w["input_layernorm"])
    m_in = norm(x, w["post_attention_layernorm"]) if prenorm else x
    gate, up = ("up_proj", "gate_proj") if swap_gate_up else ("gate_proj", "up_proj")
    m = swiglu_ref(m_in, w[gate], w[up], w["down_proj"])
    x = x + m if residual else m
    if not prenorm:
        x = norm(x, w["post_attention_layernorm"])
    return x

