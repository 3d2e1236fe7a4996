"""Checker for notebook 07's exercise: the longest prefix-cache hit, against ``KVCacheManager.get_computed_blocks``."""

from __future__ import annotations

import random
from typing import Callable

from minivllm.course.exercises._harness import call, checker, fail


@checker("longest_cache_hit")
def check_longest_cache_hit(fn: Callable) -> int:
    """Check ``fn(block_hashes, cached, num_tokens, block_size)``: the number of tokens a request takes from the
    prefix cache (``cached`` is the pool's hash map). Expected: ``KVCacheManager.get_computed_blocks`` on requests
    built against a pool with six blocks cached and, for block sizes above 1, a middle block evicted; block sizes
    1, 4 and 16, every request length from 1 to two tokens past the cached prompt.

    Raises:
        ExerciseFailed: naming the block size and request length, expected and returned hit.
    """
    from minivllm import SamplingParams
    from minivllm.core.kv_cache_manager import KVCacheManager
    from minivllm.core.kv_cache_utils import get_request_block_hasher
    from minivllm.request import Request

    rng = random.Random(0)
    cases = 0
    greedy = SamplingParams(temperature=0, max_tokens=1)
    for block_size in (1, 4, 16):
        manager = KVCacheManager(num_gpu_blocks=64, block_size=block_size, max_model_len=256)
        block_hasher = get_request_block_hasher(block_size)
        base = [rng.randrange(512) for _ in range(6 * block_size)]
        seed = Request("seed", base, greedy, block_hasher=block_hasher)
        manager.allocate_slots(seed, len(base))
        seed.num_computed_tokens = len(base)
        manager.free(seed)
        if block_size > 1:  # forget one middle block, as if it alone had been evicted
            manager.block_pool.cached_block_hash_to_block.pop(seed.block_hashes[3]).block_hash = None
        for n in range(1, 6 * block_size + 3):
            tokens = base[:n] if n <= len(base) else base + [7] * (n - len(base))
            r = Request(f"r{n}", tokens, greedy, block_hasher=block_hasher)
            _, expected = manager.get_computed_blocks(r)
            desc = f"block_size={block_size}, num_tokens={n}"
            got = call(fn, (list(r.block_hashes), dict(manager.block_pool.cached_block_hash_to_block), n,
                            block_size), "longest_cache_hit", desc)
            if got != expected:
                hint = None
                if n % block_size == 0 and got == expected + block_size:
                    hint = "take at most (num_tokens - 1) // block_size blocks: the last token must be computed."
                fail("longest_cache_hit", desc, f"returned {got!r}, expected {expected} tokens", hint)
            cases += 1
    return cases


__all__ = ["check_longest_cache_hit"]
