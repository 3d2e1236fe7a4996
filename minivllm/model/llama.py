"""A Llama-architecture decoder on a flattened batch (vLLM: ``vllm/model_executor/models/llama.py``).

The model sees no batch dimension: ``input_ids`` and ``positions`` are ``[num_tokens]`` for all requests of a
step concatenated, and attention finds each request's tokens through ``AttentionMetadata``. Weights follow vLLM's
fused layout: ``qkv_proj`` stacks the q, k and v projections, ``gate_up_proj`` stacks gate and up. The parts
(notebook 01 builds each by hand) are in ``minivllm/model/layers/``.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Type

import torch
import torch.nn as nn

from minivllm.attention.backend import AttentionBackend, AttentionMetadata
from minivllm.attention.backends.torch_sdpa import TorchSDPABackend
from minivllm.model.config import LlamaConfig
from minivllm.model.custom_op import CustomOp
from minivllm.model.layers.activation import SiluAndMul
from minivllm.model.layers.layernorm import RMSNorm
from minivllm.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from minivllm.model.layers.logits_processor import LogitsProcessor
from minivllm.model.layers.rotary_embedding import RotaryEmbedding, get_rope
from minivllm.model.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.model.packed_linear import Linear, PackedWeight, release_free_memory

# LlamaConfig, RMSNorm and RotaryEmbedding are imported from here by the course's exercises and notebooks.
__all__ = ["LlamaAttention", "LlamaConfig", "LlamaDecoderLayer", "LlamaForCausalLM", "LlamaMLP", "LlamaModel",
           "RMSNorm", "RotaryEmbedding"]

LayerHook = Callable[[int, torch.Tensor], None]


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))`` (Shazeer 2020), ``[T, hidden] -> [T, hidden]``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    """Grouped-query self-attention over the paged KV cache.

    ``backend`` is an attention backend class (``minivllm.attention.backends``); the layer holds its
    implementation (``self.impl``), as vLLM's ``Attention`` layer does. The model runner picks the backend once
    (``minivllm.attention.selector``) and hands it to every layer with ``set_attention_backend``.
    """

    def __init__(self, config: LlamaConfig, backend: Type[AttentionBackend] = TorchSDPABackend) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads)
        # This rank's heads (all of them on one device): QKVParallelLinear applies vLLM's head rule.
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size)
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.set_attention_backend(backend)
        self.rotary_emb = get_rope(self.head_dim, config.max_position_embeddings, config.rope_theta)

    def set_attention_backend(self, backend: Type[AttentionBackend]) -> None:
        """Attend through ``backend``'s implementation (vLLM builds ``Attention.impl`` from the selected backend)."""
        self.impl = backend.get_impl_cls()(self.num_heads, self.head_dim, self.scale, self.num_kv_heads)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                md: AttentionMetadata) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``; writes the T tokens' K/V into ``kv_cache`` at ``md.slot_mapping``."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        # q and k heads are adjacent columns: rotate them in one pass, then split.
        qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, qk)[0].split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        o = self.impl.forward(q, k, v, kv_cache, md)  # writes k, v into kv_cache first
        return self.o_proj(o.reshape(t, self.q_size))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    As in vLLM, the residual stream is carried beside the layer's output instead of being added at the end of
    each layer: ``forward(positions, hidden, kv_cache, md, residual)`` returns ``(mlp_out, residual)``, and the
    layer's full output is their sum. The next norm adds them (``RMSNorm.forward(x, residual)``), which lets one
    kernel do the add and the norm. Pass ``residual=None`` for the first layer (``hidden`` is then the input).
    """

    def __init__(self, config: LlamaConfig, backend: Type[AttentionBackend] = TorchSDPABackend) -> None:
        super().__init__()
        # Registration order is the parameters' order, which the dummy weights are drawn in: keep it.
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
    """Embedding -> decoder layers -> final norm."""

    def __init__(self, config: LlamaConfig, backend: Type[AttentionBackend] = TorchSDPABackend) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, backend) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: List[torch.Tensor],
                md: AttentionMetadata, layer_hooks: Sequence[LayerHook] = ()) -> torch.Tensor:
        """``input_ids, positions: int64 [T]`` -> final hidden states ``[T, hidden_size]``.

        Writes every token's K/V into ``kv_caches[layer]`` at ``md.slot_mapping`` on the way, and calls each of
        ``layer_hooks`` as ``hook(layer_idx, kv_caches[layer_idx])`` after each layer (the KV connector saves
        there; vLLM calls the connector from its attention layer instead).
        """
        hidden = self.embed_tokens(input_ids)
        residual = None
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, kv_caches[i], md, residual)
            for hook in layer_hooks:
                hook(i, kv_caches[i])
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """The decoder plus the LM head (tied to the embedding when ``tie_word_embeddings``).

    ``forward`` returns hidden states for *every* token; ``compute_logits`` is applied by the model runner only
    to the rows it needs (the last scheduled token of each request), because the ``hidden x vocab`` LM head is
    the single biggest matmul of a step.

    Attributes:
        layer_hooks: callables ``(layer_idx, kv_cache)`` run after each layer; the model runner sets them for a
            step whose KV connector saves layer by layer.
    """

    def __init__(self, config: LlamaConfig, backend: Type[AttentionBackend] = TorchSDPABackend) -> None:
        super().__init__()
        self.config = config
        self.attn_backend = backend
        self.model = LlamaModel(config, backend)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.layer_hooks: List[LayerHook] = []
        self.custom_op_dispatch: Tuple[str, bool] = ("cpu", False)

    def set_custom_op_dispatch(self, device_type: str, use_cpu_kernels: bool) -> None:
        """Choose the implementation of every ``CustomOp`` layer (RMSNorm, SiluAndMul, RoPE) for a model on
        ``device_type``: its C++ kernels on the CPU when ``use_cpu_kernels`` (``custom_ops.use_cpu_kernels``), else
        the PyTorch formulas (``minivllm.model.custom_op``). For a float32 model ``use_cpu_kernels`` is True unless
        ``MINIVLLM_CPU_KERNELS_FP32=0`` (the exact reference); then each layer's ``kernel_dtype`` becomes float32 and
        the linear layers and the LM head multiply with packed float32 weights (``PackedWeight.set_float32``), else
        both stay as for bfloat16 (float32 on PyTorch and MKL). The loader calls it once the weights are in their
        dtype, and each model runner when it is built and before a step if another runner changed it, as for the
        attention backend."""
        self.custom_op_dispatch = (device_type, use_cpu_kernels)
        dtype = self.model.embed_tokens.weight.dtype
        float32 = device_type == "cpu" and use_cpu_kernels and dtype == torch.float32
        for module in self.modules():
            if isinstance(module, CustomOp):
                module.set_dispatch(device_type, use_cpu_kernels, torch.float32 if float32 else torch.bfloat16)
            packed = getattr(module, "_packed_weight", None)  # packed_linear.Linear and LogitsProcessor
            if isinstance(packed, PackedWeight):
                packed.set_float32(float32)
                packed.set_kernels(device_type == "cpu" and use_cpu_kernels)

    def remove_packed_weights(self) -> int:
        """Keep each float32 linear layer's weight as ``packed_gemm``'s panels alone (``Linear.remove_weight``: where
        the fast path's every call reads the panels; vLLM 0.32's CPU build removes its weights after loading the
        same way). The model runner calls it when it takes the model, not the loader: until an engine runs it, a
        model's weights may still be written in place (the course, the tests). The LM head keeps its weight: tied,
        it is the embedding table (vLLM keeps it too, ``remove_weight=False`` in ``vocab_parallel_embedding.py``).

        Returns:
            The number of layers whose weight is now removed.
        """
        removed = sum(m.remove_weight() for m in self.modules() if isinstance(m, Linear))
        if removed:
            release_free_memory()
        return removed

    def set_attention_backend(self, backend: Type[AttentionBackend]) -> None:
        """Give every attention layer an implementation of ``backend`` (the model runner does, with the backend it
        chose: ``minivllm.attention.selector``). ``md`` in ``forward`` must then be that backend's metadata."""
        self.attn_backend = backend
        for layer in self.model.layers:
            layer.self_attn.set_attention_backend(backend)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: List[torch.Tensor],
                md: AttentionMetadata) -> torch.Tensor:
        """``input_ids, positions: int64 [T]`` -> final hidden states ``[T, hidden_size]`` (``LlamaModel.forward``)."""
        return self.model(input_ids, positions, kv_caches, md, self.layer_hooks)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden_size]`` -> float32 logits ``[N, vocab_size]``."""
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Dict[str, torch.Tensor]) -> None:
        """Take ``weights`` (minivllm's fused names, e.g. ``model.layers.0.self_attn.qkv_proj.weight``) as the
        parameters, without copying (``load_state_dict(assign=True)``: the model may live on the meta device).

        ``weights`` are the whole checkpoint's tensors; under tensor parallelism each parallel layer keeps its
        rank's slice (``shard_loaded_weight``: sharding at load time, as vLLM's ``weight_loader``). A tied head
        has no weight of its own: ``lm_head.weight`` is skipped, and the head re-tied afterwards.

        Raises:
            ValueError: naming the missing or unexpected weights.
        """
        tied = self.config.tie_word_embeddings
        weights = {k: v for k, v in weights.items() if not (tied and k == "lm_head.weight")}
        modules = dict(self.named_modules())
        for name in list(weights):
            module_name, _, param_name = name.rpartition(".")
            module = modules.get(module_name)
            if module is not None and hasattr(module, "shard_loaded_weight") and getattr(module, "tp_size", 1) > 1:
                weights[name] = module.shard_loaded_weight(param_name, weights[name]).contiguous()
        result = self.load_state_dict(weights, strict=False, assign=True)
        missing = [k for k in result.missing_keys if not (tied and k == "lm_head.weight")]
        if missing or result.unexpected_keys:
            raise ValueError(f"load_weights: missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}")
        if tied:
            self.lm_head.tie_weights(self.model.embed_tokens)
