"""Write this step's keys and values into the paged KV cache by slot mapping, in Triton.

vLLM: ``vllm/v1/attention/ops/triton_reshape_and_cache_flash.py`` (``triton_reshape_and_cache_flash``) at
v0.32.0, the Triton twin of the CUDA ``reshape_and_cache_flash``. minivllm's PyTorch version is
``minivllm.attention.paged_attention.write_kv_cache`` (two ``index_copy_``).

Shapes (``T`` tokens this step, ``KVH`` KV heads, ``D`` head_dim):

* ``key``, ``value``: ``[T, KVH, D]``, the new tokens' keys and values (after RoPE for keys).
* ``key_cache``, ``value_cache``: ``[num_blocks, block_size, KVH, D]``: ``kv_cache[0]`` and ``kv_cache[1]`` of a
  minivllm layer cache ``[2, num_blocks, block_size, KVH, D]`` (vLLM's FlashAttention layout, "NHD").
* ``slot_mapping``: ``int [T]``; token ``t`` goes to block ``slot // block_size``, row ``slot % block_size``.
  A slot of ``-1`` (vLLM's ``PAD_SLOT_ID``) means a padding token and writes nothing. (minivllm's CUDA-graph
  padding writes to a scratch block instead, ``minivllm.worker.cuda_graphs``; both work here.)

Tiling: one program per token. It loads the token's ``[KVH, D]`` key tile (``KVH`` padded to a power of two for
``tl.arange``, the extra rows masked) and stores it at its slot; the same for the value. Each program moves
``2 * KVH * D`` contiguous elements, so the kernel is bound by memory bandwidth and needs no further tiling
(vLLM also splits the heads over a second grid axis, which matters for many heads).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.attention.ops.triton_utils import (
    check_device,
    check_index_tensor,
    check_last_dim_contiguous,
    is_power_of_two,
    same_dtype,
)


@triton.jit
def reshape_and_cache_kernel_flash(
    key_ptr,  # [T, KVH, D]
    value_ptr,  # [T, KVH, D]
    key_cache_ptr,  # [num_blocks, block_size, KVH, D]
    value_cache_ptr,  # [num_blocks, block_size, KVH, D]
    slot_mapping_ptr,  # [T]
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_c_blk,  # strides of key_cache and value_cache (checked equal by the launcher)
    stride_c_slot,
    stride_c_head,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PADDED: tl.constexpr,  # next power of two >= NUM_KV_HEADS (tl.arange needs a power of two)
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # PAD_SLOT_ID: a padding token, nothing to store
        return
    block = slot // BLOCK_SIZE
    row = slot % BLOCK_SIZE

    heads = tl.arange(0, HEADS_PADDED)
    dims = tl.arange(0, HEAD_DIM)
    mask = (heads < NUM_KV_HEADS)[:, None]
    cache_off = block * stride_c_blk + row * stride_c_slot + heads[:, None] * stride_c_head + dims[None, :]

    k = tl.load(key_ptr + token * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :], mask=mask)
    tl.store(key_cache_ptr + cache_off, k, mask=mask)
    v = tl.load(value_ptr + token * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :], mask=mask)
    tl.store(value_cache_ptr + cache_off, v, mask=mask)


def triton_reshape_and_cache_flash(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    check_slots: bool | None = None,
) -> None:
    """Store ``key[t]`` and ``value[t]`` at cache slot ``slot_mapping[t]`` (skipped where it is ``-1``).

    vLLM's signature without the fp8 arguments (``kv_cache_dtype``, ``k_scale``, ``v_scale``): minivllm's cache
    has the model's dtype.

    Args:
        key, value: ``[T, KVH, D]``, float32/float16/bfloat16, last dimension contiguous.
        key_cache, value_cache: ``[num_blocks, block_size, KVH, D]`` with ``key``'s dtype and equal strides
            (``kv_cache[0]``, ``kv_cache[1]``).
        slot_mapping: ``int32/int64 [T]``, each in ``[-1, num_blocks * block_size)``.
        check_slots: check the slot values (one device synchronisation); default: on CPU tensors only.

    Raises:
        ValueError: naming the parameter, for a wrong shape, dtype, device, layout or (when checked) slot; nothing
            is written then.
    """
    check_device(reshape_and_cache_kernel_flash, key=key, value=value, key_cache=key_cache,
                 value_cache=value_cache, slot_mapping=slot_mapping)
    same_dtype([("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache)])
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"key and value must both be [num_tokens, num_kv_heads, head_dim], got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(f"key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    if key_cache.stride() != value_cache.stride():
        raise ValueError(f"key_cache and value_cache must have equal strides, got {key_cache.stride()} and "
                         f"{value_cache.stride()}")
    num_tokens, num_kv_heads, head_dim = key.shape
    num_blocks, block_size = key_cache.shape[:2]
    if tuple(key_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"key_cache holds [{key_cache.shape[2]}, {key_cache.shape[3]}] (num_kv_heads, head_dim) "
                         f"per slot but key has [{num_kv_heads}, {head_dim}]")
    if not is_power_of_two(head_dim):
        raise ValueError(f"head_dim must be a power of two (tl.arange), got {head_dim}")
    check_index_tensor("slot_mapping", slot_mapping, 1)
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    check_last_dim_contiguous(key=key, value=value, key_cache=key_cache, value_cache=value_cache)
    if check_slots is None:
        check_slots = key.device.type == "cpu"
    if check_slots and num_tokens:
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= num_blocks * block_size:
            raise ValueError(f"slot_mapping values must lie in [-1, {num_blocks * block_size}) "
                             f"(num_blocks * block_size), got [{lo}, {hi}]")
    if num_tokens == 0:
        return
    reshape_and_cache_kernel_flash[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
    )
