"""The reference attention backend: one request at a time, written for reading (no vLLM counterpart; it computes
what ``vllm/v1/attention/backends/flash_attn.py`` computes, the slow and obvious way).

Every other backend is tested against ``reference_paged_attention`` (``tests/worker/test_paged_attention.py``,
``tests/worker/test_custom_ops.py``), and notebook 03 compares the learner's paged attention with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Type

import torch

from minivllm.attention import paged_attention as ops
from minivllm.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)


@dataclass(frozen=True, eq=False)
class ReferenceAttentionMetadata(AttentionMetadata):
    """Nothing beyond ``AttentionMetadata``: the reference loops over requests with the ``*_cpu`` lists."""


class ReferenceAttentionMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common_attn_metadata: CommonAttentionMetadata) -> ReferenceAttentionMetadata:
        return ReferenceAttentionMetadata(**AttentionMetadata.common_fields(common_attn_metadata, self.block_size))


def reference_paged_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Attention for every request of the batch, one request at a time, written for reading.

    Args:
        query: ``[num_tokens, num_heads, head_dim]``.
        kv_cache: the layer's cache, already holding this step's keys and values.
        md: the step's metadata (any backend's: only the ``AttentionMetadata`` fields are read).
        scale: ``1 / sqrt(head_dim)``.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``query``'s dtype (computed in float32).
    """
    out = torch.empty_like(query)
    num_heads = query.shape[1]
    for i, (q_len, ctx) in enumerate(zip(md.query_lens_cpu, md.num_computed_tokens_cpu)):
        s = md.query_start_loc_cpu[i]
        k, v = ops.gather_kv(kv_cache, md.block_table[i], ctx + q_len)
        group = num_heads // k.shape[1]
        k = k.repeat_interleave(group, dim=1).float()  # grouped-query attention: share each KV head
        v = v.repeat_interleave(group, dim=1).float()
        q = query[s : s + q_len].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        scores = scores.masked_fill(~ops.chunk_causal_mask(ctx, q_len, query.device), float("-inf"))
        out[s : s + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(query.dtype)
    return out


class ReferenceAttentionImpl(AttentionImpl):
    def forward(self, query, key, value, kv_cache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        ops.write_kv_cache(key, value, kv_cache, attn_metadata.slot_mapping)
        return reference_paged_attention(query, kv_cache, attn_metadata, self.scale)


class ReferenceAttentionBackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "REFERENCE"

    @staticmethod
    def get_builder_cls() -> Type[AttentionMetadataBuilder]:
        return ReferenceAttentionMetadataBuilder

    @staticmethod
    def get_impl_cls() -> Type[AttentionImpl]:
        return ReferenceAttentionImpl
