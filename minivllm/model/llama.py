"""A Llama-architecture decoder on a flattened batch (vLLM: ``vllm/model_executor/models/llama.py``).

The model sees no batch dimension: ``input_ids`` and ``positions`` are ``[num_tokens]`` for all requests of a
step concatenated, and attention finds each request's tokens through ``AttentionMetadata``. Weights follow vLLM's
fused layout: ``qkv_proj`` stacks the q, k and v projections, ``gate_up_proj`` stacks gate and up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from minivllm.attention.paged_attention import (
    AttentionMetadata,
    paged_attention,
    reference_paged_attention,
    write_kv_cache,
)
from minivllm import custom_ops
from minivllm.model.packed_linear import Linear, PackedWeight


@dataclass
class LlamaConfig:
    """Hyper-parameters (names as in Hugging Face's ``LlamaConfig``)."""

    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 30
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: Optional[int] = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    bos_token_id: Optional[int] = 1
    eos_token_id: Optional[int] = 2
    name: str = "llama"

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """KV cache bytes per token: 2 (K and V) x layers x kv_heads x head_dim x dtype size."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * torch.finfo(dtype).bits // 8


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, computed in float32 (Zhang & Sennrich 2019).

    ``forward(x)`` returns the normalised ``x [T, hidden]``. ``forward(x, residual)`` first adds ``x`` to the
    residual stream and returns ``(norm(x + residual), x + residual)``, as vLLM's ``RMSNorm`` does
    (``vllm/model_executor/layers/layernorm.py``): in bfloat16 on the CPU both run as one kernel
    (``minivllm.custom_ops``), which then overwrites ``x`` and ``residual`` with the results.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if x.dim() == 2 and custom_ops.usable(x) and self.weight.dtype == x.dtype:
            if residual is None:
                return custom_ops.rms_norm(x, self.weight, self.eps)
            custom_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight.float()).to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, half-split ("NeoX") style as in Hugging Face Llama (Su et al. 2021).

    ``cos_cache`` and ``sin_cache`` (``float32 [max_position, head_dim]``) hold the angles of every position, so a
    token's rotation depends only on its absolute position: a prefill chunk needs nothing from earlier chunks to
    rotate its q/k. Both are full width so one rotation is ``x * cos + rotate_half(x) * sin`` (as in Hugging
    Face's ``apply_rotary_pos_emb``); ``sin_cache`` carries the minus sign of ``rotate_half`` in its first half.
    """

    def __init__(self, head_dim: int, max_position: int, base: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        t = torch.arange(max_position, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        cos, sin = freqs.cos().float(), freqs.sin().float()
        # Plain attributes, not buffers: model.to(bfloat16) must not round the angles (they stay float32).
        self.cos_cache = torch.cat((cos, cos), dim=-1)
        self.sin_cache = torch.cat((-sin, sin), dim=-1)
        self._step = None  # (positions, cos, sin) looked up once per forward pass by ``begin_step``

    def begin_step(self, positions: torch.Tensor) -> None:
        """Look up the angles of ``positions [T]`` once for all layers of this forward pass."""
        if self.cos_cache.device != positions.device:
            self.cos_cache = self.cos_cache.to(positions.device)
            self.sin_cache = self.sin_cache.to(positions.device)
        self._step = (positions, self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1))

    def _angles(self, positions: torch.Tensor):
        if self._step is None or self._step[0] is not positions:
            self.begin_step(positions)
        return self._step[1], self._step[2]

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, heads, head_dim]`` by the angles of ``positions [T]`` (q and k heads may be stacked).

        In bfloat16 on the CPU this rotates ``x`` in place with one kernel (``custom_ops.rotary_embedding``,
        bit-identical) and returns it; otherwise it returns a new tensor.
        """
        if custom_ops.usable(x) and x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
            custom_ops.rotary_embedding(positions, x, x.shape[1], self.cos_cache, self.sin_cache)
            return x
        cos, sin = self._angles(positions)
        return _rotate(x, cos, sin)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """Rotate ``q [T, H, D]`` and ``k [T, Hkv, D]`` by the angles of ``positions [T]``."""
        cos, sin = self._angles(positions)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Bit-identical to cat(x1*cos - x2*sin, x2*cos + x1*sin) in float32: x2*(-sin) == -(x2*sin) exactly.
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat((x2, x1), dim=-1) * sin).to(x.dtype)


class LlamaAttention(nn.Module):
    """Grouped-query self-attention over the paged KV cache."""

    def __init__(self, config: LlamaConfig, backend: str = "sdpa") -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.backend = backend
        self.rotary_emb: Optional[RotaryEmbedding] = None  # shared, set by LlamaModel

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata):
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        # q and k heads are adjacent columns: rotate them in one pass, then split.
        qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb.rotate(positions, qk).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        write_kv_cache(k, v, kv_cache, md.slot_mapping)
        if self.backend == "reference":
            o = reference_paged_attention(q, kv_cache, md, self.scale)
        else:
            o = paged_attention(q, k, v, kv_cache, md, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))`` (Shazeer 2020)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if custom_ops.usable(gate_up) and gate_up.dim() == 2:
            return self.down_proj(custom_ops.silu_and_mul(gate_up))  # one pass, no temporaries
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    As in vLLM, the residual stream is carried beside the layer's output instead of being added at the end of
    each layer: ``forward(positions, hidden, kv_cache, md, residual)`` returns ``(mlp_out, residual)``, and the
    layer's full output is their sum. The next norm adds them (``RMSNorm.forward(x, residual)``), which lets one
    kernel do the add and the norm. Pass ``residual=None`` for the first layer (``hidden`` is then the input).
    """

    def __init__(self, config: LlamaConfig, backend: str = "sdpa") -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, positions, hidden, kv_cache, md, residual: Optional[torch.Tensor] = None):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, md)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig, backend: str = "sdpa") -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, backend) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)
        for layer in self.layers:
            layer.self_attn.rotary_emb = self.rotary_emb


