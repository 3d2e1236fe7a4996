"""Per-request block tables on top of the block pool (vLLM: ``vllm/v1/core/kv_cache_manager.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

from minivllm.core.block_pool import BlockPool
from minivllm.core.kv_cache_utils import KVCacheBlock
from minivllm.metrics.stats import PrefixCacheStats
from minivllm.request import RequestStatus
from minivllm.utils.math_utils import cdiv

if TYPE_CHECKING:
    from minivllm.request import Request


class KVCacheManager:
    """Allocates and frees the KV blocks of requests; finds prefix-cache hits.

    Each request owns a list of blocks, its *block table*: token at position ``p`` lives in block
    ``blocks[p // block_size]`` at offset ``p % block_size``. Blocks are appended as the request grows and all
    freed together when it finishes or is preempted.

    Args:
        num_gpu_blocks: blocks in the pool.
        block_size: tokens per block.
        max_model_len: tokens per request at most; no slot is reserved past it.
        enable_caching: prefix caching on or off.
        watermark: the fraction of the pool that an admission must leave free while other requests are scheduled
            (vLLM 0.32 ``SchedulerConfig.watermark``; ``int(watermark * num_gpu_blocks)`` blocks; 0.0 = off).
    """

    def __init__(self, num_gpu_blocks: int, block_size: int, max_model_len: int, enable_caching: bool = True,
                 watermark: float = 0.0) -> None:
        self.block_size = block_size
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching)
        self.req_to_blocks: Dict[str, List[KVCacheBlock]] = {}
        self.num_cached_block: Dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    # -- prefix cache -------------------------------------------------------------------------------------
    def get_computed_blocks(self, request: "Request") -> Tuple[List[KVCacheBlock], int]:
        """Longest run of cached full blocks at the start of the request (vLLM ``get_computed_blocks``).

        Walks ``request.block_hashes`` from the first block and stops at the first miss: hashes are chained, so
        every later block would miss too. At most ``(num_tokens - 1) // block_size`` blocks are returned, so at
        least the last token is always computed: its logits are needed to sample the next token. A prompt that is
        an exact multiple of ``block_size`` and fully cached therefore recomputes its whole last block.

        Returns:
            ``(blocks, num_computed_tokens)`` with ``num_computed_tokens == len(blocks) * block_size``. Nothing
            is modified; the caller passes the blocks to ``allocate_slots``, which takes the references.
            ``([], 0)`` when ``prefix_cache_lookup_enabled`` is false for the request.
        """
        if not self.prefix_cache_lookup_enabled(request):
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: List[KVCacheBlock] = []
        for h in request.block_hashes[:max_blocks]:
            b = self.block_pool.get_cached_block(h)
            if b is None:
                break
            hits.append(b)
        return hits, len(hits) * self.block_size

    def prefix_cache_lookup_enabled(self, request: "Request") -> bool:
        """Whether this request may read the prefix cache (vLLM 0.32 ``KVCacheManager.prefix_cache_lookup_enabled``):
        caching on and the request not marked ``skip_reading_prefix_cache`` (``prompt_logprobs`` requests are)."""
        return self.enable_caching and not request.sampling_params.skip_reading_prefix_cache

    def record_prefix_cache_query(self, request: "Request", num_hit_tokens: int) -> None:
        """Count one admission's lookup in ``prefix_cache_stats`` (queries and hits in tokens); a request that
        skipped the lookup is not counted (vLLM ``record_prefix_cache_stats``)."""
        if not self.prefix_cache_lookup_enabled(request):
            return
        s = self.prefix_cache_stats
        if request.num_preemptions > 0:
            s.preempted_requests += 1
            s.preempted_queries += request.num_tokens
            s.preempted_hits += num_hit_tokens
        else:
            s.requests += 1
            s.queries += request.num_tokens
            s.hits += num_hit_tokens

    # -- allocation ---------------------------------------------------------------------------------------
    def num_blocks_to_admit(self, request: "Request", new_computed_blocks: Sequence[KVCacheBlock] = ()) -> int:
        """Free blocks a waiting request needs for its *whole* current sequence, hits counted.

        vLLM's admission gate (``full_sequence_must_fit``, ``scheduler_reserve_full_isl=True``): a request is
        admitted only if all of its known tokens would fit, so a chunked prefill never starts and then starves.
        """
        return sum(self._blocks_to_take(request, request.num_tokens, new_computed_blocks))

    def _blocks_to_take(self, request: "Request", num_tokens_need_slot: int,
                        new_computed_blocks: Sequence[KVCacheBlock]) -> Tuple[int, int]:
        """``(new blocks, evictable hits)``: the blocks ``request`` still lacks for its first
        ``num_tokens_need_slot`` tokens (capped at ``max_model_len``), beyond those it holds and its prefix-cache
        hits, and the hits that sit in the free queue (``ref_cnt == 0``: reviving one takes it out of the queue).
        Their sum is what the pool must have free; the one count behind ``num_blocks_to_admit``,
        ``get_num_blocks_to_allocate`` and ``allocate_slots``."""
        total = cdiv(min(num_tokens_need_slot, self.max_model_len), self.block_size)
        held = len(self.req_to_blocks.get(request.request_id, ()))
        num_new_blocks = max(total - held - len(new_computed_blocks), 0)
        return num_new_blocks, sum(1 for b in new_computed_blocks if b.ref_cnt == 0)

    def get_num_blocks_to_allocate(
        self,
        request: "Request",
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_lookahead_tokens: int = 0,
    ) -> int:
        """Free blocks that ``allocate_slots`` with the same arguments takes from the pool: the new blocks for
        the slots it still lacks, plus the prefix-cache hits that sit in the free queue (``ref_cnt == 0``, reviving
        one takes it out of the free queue). vLLM ``get_num_blocks_to_allocate`` (per attention type, `v0.33.0
        single_type_kv_cache_manager.py L176-L266
        <https://github.com/vllm-project/vllm/blob/v0.33.0/vllm/v1/core/single_type_kv_cache_manager.py#L176>`_),
        whose sum ``allocate_slots`` compares with the free blocks; vLLM's fast path for a running request
        (``max(required - held, 0)``) gives the same count, as a running request has no new hits. Changes
        nothing; the course's trace asks it about the waiting queue's head to explain why the head was not admitted.
        """
        total_computed = request.num_computed_tokens + num_new_computed_tokens
        return sum(self._blocks_to_take(request, total_computed + num_new_tokens + num_lookahead_tokens,
                                        new_computed_blocks))

    def allocate_slots(
        self,
        request: "Request",
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Optional[Sequence[KVCacheBlock]] = None,
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        delay_cache_blocks: bool = False,
        has_scheduled_reqs: bool = False,
    ) -> Optional[List[KVCacheBlock]]:
        """Make room for ``num_new_tokens`` more tokens of ``request`` (vLLM ``KVCacheManager.allocate_slots``).

        Args:
            request: the request; ``request.num_computed_tokens`` tokens already have slots.
            num_new_tokens: tokens to compute this step.
            num_new_computed_tokens: tokens served by prefix-cache hits (``new_computed_blocks``) or a KV
                connector, on top of ``request.num_computed_tokens``.
            new_computed_blocks: prefix-cache hit blocks from ``get_computed_blocks``; referenced here.
            num_lookahead_tokens: extra slots to reserve (speculative decoding; 0 in minivllm).
            full_sequence_must_fit: the admission gate (see ``num_blocks_to_admit``).
            delay_cache_blocks: do not hash the new blocks yet (their KV is still being loaded).
            has_scheduled_reqs: other requests run this step; then a waiting or preempted request must also leave
                ``watermark_blocks`` free (vLLM 0.32: the watermark applies to admissions only, and only then).

        Returns:
            The newly allocated blocks (possibly an empty list), or ``None`` if not enough blocks are free, in
            which case nothing at all was changed.
        """
        new_computed_blocks = list(new_computed_blocks or [])
        watermark_blocks = 0
        if has_scheduled_reqs and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            watermark_blocks = self.watermark_blocks
        if full_sequence_must_fit and (self.num_blocks_to_admit(request, new_computed_blocks) + watermark_blocks
                                       > self.block_pool.get_num_free_blocks()):
            return None
        total_computed = request.num_computed_tokens + num_new_computed_tokens
        num_new_blocks, num_evictable_hits = self._blocks_to_take(
            request, total_computed + num_new_tokens + num_lookahead_tokens, new_computed_blocks)
        if num_new_blocks + num_evictable_hits + watermark_blocks > self.block_pool.get_num_free_blocks():
            return None
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            self.num_cached_block[request.request_id] = len(req_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        if self.enable_caching and not delay_cache_blocks:
            self.cache_blocks(request, min(total_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def cache_blocks(self, request: "Request", num_computed_tokens: int) -> None:
        """Index every block of ``request`` that is full once ``num_computed_tokens`` tokens are computed."""
        if not self.enable_caching:
            return
        rid = request.request_id
        num_full = min(num_computed_tokens // self.block_size, len(request.block_hashes))
        done = self.num_cached_block.get(rid, 0)
        if num_full > done:
            self.block_pool.cache_full_blocks(request, self.req_to_blocks[rid], done, num_full)
            self.num_cached_block[rid] = num_full

    def free(self, request: "Request") -> None:
        """Return all of the request's blocks to the pool, last block first (vLLM frees in reverse order).

        Blocks are hashed when they are *allocated* for a step, before that step computes their KV. If the
        request is freed before the step runs (the priority policy can preempt a request it already scheduled
        in the same step), the blocks past ``num_computed_tokens`` would stay findable without their KV ever
        being written; their hashes are dropped first, so no later request can hit them.
        """
        self.block_pool.free_blocks(reversed(self.pop_blocks_for_free(request)))

    def pop_blocks_for_free(self, request: "Request") -> List[KVCacheBlock]:
        """Forget the request's block table and return its blocks, in position order, *without* returning them
        to the pool (vLLM ``KVCacheManager.pop_blocks_for_free``): the caller frees them later, in reverse order,
        once no step in flight can still write them (deferred frees under async scheduling, see ``Scheduler``).
        Hashes of blocks past ``num_computed_tokens`` are dropped as in ``free``."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        num_cached = self.num_cached_block.pop(request.request_id, 0)
        num_valid = request.num_computed_tokens // self.block_size
        if num_cached > num_valid:
            self.block_pool.uncache_blocks(blocks[num_valid:num_cached])
        return blocks

    # -- views --------------------------------------------------------------------------------------------
    def get_blocks(self, request_id: str) -> List[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> List[int]:
        """The request's block table as block ids, in position order."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def get_cached_free_block_ids(self) -> List[int]:
        """Free blocks that still carry a prefix-cache hash (evictable, findable), in eviction order."""
        return [b.block_id for b in self.block_pool.free_block_queue if b.block_hash is not None]

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def reset_prefix_cache(self) -> bool:
        """Drop all cached hashes; only succeeds when no request holds blocks. Returns success."""
        return self.block_pool.reset_prefix_cache()
