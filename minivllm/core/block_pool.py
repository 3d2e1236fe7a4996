"""The pool of physical KV blocks and the prefix-cache index (vLLM: ``vllm/v1/core/block_pool.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Iterable, List, Optional

from minivllm.core.kv_cache_utils import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock

if TYPE_CHECKING:
    from minivllm.request import Request


class BlockPool:
    """Owns every ``KVCacheBlock``, the free queue and the ``block_hash -> block`` map.

    Free order (vLLM 0.32 ``BlockPool.free_blocks``): the manager frees a request's blocks tail first; a block
    whose ``ref_cnt`` drops to 0 goes to the *front* of the free queue if it carries no hash (nothing to keep, so
    reuse it first) and to the *back* if it is hashed (keep it findable as long as possible: LRU eviction).
    Because the tail is freed first, a request's last hashed block is evicted before its first one, which is
    the one other requests are most likely to share.

    minivllm has no null block (vLLM reserves block 0 as a placeholder); all ``num_gpu_blocks`` are usable.

    Args:
        num_gpu_blocks: number of physical blocks (>= 1).
        enable_caching: keep a hash index of full blocks for prefix caching.
    """

    def __init__(self, num_gpu_blocks: int, enable_caching: bool) -> None:
        if num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {num_gpu_blocks}")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.blocks: List[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: Dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0

    def get_cached_block(self, block_hash: BlockHash) -> Optional[KVCacheBlock]:
        """The cached block holding this prefix hash, or ``None`` (a prefix-cache miss)."""
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> List[KVCacheBlock]:
        """Pop ``num_blocks`` from the front of the free queue with ``ref_cnt = 1``.

        A popped block that still carries a hash is evicted from the prefix cache here: this is the only place
        eviction happens (lazily, on reuse). Raises ``ValueError`` if fewer blocks are free; callers check first.
        """
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool ({self.get_num_free_blocks()} free)")
        out = []
        for _ in range(num_blocks):
            b = self.free_block_queue.popleft()
            self._maybe_evict_cached_block(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
            self.num_evictions += 1
        block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a hit on a free block removes it from the free queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_block_queue.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block, in the given order (see the class docstring for where they go)."""
        for b in ordered_blocks:
            if b.ref_cnt <= 0:
                raise RuntimeError(f"double free of {b}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.block_hash is not None:
                    self.free_block_queue.append(b)
                else:
                    self.free_block_queue.appendleft(b)

    def cache_full_blocks(
        self, request: "Request", blocks: List[KVCacheBlock], num_cached_blocks: int, num_full_blocks: int
    ) -> None:
        """Give blocks ``[num_cached_blocks, num_full_blocks)`` of ``request`` their hashes and index them.

        If another block already holds the same hash (two requests computed the same prefix at once), the
        first stays the indexed one and this block stays unhashed; it is freed like any uncached block.
        """
        for i in range(num_cached_blocks, num_full_blocks):
            b = blocks[i]
            if b.block_hash is not None:
                continue  # a prefix-cache hit: already indexed
            h = request.block_hashes[i]
            if h in self.cached_block_hash_to_block:
                continue
            b.block_hash = h
            self.cached_block_hash_to_block[h] = b

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop the hashes of blocks whose KV will never be written (see ``KVCacheManager.free``).

        Only blocks held by their one owner are touched; a block shared through a hit has valid KV by definition.
        """
        for b in blocks:
            if b.ref_cnt == 1 and b.block_hash is not None:
                if self.cached_block_hash_to_block.get(b.block_hash) is b:
                    del self.cached_block_hash_to_block[b.block_hash]
                b.block_hash = None

    def get_num_free_blocks(self) -> int:
        """Blocks that can be allocated now, cached-but-free (evictable) ones included."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks held by running requests, in [0, 1]."""
        return 1.0 - self.get_num_free_blocks() / self.num_gpu_blocks

    def reset_prefix_cache(self) -> bool:
        """Forget every hash. Only possible when no block is in use; returns whether it was done."""
        if self.get_num_free_blocks() != self.num_gpu_blocks:
            return False
        self.cached_block_hash_to_block.clear()
        for b in self.blocks:
            b.block_hash = None
        return True
