"""KV cache blocks, the free-block queue and block hashing (vLLM: ``vllm/v1/core/kv_cache_utils.py``)."""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, List, Optional, Sequence

from minivllm.core.block_hash import BlockHash

if TYPE_CHECKING:
    from minivllm.request import Request

__all__ = [
    "BlockHash", "NONE_HASH", "hash_block_tokens", "get_request_block_hasher", "KVCacheBlock", "FreeKVCacheBlockQueue",
]

NONE_HASH: BlockHash = hashlib.sha256(b"minivllm:none-hash").digest()
"""The parent hash of a request's first block (vLLM's ``NONE_HASH``)."""


def hash_block_tokens(
    parent_block_hash: Optional[BlockHash], curr_block_token_ids: Sequence[int], extra_keys: Optional[tuple] = None
) -> BlockHash:
    """Hash one full block, chained on its parent's hash (vLLM ``kv_cache_utils.hash_block_tokens``).

    Because the parent hash is part of the input, a block's hash identifies the *whole prefix* up to and including
    it: equal token runs at different positions, or after different prefixes, never share a hash.

    Args:
        parent_block_hash: hash of the previous block of the same request, or ``None`` for the first block.
        curr_block_token_ids: exactly ``block_size`` token ids.
        extra_keys: anything else that changes the KV (vLLM: cache salt, LoRA name, multimodal hashes).

    Returns:
        A 32-byte digest.
    """
    h = hashlib.sha256()
    h.update(parent_block_hash if parent_block_hash is not None else NONE_HASH)
    h.update(array("q", curr_block_token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def get_request_block_hasher(block_size: int) -> Callable[["Request"], List[BlockHash]]:
    """A function that returns the hashes of the request's blocks that became full since it was last called.

    Called at request creation and after every appended output token (vLLM ``get_request_block_hasher``), so
    ``request.block_hashes`` always covers ``num_tokens // block_size`` blocks.
    """

    def request_block_hasher(request: "Request") -> List[BlockHash]:
        start = len(request.block_hashes) * block_size
        parent = request.block_hashes[-1] if request.block_hashes else None
        extra = (request.cache_salt,) if request.cache_salt and start == 0 else None
        new: List[BlockHash] = []
        while start + block_size <= request.num_tokens:
            parent = hash_block_tokens(parent, request.all_token_ids[start : start + block_size], extra)
            new.append(parent)
            start += block_size
            extra = None  # vLLM salts only the first block; the chain carries it to the rest.
        return new

    return request_block_hasher


@dataclass(eq=False)
class KVCacheBlock:
    """Metadata of one physical KV block (the tensor data lives in the model runner's KV cache).

    Attributes:
        block_id: index of the block in every layer's KV tensor, ``0 <= block_id < num_gpu_blocks``.
        ref_cnt: number of running requests whose block table holds this block.
        block_hash: prefix hash if the block is full and cached, else ``None``. A freed block keeps its hash
            until it is reused, so a later request can still hit it.
        prev_free_block / next_free_block: links of the doubly linked free queue (``None`` when not in it).
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: Optional[BlockHash] = None
    prev_free_block: Optional["KVCacheBlock"] = None
    next_free_block: Optional["KVCacheBlock"] = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks (vLLM ``FreeKVCacheBlockQueue``).

    Allocation takes from the front. A block can be removed from the middle in O(1), which a prefix-cache hit
    on a free (evictable) block needs. Free but still-hashed blocks live here too: they are *evicted lazily*,
    only when allocation pops them from the front, so the front is the least recently freed end.
    """

    def __init__(self, blocks: List[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for b in blocks:
            prev.next_free_block, b.prev_free_block = b, prev
            prev = b
        prev.next_free_block, self._tail.prev_free_block = self._tail, prev

    def popleft(self) -> KVCacheBlock:
        """Remove and return the front block. Raises ``ValueError`` when empty."""
        b = self._head.next_free_block
        if b is self._tail or b is None:
            raise ValueError("No free blocks available")
        self.remove(b)
        return b

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from anywhere in the queue. Raises ``RuntimeError`` if it is not in the queue."""
        if block.prev_free_block is None or block.next_free_block is None:
            raise RuntimeError(f"remove() called on a block that is not free: {block}")
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the back: it will be reused last."""
        last = self._tail.prev_free_block
        assert last is not None  # the sentinels are always linked
        last.next_free_block, block.prev_free_block = block, last
        block.next_free_block, self._tail.prev_free_block = self._tail, block
        self.num_free_blocks += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the front: it will be reused first."""
        first = self._head.next_free_block
        assert first is not None  # the sentinels are always linked
        self._head.next_free_block, block.prev_free_block = block, self._head
        block.next_free_block, first.prev_free_block = first, block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        b = self._head.next_free_block
        while b is not None and b is not self._tail:
            yield b
            b = b.next_free_block

    def get_all_free_blocks(self) -> List[KVCacheBlock]:
        """The free blocks, front (next to be reused) first."""
        return list(self)
