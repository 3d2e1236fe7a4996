"""The PyTorch attention backend: batched decode matmuls and SDPA for prefill chunks (vLLM's nearest relatives:
``vllm/v1/attention/backends/cpu_attn.py`` before its C++ kernels, and ``flash_attn.py`` for the metadata).

Equal to ``reference_paged_attention`` up to float rounding. Decode requests (one query token each) are split into
groups of similar length (``split_decode_groups``); each group's keys are gathered into a padded batch and handled
by two batched matmuls with a key-length mask (``paged_decode_attention``). Each prefill chunk goes through
PyTorch's ``scaled_dot_product_attention``: with ``is_causal=True`` straight on this step's keys when the chunk has
no context (then top-left and bottom-right alignment coincide), otherwise on keys gathered through the block table
with the shifted causal mask. The builder prepares the groups, their gather indices and the gather workspace once
per step for all layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple, Type

import torch
import torch.nn.functional as F

from minivllm.attention import paged_attention as ops
from minivllm.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)


@dataclass(frozen=True, eq=False)
class DecodeGroup:
    """Decode requests attended together, keys padded to the group's longest request.

    Attributes:
        token_idx: ``int64 [R]`` rows of these requests' query tokens in the flattened batch.
        block_table: ``int64 [R, nblk]`` their block ids (padding entries are masked).
        key_mask: ``bool [R, nblk * block_size]``, True for keys past the request's ``seq_len``.
        kv_rows: ``int64 [num_kv_heads * R * nblk * block_size]`` gather indices (``ops.decode_kv_rows``).
    """

    token_idx: torch.Tensor
    block_table: torch.Tensor
    key_mask: torch.Tensor
    kv_rows: torch.Tensor


@dataclass(frozen=True, eq=False)
class TorchSDPAMetadata(AttentionMetadata):
    """Attributes:
    decode_reqs / prefill_reqs: indices of the requests with one / more than one query token.
    decode_groups: the decode requests in groups of similar length.
    workspace: the gather buffer of ``paged_decode_attention`` (shared by the layers, reused across steps;
        large enough for the largest group).
    num_kv_heads, head_dim: the layer shape the groups' ``kv_rows`` and the workspace were built for.
    """

    decode_reqs: Tuple[int, ...] = ()
    prefill_reqs: Tuple[int, ...] = ()
    decode_groups: Tuple[DecodeGroup, ...] = ()
    workspace: torch.Tensor = torch.empty(0)
    num_kv_heads: int = 0
    head_dim: int = 0


def split_decode_groups(seq_lens: List[int], max_groups: int = 4, min_group_size: int = 16) -> List[List[int]]:
    """Split decode requests into at most ``max_groups`` groups of similar ``seq_lens`` (each at least
    ``min_group_size`` requests, so a few long ones do not make everyone gather padding).

    Returns lists of indices into ``seq_lens``, shortest requests first. For 64 contexts of 100-430 tokens,
    padding everyone to the longest gathered 58% more keys than needed; four groups cut that to 14% (see
    ``minivllm/bench/OPTIMISATIONS.md``). vLLM's kernels read each request's own blocks and need no such split.
    """
    n = len(seq_lens)
    k = max(1, min(max_groups, n // min_group_size))
    order = sorted(range(n), key=seq_lens.__getitem__)
    return [order[i * n // k : (i + 1) * n // k] for i in range(k)]


class TorchSDPAMetadataBuilder(AttentionMetadataBuilder):
    """Splits the step into decode and prefill requests and prepares the decode groups and their workspace.

    The workspace is kept across steps: a fresh 10-50 MB buffer per step costs page faults.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._workspace = torch.empty(0, dtype=self.dtype, device=self.device)

    def _group(self, cm: CommonAttentionMetadata, reqs: Sequence[int], lens: Sequence[int]) -> DecodeGroup:
        bs, dev = self.block_size, self.device
        nblk = -(-max(lens) // bs)
        table = cm.block_table_tensor[list(reqs), :nblk]
        key_mask = torch.arange(nblk * bs, device=dev)[None, :] >= torch.tensor(lens, device=dev)[:, None]
        token_idx = torch.tensor([cm.query_start_loc_cpu[i] for i in reqs], device=dev)
        return DecodeGroup(token_idx, table, key_mask, ops.decode_kv_rows(table, bs, self.num_kv_heads))

    def _workspace_for(self, groups: Sequence[DecodeGroup], persistent: bool) -> torch.Tensor:
        need = max((2 * g.kv_rows.numel() * self.head_dim for g in groups), default=0)
        if not persistent:
            return torch.empty(need, dtype=self.dtype, device=self.device)
        if self._workspace.numel() < need:
            self._workspace = torch.empty(need, dtype=self.dtype, device=self.device)
        return self._workspace

    def build(self, common_attn_metadata: CommonAttentionMetadata) -> TorchSDPAMetadata:
        cm = common_attn_metadata
        qlens = cm.query_lens_cpu
        decode_reqs = [i for i, q in enumerate(qlens) if q == 1]
        prefill_reqs = [i for i, q in enumerate(qlens) if q > 1]
        groups: List[DecodeGroup] = []
        if decode_reqs:
            lens = [cm.seq_lens_cpu_upper_bound[i] for i in decode_reqs]
            # Each group costs a few more operators; with two threads each operator also costs a barrier, and two
            # groups measured faster than four (one thread: four).
            parts = split_decode_groups(lens, max_groups=4 if torch.get_num_threads() == 1 else 2)
            if len(parts) == 1:
                parts = [list(range(len(lens)))]  # batch order: a pure decode step then needs no row selection
            groups = [self._group(cm, [decode_reqs[j] for j in p], [lens[j] for j in p]) for p in parts]
        return TorchSDPAMetadata(
            **AttentionMetadata.common_fields(cm, self.block_size), decode_reqs=tuple(decode_reqs),
            prefill_reqs=tuple(prefill_reqs), decode_groups=tuple(groups),
            workspace=self._workspace_for(groups, persistent=True), num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
        )

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> TorchSDPAMetadata:
        """All requests decode, as one group over the whole (static) block table; every tensor is computed from
        the static buffers on the device, so a CUDA graph records the computation and replays it on new values.
        The ``*_cpu`` fields of ``common_attn_metadata`` are not read."""
        cm = common_attn_metadata
        r, nblk = cm.block_table_tensor.shape
        key_pos = torch.arange(nblk * self.block_size, device=cm.seq_lens.device)
        rows = ops.decode_kv_rows(cm.block_table_tensor, self.block_size, self.num_kv_heads)
        group = DecodeGroup(cm.query_start_loc[:-1], cm.block_table_tensor, key_pos[None, :] >= cm.seq_lens[:, None],
                            rows)
        return TorchSDPAMetadata(
            **AttentionMetadata.common_fields(cm, self.block_size), decode_reqs=tuple(range(r)), prefill_reqs=(),
            decode_groups=(group,), workspace=self._workspace_for([group], persistent=False),
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
        )


def sdpa_prefill(out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 kv_cache: torch.Tensor, md: AttentionMetadata, reqs: Sequence[int], scale: float) -> None:
    """Write into ``out`` the attention of the prefill chunks of requests ``reqs``, one ``F.scaled_dot_product_
    attention`` call each (shapes as in ``AttentionImpl.forward``)."""
    for i in reqs:
        s, ctx = md.query_start_loc_cpu[i], md.num_computed_tokens_cpu[i]
        q_len = md.query_start_loc_cpu[i + 1] - s
        q = query[s : s + q_len].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        if ctx == 0:
            k = key[s : s + q_len].transpose(0, 1).unsqueeze(0)
            v = value[s : s + q_len].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            k, v = ops.gather_kv(kv_cache, md.block_table[i], ctx + q_len)
            k = k.transpose(0, 1).unsqueeze(0)
            v = v.transpose(0, 1).unsqueeze(0)
            mask = ops.chunk_causal_mask(ctx, q_len, query.device)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[s : s + q_len] = o.squeeze(0).transpose(0, 1)


def paged_decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, group: DecodeGroup, workspace: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of decode requests (one query token each): all requests and heads of a group in two batched
    matmuls.

    The keys are padded to the group's longest request (``L = nblk * block_size``) and masked by
    ``group.key_mask``. One ``index_select`` gathers K and V head-major (``group.kv_rows``) into ``workspace``, so
    ``bmm`` reads contiguous ``[L, head_dim]`` matrices; reading a head out of the ``[L, kv_heads, head_dim]``
    block layout directly makes ``bmm`` copy it first (see ``minivllm/bench/OPTIMISATIONS.md``). Scores and
    softmax are float32 for every dtype. This is the job of vLLM's ``paged_attention_v1`` kernel
    (``csrc/attention/attention_kernels.cuh``), which reads the blocks in place instead of gathering them.

    Args:
        q: ``[R, num_heads, head_dim]``, the group's query rows.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, contiguous.
        group: the group's gather indices and key mask.
        workspace: at least ``2 * group.kv_rows.numel() * head_dim`` elements of ``kv_cache``'s dtype.
        scale: softmax scale.

    Returns:
        ``[R, num_heads, head_dim]`` in ``q``'s dtype.
    """
    r, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    group_size = num_heads // num_kv_heads
    rows = group.kv_rows
    need = 2 * rows.numel() * head_dim
    kv = workspace[:need].view(2, rows.numel(), head_dim)
    flat = kv_cache.view(2, -1, head_dim)
    if kv_cache.device.type == "cpu" and torch.get_num_threads() > 1 and rows.numel() >= 16384:
        # On the CPU, index_select along dim 0 splits the rows over threads; along dim 1 (below) it runs on one
        # thread but is faster there (measured: 1 thread 3.5 vs 2.2 ms, 2 threads 1.6 vs 2.2 ms for 64 requests).
        # A small gather is not worth waking the other threads (a batch-1 step waits for them on a busy machine).
        torch.index_select(flat[0], 0, rows, out=kv[0])
        torch.index_select(flat[1], 0, rows, out=kv[1])
    else:
        torch.index_select(flat, 1, rows, out=kv)
    length = rows.numel() // (num_kv_heads * r)
    k = kv[0].view(num_kv_heads * r, length, head_dim)
    v = kv[1].view(num_kv_heads * r, length, head_dim)
    qh = q.view(r, num_kv_heads, group_size, head_dim).transpose(0, 1).reshape(num_kv_heads * r, group_size, head_dim)
    scores = torch.bmm(qh, k.transpose(1, 2)).float().view(num_kv_heads, r, group_size, length)
    scores.mul_(scale).masked_fill_(group.key_mask.reshape(1, r, 1, length), float("-inf"))
    probs = scores.softmax(-1).to(v.dtype).view(num_kv_heads * r, group_size, length)
    o = torch.bmm(probs, v).view(num_kv_heads, r, group_size, head_dim)
    return o.transpose(0, 1).reshape(r, num_heads, head_dim)


class TorchSDPAImpl(AttentionImpl):
    def forward(self, query, key, value, kv_cache, attn_metadata: TorchSDPAMetadata) -> torch.Tensor:
        md = attn_metadata
        ops.write_kv_cache(key, value, kv_cache, md.slot_mapping)
        groups = md.decode_groups
        if groups and (md.num_kv_heads, md.head_dim) != (self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"attn_metadata was built for num_kv_heads={md.num_kv_heads}, head_dim={md.head_dim}; this layer has "
                f"{self.num_kv_heads}, {self.head_dim}"
            )
        if len(groups) == 1 and not md.prefill_reqs:
            # Pure decode step: token i is request i's only token, so no row selection is needed.
            return paged_decode_attention(query, kv_cache, groups[0], md.workspace, self.scale)
        out = query.new_empty(query.shape)
        for g in groups:
            out[g.token_idx] = paged_decode_attention(query[g.token_idx], kv_cache, g, md.workspace, self.scale)
        sdpa_prefill(out, query, key, value, kv_cache, md, md.prefill_reqs, self.scale)
        return out


class TorchSDPABackend(AttentionBackend):
    supports_cudagraph = True

    @staticmethod
    def get_name() -> str:
        return "TORCH_SDPA"

    @staticmethod
    def get_builder_cls() -> Type[AttentionMetadataBuilder]:
        return TorchSDPAMetadataBuilder

    @staticmethod
    def get_impl_cls() -> Type[AttentionImpl]:
        return TorchSDPAImpl
