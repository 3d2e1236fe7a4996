"""The attention backend interface (vLLM: ``vllm/v1/attention/backend.py`` at v0.32.0).

A backend is three classes, chosen once per model runner (``minivllm.attention.selector.get_attn_backend``):

* ``AttentionMetadataBuilder``: turns the step's ``CommonAttentionMetadata`` (built by the model runner) into the
  backend's own frozen metadata, once per step, shared by every layer;
* the metadata type (a frozen subclass of ``AttentionMetadata``);
* ``AttentionImpl``: one per layer; ``forward`` writes the step's keys and values into the layer's paged cache
  and returns the attention output. It reads the metadata and never writes to it.

Backends (``minivllm/attention/backends/``): ``REFERENCE`` (one request at a time, the one to read),
``TORCH_SDPA`` (batched decode matmuls and PyTorch SDPA for prefill chunks) and ``CPU_ATTN`` (minivllm's C++
kernels, bfloat16 on the CPU) and ``TRITON_ATTN`` (Triton kernels that read the paged cache in place; the
default on CUDA).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import List, Type

import torch


@dataclass(frozen=True, eq=False)
class CommonAttentionMetadata:
    """One step's batch as every backend sees it, built by the model runner (vLLM ``CommonAttentionMetadata``).
    Frozen, and compared by identity (``eq=False``): tensors have no single truth value.

    ``R`` = requests this step, ``T`` = tokens this step. Tensors are int64 on the runner's device; ``*_cpu``
    fields are the same numbers as Python lists, for per-request loops without a device synchronisation.

    Attributes:
        query_start_loc: ``[R + 1]``; request ``i``'s query tokens are rows ``query_start_loc[i] :
            query_start_loc[i + 1]`` of the flattened batch.
        seq_lens: ``[R]`` keys each request attends to (context + this step's tokens).
        block_table_tensor: ``[R, max_blocks]`` block ids, padded with the scratch block
            (``minivllm.worker.block_table``).
        slot_mapping: ``[T]`` cache slot of every query token.
        positions: ``[T]`` position of every query token.
        query_start_loc_cpu, seq_lens_cpu_upper_bound: ``R + 1`` and ``R`` ints. vLLM 0.32's names: it keeps no
            ``seq_lens_cpu`` or ``num_computed_tokens_cpu`` any more, and its ``seq_lens_cpu_upper_bound`` is
            exact except for rows of asynchronous speculative decoding (minivllm has none, so here it is exact).
            A request's context is ``seq_lens_cpu_upper_bound[i] - query_lens_cpu[i]``.
        num_reqs, num_actual_tokens, max_query_len, max_seq_len: ints.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    query_start_loc_cpu: List[int]
    seq_lens_cpu_upper_bound: List[int]
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int

    @property
    def query_lens_cpu(self) -> List[int]:
        q = self.query_start_loc_cpu
        return [q[i + 1] - q[i] for i in range(self.num_reqs)]


@dataclass(frozen=True, eq=False)
class AttentionMetadata:
    """What every backend's metadata holds (vLLM: the common part of ``FlashAttentionMetadata``).

    Attributes:
        query_start_loc, seq_lens, slot_mapping, positions: as in ``CommonAttentionMetadata``.
        block_table: ``int64 [R, max_blocks]`` (``CommonAttentionMetadata.block_table_tensor``).
        block_size: tokens per block.
        query_start_loc_cpu, seq_lens_cpu, num_computed_tokens_cpu: Python lists.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    block_size: int
    query_start_loc_cpu: List[int]
    seq_lens_cpu: List[int]
    num_computed_tokens_cpu: List[int]

    @property
    def num_reqs(self) -> int:
        return len(self.query_start_loc_cpu) - 1

    @property
    def query_lens_cpu(self) -> List[int]:
        q = self.query_start_loc_cpu
        return [q[i + 1] - q[i] for i in range(self.num_reqs)]

    @staticmethod
    def common_fields(cm: CommonAttentionMetadata, block_size: int) -> dict:
        """The keyword arguments of this class taken from ``cm`` (for the builders)."""
        seq_lens = cm.seq_lens_cpu_upper_bound
        return dict(
            query_start_loc=cm.query_start_loc, seq_lens=cm.seq_lens, block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping, positions=cm.positions, block_size=block_size,
            query_start_loc_cpu=cm.query_start_loc_cpu, seq_lens_cpu=seq_lens,
            num_computed_tokens_cpu=[s - q for s, q in zip(seq_lens, cm.query_lens_cpu)],
        )


class AttentionMetadataBuilder(ABC):
    """Builds a backend's metadata once per step (vLLM ``AttentionMetadataBuilder``).

    Args:
        block_size: tokens per block.
        num_heads, num_kv_heads, head_dim: the model's attention shape.
        dtype, device: of the KV cache.
    """

    def __init__(self, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.block_size = block_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")

    @abstractmethod
    def build(self, common_attn_metadata: CommonAttentionMetadata) -> AttentionMetadata:
        """The backend's metadata for one step."""

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> AttentionMetadata:
        """Metadata of a pure-decode step whose tensors are static buffers, built without reading any of them
        on the host (it runs inside a CUDA-graph capture). Backends that cannot be captured raise."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")


class AttentionImpl(ABC):
    """One layer's attention (vLLM ``AttentionImpl``).

    Args:
        num_heads, head_dim, scale, num_kv_heads: the layer's shape and softmax scale.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> None:
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads

    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Write ``key, value [T, num_kv_heads, head_dim]`` at ``attn_metadata.slot_mapping`` of ``kv_cache
        [2, num_blocks, block_size, num_kv_heads, head_dim]``, then return the attention of ``query [T,
        num_heads, head_dim]`` over each request's keys ``0 ..`` its own position, ``[T, num_heads, head_dim]``."""


class AttentionBackend(ABC):
    """A backend's name and classes (vLLM ``AttentionBackend``)."""

    @staticmethod
    @abstractmethod
    def get_name() -> str: ...

    @staticmethod
    @abstractmethod
    def get_builder_cls() -> Type[AttentionMetadataBuilder]: ...

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> Type[AttentionImpl]: ...

    supports_cudagraph: bool = False