class LlamaForCausalLM(nn.Module):
    """The decoder plus the LM head (tied to the embedding when ``tie_word_embeddings``).

    ``forward`` returns hidden states for *every* token; ``compute_logits`` is applied by the model runner only
    to the rows it needs (the last scheduled token of each request), because the ``hidden x vocab`` LM head is
    the single biggest matmul of a step.
    """

    def __init__(self, config: LlamaConfig, backend: str = "sdpa") -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, backend)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.layer_hooks: List = []  # callables (layer_idx, kv_cache) run after each layer (KV connector saves)
        self._packed_lm_head = PackedWeight()  # the tied LM head is the embedding: packed apart from it

    def set_attention_backend(self, backend: str) -> None:
        """``"sdpa"`` (fast, default) or ``"reference"`` (per-request loop, for reading and testing)."""
        if backend not in ("sdpa", "reference"):
            raise ValueError(f"attention backend must be 'sdpa' or 'reference', got {backend!r}")
        for layer in self.model.layers:
            layer.self_attn.backend = backend

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: List[torch.Tensor], md: AttentionMetadata
    ) -> torch.Tensor:
        """``input_ids, positions: int64 [T]`` -> final hidden states ``[T, hidden_size]``.

        Writes every token's K/V into ``kv_caches[layer]`` at ``md.slot_mapping`` on the way.
        """
        hidden = self.model.embed_tokens(input_ids)
        self.model.rotary_emb.begin_step(positions)
        residual = None
        for i, layer in enumerate(self.model.layers):
            hidden, residual = layer(positions, hidden, kv_caches[i], md, residual)
            for hook in self.layer_hooks:
                hook(i, kv_caches[i])
        return self.model.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden_size]`` -> float32 logits ``[N, vocab_size]``."""
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self._packed_lm_head.linear(hidden, w).float()
