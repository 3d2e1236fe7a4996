"""The CPU-kernels attention backend: minivllm's C++ paged-attention kernels for bfloat16 on the CPU, and for
float32 under ``MINIVLLM_CPU_KERNELS_FP32=1`` (vLLM: ``vllm/v1/attention/backends/cpu_attn.py`` over ``csrc/cpu``).

Decode requests run through ``custom_ops.paged_attention_decode`` (bfloat16 or float32), which reads each request's
blocks in place: no gather, padding, mask, groups or workspace. Prefill chunks run through
``custom_ops.paged_attention_prefill`` where the head size is 64 or 128 and the kernels are built for the model's
dtype on this CPU (bfloat16: AVX512-BF16; float32: AVX2 and FMA); elsewhere through PyTorch SDPA
(``torch_sdpa.sdpa_prefill``). The kernel choice is made once per dtype, when the implementation is built: each
``CPUAttentionImpl`` holds the operators it calls; only the lookup by dtype is per call, because the implementation
is built before it sees a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple, Type

import torch

from minivllm import custom_ops
from minivllm.attention import paged_attention as ops
from minivllm.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from minivllm.attention.backends.torch_sdpa import sdpa_prefill


def prefill_kernel_supported(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether ``custom_ops.paged_attention_prefill`` runs here for this head size and dtype."""
    return head_dim in (64, 128) and custom_ops.prefill_kernel_available(dtype)


@dataclass(frozen=True, eq=False)
class CPUAttentionMetadata(AttentionMetadata):
    """Attributes (``D`` decode requests, ``P`` prefill requests):
    decode_token_idx: ``int64 [D]`` row of each decode request's query token.
    decode_block_table: ``int64 [D, nblk]``; decode_seq_lens: ``int64 [D]``.
    prefill_reqs: indices of the prefill requests (for the SDPA fallback).
    prefill_block_table: ``int64 [P, max_blocks]``; prefill_query_start, prefill_query_lens,
        prefill_context_lens: ``int64 [P]`` (the kernel's arguments).
    """

    decode_token_idx: torch.Tensor = torch.empty(0, dtype=torch.long)
    decode_block_table: torch.Tensor = torch.empty(0, 0, dtype=torch.long)
    decode_seq_lens: torch.Tensor = torch.empty(0, dtype=torch.long)
    prefill_reqs: Tuple[int, ...] = ()
    prefill_block_table: torch.Tensor = torch.empty(0, 0, dtype=torch.long)
    prefill_query_start: torch.Tensor = torch.empty(0, dtype=torch.long)
    prefill_query_lens: torch.Tensor = torch.empty(0, dtype=torch.long)
    prefill_context_lens: torch.Tensor = torch.empty(0, dtype=torch.long)


class CPUAttentionMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common_attn_metadata: CommonAttentionMetadata) -> CPUAttentionMetadata:
        cm = common_attn_metadata
        qlens = cm.query_lens_cpu
        dec = [i for i, q in enumerate(qlens) if q == 1]
        pre = [i for i, q in enumerate(qlens) if q > 1]
        t = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        dec_lens = [cm.seq_lens_cpu_upper_bound[i] for i in dec]
        nblk = -(-max(dec_lens, default=0) // self.block_size)
        return CPUAttentionMetadata(
            **AttentionMetadata.common_fields(cm, self.block_size),
            decode_token_idx=t([cm.query_start_loc_cpu[i] for i in dec]),
            decode_block_table=cm.block_table_tensor[dec, :nblk],
            decode_seq_lens=t(dec_lens),
            prefill_reqs=tuple(pre),
            prefill_block_table=cm.block_table_tensor[pre],
            prefill_query_start=t([cm.query_start_loc_cpu[i] for i in pre]),
            prefill_query_lens=t([qlens[i] for i in pre]),
            prefill_context_lens=t([cm.seq_lens_cpu_upper_bound[i] - qlens[i] for i in pre]),
        )


class CPUAttentionImpl(AttentionImpl):
    """Holds the kernels it calls, taken from ``minivllm.custom_ops`` when it is built."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> None:
        super().__init__(num_heads, head_dim, scale, num_kv_heads)
        self._decode_op = custom_ops.paged_attention_decode
        self._prefill = {dtype: (self._prefill_kernel if prefill_kernel_supported(head_dim, dtype) else
                                 self._prefill_sdpa) for dtype in (torch.bfloat16, torch.float32)}
        self._prefill_op = custom_ops.paged_attention_prefill

    def _prefill_kernel(self, out, query, key, value, kv_cache, md: CPUAttentionMetadata) -> None:
        self._prefill_op(out, query, kv_cache, md.prefill_block_table, md.prefill_query_start,
                         md.prefill_query_lens, md.prefill_context_lens, self.scale)

    def _prefill_sdpa(self, out, query, key, value, kv_cache, md: CPUAttentionMetadata) -> None:
        sdpa_prefill(out, query, key, value, kv_cache, md, md.prefill_reqs, self.scale)

    def forward(self, query, key, value, kv_cache, attn_metadata: CPUAttentionMetadata) -> torch.Tensor:
        md = attn_metadata
        ops.write_kv_cache(key, value, kv_cache, md.slot_mapping)
        out = query.new_empty(query.shape)
        if md.decode_token_idx.numel():
            self._decode_op(out, query, kv_cache, md.decode_block_table, md.decode_seq_lens, md.decode_token_idx,
                            self.scale)
        if md.prefill_reqs:
            self._prefill.get(query.dtype, self._prefill_sdpa)(out, query, key, value, kv_cache, md)
        return out


class CPUAttentionBackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_builder_cls() -> Type[AttentionMetadataBuilder]:
        return CPUAttentionMetadataBuilder

    @staticmethod
    def get_impl_cls() -> Type[AttentionImpl]:
        return CPUAttentionImpl
