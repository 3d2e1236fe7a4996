"""The KV cache's memory: zeroed, and on the CPU resident only where blocks have been used.

vLLM 0.32 allocates every layer's cache in one ``torch.zeros`` buffer (`allocate_kv_cache
<https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/v1/worker/utils.py#L564>`_; 0.33 the same, `L564
<https://github.com/vllm-project/vllm/blob/v0.33.0/vllm/v1/worker/utils.py#L564>`_), and its CPU build takes its
model runner from the GPU one, so the whole cache is written at start-up and stays resident: with 1 GiB of KV cache the process holds 1 GiB more
than its weights before the first request. On the CPU minivllm maps the cache as private anonymous memory instead
(``mmap.mmap(-1, n, flags=MAP_PRIVATE | MAP_ANONYMOUS)``), which the kernel guarantees to read as zeros and backs
with pages of its own only when first written (a read of an untouched page maps the shared zero page): the same
contents as ``torch.zeros``, without the start-up write, and the resident set grows with the blocks a run actually
uses (``calloc`` does the same for large sizes). How far it grows depends on the ``BlockPool``'s free queue: a freed
block without a prefix-cache hash goes to its front and is reused first, so without prefix caching the resident part
stays near the most blocks in use at once; a freed cached block goes to its back, to stay cached as long as
possible, so with prefix caching a long-running engine touches every block in the end and then holds what vLLM
holds. Why zeros at all: a block read before it is written (the scratch block of padded slots, a masked position of
a partly filled block) must hold finite numbers, since a masked score's weight is 0 and 0 x NaN is NaN.

On CUDA the cache is ``torch.zeros`` as in vLLM (device memory is not paged in on use).
"""

from __future__ import annotations

import math
import mmap
from typing import List, Sequence

import torch


def zeroed_cpu_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of ``shape`` and ``dtype`` filled with zeros, in anonymous memory the kernel pages in on first
    use (module doc). The tensor keeps its mapping alive; the memory is returned when the tensor is freed.

    Raises:
        ValueError: if ``shape`` holds no elements (``mmap`` cannot map 0 bytes).
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes <= 0:
        raise ValueError(f"shape must hold at least one element, got {tuple(shape)}")
    # Private, not mmap's default MAP_SHARED: shared anonymous memory is shmem, whose pages a mere read allocates and
    # which a fork() would share between processes.
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=dtype).view(*shape)


def allocate_kv_cache(shape: Sequence[int], dtype: torch.dtype, device: torch.device, num_layers: int
                      ) -> List[torch.Tensor]:
    """One zeroed cache tensor of ``shape`` per layer (``[K|V, block, offset in block, kv head, head dim]``), on
    ``device``: ``zeroed_cpu_tensor`` on the CPU, ``torch.zeros`` elsewhere (module doc; vLLM
    ``vllm/v1/worker/utils.py`` ``allocate_kv_cache``)."""
    if device.type == "cpu":
        return [zeroed_cpu_tensor(shape, dtype) for _ in range(num_layers)]
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
