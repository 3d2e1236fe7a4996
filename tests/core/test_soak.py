"""Soak (issue 6): thousands of steps of random arrivals and aborts against a small pool that forces preemption,
with the invariants checked after every step. Seeded, so it is the same run every time; about 10-20 s on CPU."""

import random

import pytest

from kv_invariants import StepChecker, check_pool, one_torch_thread
from minivllm import LLMEngine, SamplingParams

MAX_LEN = 40
PROMPTS = [[(13 * i + 5 * j) % 512 for j in range(4 + 3 * i)] for i in range(8)]  # 4..25 tokens
PROMPTS += [PROMPTS[7][:20] + [400 + i] for i in range(4)]  # share 20 tokens with PROMPTS[7]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def reference():
    """Each prompt's greedy tokens alone, up to max_model_len: every shorter max_tokens is a prefix of it."""
    eng = LLMEngine("tiny", block_size=16, num_gpu_blocks=4, max_model_len=MAX_LEN, enable_prefix_caching=False)
    for i, p in enumerate(PROMPTS):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=MAX_LEN))
    return {int(k): o.outputs[0].token_ids for k, o in eng.run_to_completion().items()}


@pytest.mark.parametrize("policy, caching, seed", [("fcfs", True, 0), ("priority", True, 1), ("fcfs", False, 2)])
def test_soak(reference, policy, caching, seed):
    rng = random.Random(seed)
    eng = LLMEngine("tiny", block_size=4, num_gpu_blocks=12, max_model_len=MAX_LEN, max_num_batched_tokens=16,
                    max_num_seqs=6, enable_prefix_caching=caching, scheduling_policy=policy)
    checker = StepChecker(eng)
    which, final, n_added = {}, {}, 0
    num_steps = 1500
    for step in range(num_steps):
        if eng.get_num_unfinished_requests() < 10 and rng.random() < 0.35:
            i = rng.randrange(len(PROMPTS))
            rid = f"q{n_added}"
            which[rid] = i
            eng.add_request(rid, PROMPTS[i], SamplingParams(temperature=0, max_tokens=rng.randint(1, 24)),
                            priority=rng.randint(0, 2))
            n_added += 1
        if eng.scheduler.requests and rng.random() < 0.04:
            victim = rng.choice(sorted(eng.scheduler.requests))
            for o in eng.abort_request(victim):
                final[o.request_id] = o
            check_pool(eng.kv_cache_manager)
        for o in eng.step():
            if o.finished:
                assert o.request_id not in final
                final[o.request_id] = o
    final.update(eng.run_to_completion(max_steps=2000))
    assert checker.num_steps >= num_steps
    assert sorted(final) == sorted(which)  # nothing lost
    for rid, o in final.items():
        out, ref = o.outputs[0], reference[which[rid]]
        assert out.token_ids == ref[: len(out.token_ids)], rid
        assert out.finish_reason in ("length", "abort")
    check_pool(eng.kv_cache_manager, idle=True)
    # the pool was small enough to make the run interesting
    assert eng.num_preemptions > 20 and sum(o.outputs[0].finish_reason == "abort" for o in final.values()) > 10
    if caching:
        assert eng.kv_cache_manager.prefix_cache_stats.hits > 0
