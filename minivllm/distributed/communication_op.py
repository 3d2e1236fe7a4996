"""The collectives the parallel layers call (vLLM: ``vllm/distributed/communication_op.py``).

Each is the identity in a group of one, so a single-device model pays nothing. Tensors travel only through
``torch.distributed`` (gloo on the CPU, NCCL on CUDA).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minivllm.distributed.parallel_state import get_tensor_model_parallel_world_size, get_tp_group


def tensor_model_parallel_all_reduce(input_: torch.Tensor) -> torch.Tensor:
    """Sum ``input_`` over the ranks (in place, returned): every rank ends with the same tensor, same shape.

    ``RowParallelLinear`` calls it to add the ranks' partial products, ``VocabParallelEmbedding`` to merge the
    rows each rank looked up.
    """
    if get_tensor_model_parallel_world_size() == 1:
        return input_
    dist.all_reduce(input_, group=get_tp_group())
    return input_


def tensor_model_parallel_all_gather(input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate the ranks' ``input_`` along ``dim`` in rank order: ``[..., n, ...]`` -> ``[..., N * n, ...]``.

    ``LogitsProcessor`` calls it to join the ranks' slices of the vocabulary.
    """
    world_size = get_tensor_model_parallel_world_size()
    if world_size == 1:
        return input_
    parts = [torch.empty_like(input_) for _ in range(world_size)]
    dist.all_gather(parts, input_.contiguous(), group=get_tp_group())
    return torch.cat(parts, dim=dim)
