"""The Triton attention backend: the KV write and the attention of a whole mixed batch in two Triton kernels per
layer (vLLM: ``vllm/v1/attention/backends/triton_attn.py`` at v0.32.0, ``TRITON_ATTN``).

Per layer and step, ``TritonAttentionImpl.forward`` launches:

1. ``triton_reshape_and_cache_flash``: this step's keys and values go to their slots (``slot_mapping``);
2. ``unified_attention``: every query token of the flattened batch (prefill chunks and decodes alike) attends to
   its request's keys, read through the block table in place, with an online softmax; pure-decode batches of
   few requests over long contexts are split over the context and reduced (``num_par_softmax_segments``).

Both kernels take the step's tensors as they are (``query_start_loc``, ``seq_lens``, ``block_table``,
``slot_mapping``): unlike ``TORCH_SDPA`` there is no decode/prefill split, no gather, no mask and no workspace to
prepare, so the builder only decides the context split, from host integers, without touching a device tensor.

**CUDA graphs** (``minivllm.worker.cuda_graphs``). A captured decode step must have static shapes and read only
static buffers. ``build_for_cudagraph_capture`` therefore returns views of the graph runner's buffers and takes
every launch parameter from the captured *shape*: ``max_seq_len`` is the padded key capacity ``NB * block_size`` of
the bucket, so the grid and the context split are fixed per captured ``(B, NB)``, and the kernel reads the real
``seq_lens`` from the buffer at every replay. Padding rows are one-token requests whose block table rows, slot and
key all point at the scratch block: they write and read only that block. The split's float32 partial results are
allocated by ``unified_attention`` per call, which inside a capture comes from the graph's private memory pool.

Where minivllm differs from vLLM: no sliding window, ALiBi, soft-cap, sinks, fp8 caches or encoder attention; the
context split is chosen per step (``choose_num_segments``) rather than by a fixed ``seq_threshold_3D``; the KV
write is part of ``forward`` (vLLM 0.32 calls ``do_kv_cache_update`` separately); the cache layout is minivllm's
``[2, num_blocks, block_size, num_kv_heads, head_dim]``, whose ``[0]`` and ``[1]`` are exactly the kernels'
``key_cache`` and ``value_cache``.

Triton is imported only when the backend is used (``triton_attn_unavailable``, the builder, the implementation),
so this module imports without Triton; the selector chooses the backend only where the kernels can run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Type

import torch

from minivllm.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)


def triton_attn_unavailable(device: torch.device, dtype: torch.dtype, head_size: Optional[int] = None) -> Optional[str]:
    """Why ``TRITON_ATTN`` cannot run for a model on ``device`` in ``dtype``, or ``None`` when it can.

    It can on CUDA with compiled kernels (float32, float16, bfloat16), and on the CPU only through Triton's
    interpreter (``TRITON_INTERPRET=1`` set before the process first imported triton), in float32 or float16
    (the interpreter's ``tl.dot`` of bfloat16 tiles is wrong: ``minivllm.attention.ops.triton_utils``). The head
    size must be a power of two in ``[16, 256]`` (``tl.dot`` tiles). Imports the kernels (and so triton).
    """
    device = torch.device(device)
    try:
        from minivllm.attention.ops import triton_unified_attention as ua
        from minivllm.attention.ops.triton_utils import (
            SUPPORTED_DTYPES,
            interpreter_problem,
            is_interpreted,
            triton_language_interpreted,
        )
    except Exception as e:  # not installed, or an install that fails to import: either way it cannot run
        return f"triton cannot be imported ({type(e).__name__}: {e})"
    interpreted = is_interpreted(ua.kernel_unified_attention)
    if dtype not in SUPPORTED_DTYPES:
        return f"its kernels support float32, float16 and bfloat16, not {dtype}"
    if head_size is not None and not (16 <= head_size <= 256 and head_size & (head_size - 1) == 0):
        return f"its kernels need a head size that is a power of two in [16, 256], got {head_size}"
    if device.type == "cuda":
        if interpreted:
            return ("triton was imported under TRITON_INTERPRET=1, so its kernels run on CPU tensors only; unset "
                    "it to run them on CUDA")
        return None
    if device.type != "cpu":
        return f"its kernels run on CUDA (or, interpreted, on the CPU), not on {device.type}"
    if not interpreted:
        return ("on the CPU its kernels run only under Triton's interpreter: set TRITON_INTERPRET=1 in the "
                "environment before the process imports torch or triton")
    if not triton_language_interpreted():
        return ("the kernels were imported under TRITON_INTERPRET=1 but triton itself was imported before: set "
                "TRITON_INTERPRET=1 before the process imports torch or triton")
    problem = interpreter_problem()
    if problem:
        return problem
    if dtype == torch.bfloat16:
        return ("bfloat16 is not supported under TRITON_INTERPRET=1 (the interpreter's tl.dot of bfloat16 tiles "
                "returns wrong values); use float32 or float16 on the CPU, bfloat16 on a GPU")
    return None


@dataclass(frozen=True, eq=False)
class TritonAttentionMetadata(AttentionMetadata):
    """vLLM ``TritonAttentionMetadata``: the common fields plus the kernel's launch parameters.

    Attributes:
        num_actual_tokens: ``T``, rows of the flattened batch.
        max_query_len: the longest query of the step (``max_seqlen_q``; 1 for a pure-decode step).
        max_seq_len: the largest ``seq_lens`` entry (``max_seqlen_k``); in a captured decode step the bucket's
            key capacity ``NB * block_size``, an upper bound.
        num_par_softmax_segments: context segments per request (1: no split; ``choose_num_segments``).
    """

    num_actual_tokens: int = 0
    max_query_len: int = 0
    max_seq_len: int = 0
    num_par_softmax_segments: int = 1


class TritonAttentionMetadataBuilder(AttentionMetadataBuilder):
    """Builds ``TritonAttentionMetadata`` from host integers only: no device tensor is created or read, so one
    build costs microseconds and the same code serves a CUDA-graph capture."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from minivllm.attention.ops.triton_unified_attention import choose_num_segments

        self._choose_num_segments = choose_num_segments

    def build(self, common_attn_metadata: CommonAttentionMetadata) -> TritonAttentionMetadata:
        cm = common_attn_metadata
        segments = self._choose_num_segments(cm.num_reqs, self.num_kv_heads, cm.max_query_len, cm.max_seq_len)
        return TritonAttentionMetadata(
            **AttentionMetadata.common_fields(cm, self.block_size), num_actual_tokens=cm.num_actual_tokens,
            max_query_len=cm.max_query_len, max_seq_len=cm.max_seq_len, num_par_softmax_segments=segments,
        )

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> TritonAttentionMetadata:
        """The metadata of a captured pure-decode step: ``common_attn_metadata``'s tensors are the graph runner's
        static buffers, used as they are; the launch parameters come from its shape (``num_reqs`` = the padded
        batch ``B``, ``max_seq_len`` = ``NB * block_size``), never from the ``*_cpu`` lists, which describe only the
        captured shape.

        Raises:
            ValueError: if the step is not pure decode (``max_query_len != 1``) or ``max_seq_len`` is not the
                block-table capacity, which a replay with longer requests would exceed.
        """
        cm = common_attn_metadata
        if cm.max_query_len != 1:
            raise ValueError(f"CUDA graphs capture pure-decode steps only, got max_query_len={cm.max_query_len}")
        capacity = cm.block_table_tensor.shape[1] * self.block_size
        if cm.max_seq_len != capacity:
            raise ValueError(f"max_seq_len ({cm.max_seq_len}) of a captured step must be the block table's capacity "
                             f"({capacity} = {cm.block_table_tensor.shape[1]} blocks x {self.block_size})")
        return self.build(cm)


class TritonAttentionImpl(AttentionImpl):
    """Writes the step's K/V with ``triton_reshape_and_cache_flash``, then attends with ``unified_attention``.

    Raises (from the kernels' launchers, before launching): ``ValueError`` naming the tensor for a wrong shape,
    dtype, device or layout, and for bfloat16 under the interpreter.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from minivllm.attention.ops.triton_reshape_and_cache_flash import triton_reshape_and_cache_flash
        from minivllm.attention.ops.triton_unified_attention import unified_attention

        self._write = triton_reshape_and_cache_flash
        self._attend = unified_attention

    def forward(self, query, key, value, kv_cache, attn_metadata: TritonAttentionMetadata) -> torch.Tensor:
        md = attn_metadata
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        self._write(key, value, key_cache, value_cache, md.slot_mapping)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        return self._attend(
            query, key_cache, value_cache, out, md.query_start_loc, md.max_query_len, md.seq_lens, md.max_seq_len,
            self.scale, md.block_table, num_par_softmax_segments=md.num_par_softmax_segments,
        )


class TritonAttentionBackend(AttentionBackend):
    supports_cudagraph = True

    @staticmethod
    def get_name() -> str:
        return "TRITON_ATTN"

    @staticmethod
    def get_builder_cls() -> Type[AttentionMetadataBuilder]:
        return TritonAttentionMetadataBuilder

    @staticmethod
    def get_impl_cls() -> Type[AttentionImpl]:
        return TritonAttentionImpl
