"""Preemption by recompute: same outputs, every block back, the V1 rules."""

import pytest

from minivllm import SamplingParams
from tests.conftest import make_tiny_engine, run_all

PROMPTS = {f"r{i}": [(13 * i + 5 * j) % 500 + 1 for j in range(8 + 3 * i)] for i in range(4)}


def _run(num_blocks, params, **kw):
    eng = make_tiny_engine(block_size=4, num_gpu_blocks=num_blocks, max_num_batched_tokens=64, traced=True, **kw)
    for rid, p in PROMPTS.items():
        eng.add_request(rid, {"prompt_token_ids": p}, params)
    outs = run_all(eng)
    return {rid: o.outputs[0].token_ids for rid, o in outs.items()}, eng


@pytest.mark.parametrize("caching", [False, True])
def test_preempted_run_matches_ample_run(caching):
    params = SamplingParams(temperature=0, max_tokens=20)
    ref, _ = _run(200, params)
    out, eng = _run(12, params, enable_prefix_caching=caching)
    assert eng.num_preemptions > 0
    assert out == ref
    pool = eng.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == 12
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert eng.kv_cache_manager.req_to_blocks == {}


def test_seeded_sampling_is_independent_of_preemption():
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=20)
    ref, _ = _run(200, params)
    out, eng = _run(12, params)
    assert eng.num_preemptions > 0 and out == ref


def test_victim_is_last_running_and_goes_to_front_of_waiting():
    _, eng = _run(12, SamplingParams(temperature=0, max_tokens=20))
    step, victim = eng.trace.preemptions()[0]
    rec = eng.trace[step]
    prev = eng.trace[step - 1]
    assert victim == prev.running[-1]                   # FCFS: the most recently admitted running request
    assert rec.waiting[0] == victim                     # put back at the front of the waiting queue
    snap = rec.requests[victim]
    assert snap.num_computed_tokens == 0 and snap.block_ids == []   # KV dropped: recompute from scratch
    # Generated tokens are kept: all it had, including the token sampled at the end of the previous step.
    assert prev.kinds[victim] == "decode"
    assert snap.num_output_tokens == prev.requests[victim].num_output_tokens + 1
    assert snap.num_preemptions == 1


def test_no_waiting_request_admitted_in_a_step_that_preempted():
    _, eng = _run(12, SamplingParams(temperature=0, max_tokens=20))
    preempting = [s for s in eng.trace if s.preempted]
    assert preempting
    for s in preempting:
        assert s.new == [] and s.resumed == []
    # The gate is per step: every victim is resumed in a later step.
    for step, victim in eng.trace.preemptions():
        assert any(victim in s.resumed for s in eng.trace.steps[step + 1:])


def test_resumed_request_recomputes_prompt_and_outputs():
    _, eng = _run(12, SamplingParams(temperature=0, max_tokens=20))
    step, victim = eng.trace.preemptions()[0]
    resume = next(s for s in eng.trace.steps[step + 1:] if victim in s.resumed)
    snap = eng.trace[step].requests[victim]
    # Prefix caching is off here: all prompt + generated tokens are prefilled again (maybe in chunks).
    first = resume.num_scheduled_tokens[victim]
    assert resume.kinds[victim] == "prefill"
    assert first == min(snap.num_tokens, resume.token_budget)


def test_priority_policy_preempts_lowest_priority():
    eng = make_tiny_engine(block_size=4, num_gpu_blocks=12, max_num_batched_tokens=64, traced=True,
                           scheduling_policy="priority")
    for i, (rid, p) in enumerate(PROMPTS.items()):
        # r0 gets the worst (largest) priority value although it arrives first.
        eng.add_request(rid, {"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=20),
                        priority=9 if rid == "r0" else i)
    run_all(eng)
    step, victim = eng.trace.preemptions()[0]
    running_before = eng.trace[step - 1].running
    expected = max(running_before, key=lambda r: (eng.trace[step - 1].requests[r].priority, running_before.index(r)))
    assert victim == expected
