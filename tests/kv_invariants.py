"""Invariants of the block pool and the scheduler, checked by the prefix-caching, reliability, randomized and soak
tests. Not a test module itself (no ``test_`` prefix)."""

from collections import Counter
from contextlib import contextmanager

import torch


@contextmanager
def one_torch_thread():
    """Run with one intra-op thread. The tiny model's matrices are so small that OpenMP's barriers dominate, and on a
    shared 2-core machine two threads make a step 100x slower. Restores the previous setting."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def check_pool(kv, idle: bool = False) -> None:
    """Assert the block pool is consistent with the block tables of ``kv`` (a ``KVCacheManager``).

    - no block is in the free queue twice, and the queue's counter equals its length;
    - a block is in the free queue exactly when its ``ref_cnt`` is 0, and ``ref_cnt`` equals the number of block
      tables holding it (so it is never negative);
    - the hash map only points at blocks carrying that hash, and every hashed block is the one the map points at.

    With ``idle=True`` (no request left) also: no block table, every ``ref_cnt`` 0, free blocks == pool size.
    """
    pool = kv.block_pool
    free = pool.free_block_queue.get_all_free_blocks()
    free_ids = [b.block_id for b in free]
    dup = [i for i, c in Counter(free_ids).items() if c > 1]
    assert not dup, f"blocks {dup} are in the free queue more than once"
    assert len(free_ids) == pool.get_num_free_blocks(), (len(free_ids), pool.get_num_free_blocks())
    holders = Counter(b.block_id for blocks in kv.req_to_blocks.values() for b in blocks)
    free_set = set(free_ids)
    for b in pool.blocks:
        assert b.ref_cnt >= 0, b
        assert b.ref_cnt == holders[b.block_id], (b, holders[b.block_id])
        assert (b.ref_cnt == 0) == (b.block_id in free_set), b
    for h, b in pool.cached_block_hash_to_block.items():
        assert b.block_hash == h, (b, h.hex()[:8])
    for b in pool.blocks:
        if b.block_hash is not None:
            assert pool.cached_block_hash_to_block.get(b.block_hash) is b, b
    if idle:
        assert not kv.req_to_blocks, list(kv.req_to_blocks)
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks


class StepChecker:
    """Wraps ``engine.scheduler.schedule`` to check every step as it is scheduled.

    Per step: the token budget and ``max_num_seqs`` are respected, every scheduled request gets at least one token,
    the pool is consistent (``check_pool``), and no *free* block carries a hash registered in this very step (its
    KV would never be written, yet a later request could hit it).
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.num_steps = 0
        self.max_total = 0
        self.max_running = 0
        self._orig = engine.scheduler.schedule
        engine.scheduler.schedule = self._schedule

    def _schedule(self):
        eng = self.engine
        pool = eng.kv_cache_manager.block_pool
        before = {h: b.block_id for h, b in pool.cached_block_hash_to_block.items()}
        so = self._orig()
        cfg = eng.scheduler_config
        total = sum(so.num_scheduled_tokens.values())
        assert total == so.total_num_scheduled_tokens
        assert total <= cfg.max_num_batched_tokens, (total, cfg.max_num_batched_tokens)
        assert len(eng.scheduler.running) <= cfg.max_num_seqs
        assert all(n > 0 for n in so.num_scheduled_tokens.values()), so.num_scheduled_tokens
        for h, b in pool.cached_block_hash_to_block.items():
            if b.ref_cnt == 0:
                assert before.get(h) == b.block_id, f"free block {b} was hashed in this step"
        check_pool(eng.kv_cache_manager)
        self.num_steps += 1
        self.max_total = max(self.max_total, total)
        self.max_running = max(self.max_running, len(eng.scheduler.running))
        return so
