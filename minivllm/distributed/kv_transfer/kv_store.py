"""A store of full KV blocks keyed by their prefix hash: CPU memory, optionally backed by a folder on disk.

The key is the block's prefix hash (``request.block_hashes[i]``, see ``minivllm.core.kv_cache_utils``). Because a
block's hash covers every token before it, equal keys mean equal KV, so a block saved by one request can be
loaded by any later request with the same prefix, and, through the disk folder, by another engine instance.

vLLM's equivalent is the CPU offloading backend behind ``OffloadingConnector``
(``vllm/v1/kv_offload/``) and, for disk, LMCache; both key blocks by the same prefix hashes.
"""

from __future__ import annotations

import os
import tempfile
from collections import OrderedDict
from typing import Optional, Tuple

import torch

from minivllm.core.kv_cache_utils import BlockHash


class KVBlockStore:
    """Full KV blocks by prefix hash, in CPU memory (LRU) and optionally on disk (write-through).

    One entry holds one block of every layer: a tensor ``[num_layers, 2 (K|V), block_size, num_kv_heads,
    head_dim]`` in the KV cache's dtype, on the CPU. A disk folder must only ever be used with one model, dtype
    and block size: the hash covers the tokens, not the weights. A mismatching shape or dtype read back from disk
    raises ``ValueError``; different weights with the same shapes cannot be detected.

    Args:
        disk_path: a folder for ``<hash hex>.pt`` files, created if missing; ``None`` keeps everything in memory.
        cpu_capacity_blocks: blocks kept in memory at most (least recently used dropped first); ``None`` means
            no limit. With a disk folder, dropped blocks can still be read back from disk.

    Raises:
        ValueError: ``cpu_capacity_blocks`` below 1, or ``disk_path`` that exists and is not a folder.
    """

    def __init__(self, disk_path: Optional[str] = None, cpu_capacity_blocks: Optional[int] = None) -> None:
        if cpu_capacity_blocks is not None and (not isinstance(cpu_capacity_blocks, int) or cpu_capacity_blocks < 1):
            raise ValueError(f"cpu_capacity_blocks must be None or an int >= 1, got {cpu_capacity_blocks!r}")
        if disk_path is not None:
            if os.path.exists(disk_path) and not os.path.isdir(disk_path):
                raise ValueError(f"disk_path must be a folder, got the file {disk_path!r}")
            os.makedirs(disk_path, exist_ok=True)
        self.disk_path = disk_path
        self.cpu_capacity_blocks = cpu_capacity_blocks
        self._cpu: "OrderedDict[BlockHash, torch.Tensor]" = OrderedDict()
        self.num_disk_reads = 0
        self.num_disk_writes = 0

    def _file(self, block_hash: BlockHash) -> str:
        return os.path.join(self.disk_path, block_hash.hex() + ".pt")

    def contains(self, block_hash: BlockHash) -> bool:
        """True if the block is in memory or on disk."""
        if block_hash in self._cpu:
            return True
        return self.disk_path is not None and os.path.exists(self._file(block_hash))

    def get_cpu(self, block_hash: BlockHash) -> Optional[torch.Tensor]:
        """The block from memory (marked most recently used), or ``None`` if it is only on disk or absent."""
        t = self._cpu.get(block_hash)
        if t is not None:
            self._cpu.move_to_end(block_hash)
        return t

    def read_disk(self, block_hash: BlockHash, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Read a block from the disk folder without touching the memory tier (safe from a loader thread).

        Raises:
            KeyError: no disk folder, or no file for this hash.
            ValueError: the file holds a block of another shape or dtype (another model or block size).
        """
        if self.disk_path is None or not os.path.exists(self._file(block_hash)):
            raise KeyError(block_hash.hex())
        t = torch.load(self._file(block_hash), map_location="cpu", weights_only=True)
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise ValueError(
                f"{self._file(block_hash)} holds a block of shape {tuple(t.shape)} {t.dtype}, this engine's blocks "
                f"are {tuple(shape)} {dtype}: use one disk_path per model, dtype and block_size"
            )
        self.num_disk_reads += 1
        return t

    def put(self, block_hash: BlockHash, block: torch.Tensor) -> None:
        """Add one block (``[num_layers, 2, block_size, num_kv_heads, head_dim]``, CPU) to memory and disk.

        The disk file is written to a temporary name and renamed, so a reader never sees half a block.
        """
        self._cpu[block_hash] = block
        self._cpu.move_to_end(block_hash)
        if self.cpu_capacity_blocks is not None:
            while len(self._cpu) > self.cpu_capacity_blocks:
                self._cpu.popitem(last=False)
        if self.disk_path is not None and not os.path.exists(self._file(block_hash)):
            fd, tmp = tempfile.mkstemp(dir=self.disk_path, suffix=".tmp")
            os.close(fd)
            torch.save(block, tmp)
            os.replace(tmp, self._file(block_hash))
            self.num_disk_writes += 1

    @property
    def num_cpu_blocks(self) -> int:
        """Blocks held in memory."""
        return len(self._cpu)

    def num_disk_blocks(self) -> int:
        """Block files in the disk folder (0 without one)."""
        if self.disk_path is None:
            return 0
        return sum(1 for f in os.listdir(self.disk_path) if f.endswith(".pt"))
