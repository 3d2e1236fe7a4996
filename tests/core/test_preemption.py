"""Preemption by recompute (notebook 06): same outputs, every block back, the V1 rules, and the numbers notebook 06
states, each rebuilt with the notebook's settings on the tiny random-weight model (no EOS token: every request
runs to ``max_tokens``, so the schedule depends only on token counts, as in the notebook).
"""

import pytest

from minivllm import SamplingParams
from minivllm.course.trace import TracedLLMEngine
from minivllm.utils.math_utils import cdiv
from tests.conftest import make_tiny_engine, run_all

pytestmark = pytest.mark.usefixtures("one_thread")  # the tiny model runs best on one thread

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


# ---- the numbers notebook 06 states --------------------------------------------------------------------
def engine06(num_gpu_blocks, policy="fcfs", prefix_caching=False):
    """Notebook 06's engine settings: block size 4, a small pool."""
    return TracedLLMEngine("tiny", block_size=4, num_gpu_blocks=num_gpu_blocks, scheduling_policy=policy,
                     enable_prefix_caching=prefix_caching)


def prompt(i, length):
    return [10 + 7 * i + j for j in range(length)]


def _three_requests(num_gpu_blocks=9):
    eng = engine06(num_gpu_blocks)
    for i, rid in enumerate("ABC"):
        eng.add_request(rid, prompt(i, 8), SamplingParams(temperature=0, max_tokens=20))
    return eng


def _token_ids(outputs):
    return {rid: o.outputs[0].token_ids for rid, o in outputs.items()}


def test_three_requests_in_nine_blocks():
    assert 3 * cdiv(8 + 20 - 1, 4) == 21
    eng = _three_requests()
    out = eng.run_to_completion()
    assert len(eng.trace) == 42
    assert eng.trace.preemptions() == [(5, "C"), (9, "B"), (24, "C")]
    s = eng.trace[5]
    assert s.waiting[0] == "C" and s.running == ["A", "B"]
    snap = s.requests["C"]
    assert (snap.status, snap.num_computed_tokens, snap.block_ids, snap.num_preemptions) == ("PREEMPTED", 0, [], 1)
    resumes = [(s.step, s.num_scheduled_tokens["C"], s.requests["C"].num_output_tokens)
               for s in eng.trace if "C" in s.resumed]
    assert resumes == [(20, 13, 5), (31, 17, 9)]
    roomy = _three_requests(64)
    assert _token_ids(roomy.run_to_completion()) == _token_ids(out) and roomy.num_preemptions == 0


def test_what_preemption_resets_and_keeps():
    eng = _three_requests()
    for _ in range(5):
        eng.step()
    c = eng.get_request("C")
    kept = list(c.output_token_ids)
    assert (c.num_computed_tokens, len(kept), c.num_tokens) == (12, 5, 13)
    assert {r: eng.kv_cache_manager.get_block_ids(r) for r in "ABC"} == {"A": [0, 1, 6], "B": [2, 3, 7], "C": [4, 5, 8]}
    eng.step()
    assert eng.trace.preemptions() == [(5, "C")]
    assert (c.status.name, c.num_computed_tokens, c.num_tokens, c.num_preemptions) == ("PREEMPTED", 0, 13, 1)
    assert c.output_token_ids == kept
    assert eng.scheduler.queue_snapshot() == (["C"], ["A", "B"])
    assert {r: eng.kv_cache_manager.get_block_ids(r) for r in "ABC"} == {"A": [0, 1, 6, 4], "B": [2, 3, 7, 5], "C": []}
    assert eng.kv_cache_manager.num_free_blocks == 1


ARRIVALS = [(0, "low", 1, 8, 20), (2, "high", 0, 8, 20), (10, "w", 0, 4, 3)]


def _arrivals_run(policy):
    eng = engine06(9, policy)
    pending = sorted(ARRIVALS)
    while pending or eng.has_unfinished_requests():
        while pending and pending[0][0] <= len(eng.trace):
            step, rid, priority, length, max_tokens = pending.pop(0)
            eng.add_request(rid, prompt(len(eng.scheduler.requests), length),
                            SamplingParams(temperature=0, max_tokens=max_tokens), arrival_time=float(step),
                            priority=priority)
        eng.step()
    return eng


def test_no_waiting_request_is_admitted_in_a_step_that_preempted():
    eng = _arrivals_run("priority")
    gate, after = eng.trace[11], eng.trace[12]
    assert gate.preempted == ["low"] and gate.waiting == ["w", "low"]
    assert gate.num_free_blocks == 4 >= cdiv(gate.requests["w"].num_tokens, 4) == 1
    assert gate.new == [] and gate.resumed == []
    assert after.preempted == [] and after.new == ["w"]
    # and in every run of the notebook (and this file's four-request run): a preempting step admits nobody, every
    # victim is resumed in a later step, every request finishes
    runs = [eng, _arrivals_run("fcfs"), _three_requests(), _thrash_run()[0],
            _run(12, SamplingParams(temperature=0, max_tokens=20))[1]]
    runs[2].run_to_completion()
    for run in runs:
        assert run.trace.preemptions()
        for s in run.trace:
            if s.preempted:
                assert s.new == [] and s.resumed == []
        for step, victim in run.trace.preemptions():
            assert any(victim in s.resumed for s in run.trace.steps[step + 1:])
        assert not run.has_unfinished_requests()


def _thrash_run(num_gpu_blocks=12, prefix_caching=False, seeded=False):
    eng = engine06(num_gpu_blocks, prefix_caching=prefix_caching)
    for i, (rid, n) in enumerate({"A": 30, "B": 8, "C": 12, "D": 16, "E": 20}.items()):
        sp = SamplingParams(temperature=1.0, seed=100 + i, max_tokens=n) if seeded else \
            SamplingParams(temperature=0, max_tokens=n)
        eng.add_request(rid, prompt(i, 4), sp)
    return eng, eng.run_to_completion()


def test_thrashing_costs_recomputed_tokens_but_not_output():
    eng, out = _thrash_run()
    assert eng.trace.preemptions() == [(5, "E"), (9, "E"), (13, "E"), (25, "E")]
    assert out["E"].num_preemptions == 4
    assert eng.trace.chunk_sizes("E") == [4, 9, 10, 11, 20]
    assert {r: eng.trace.recomputed_tokens(r) for r in "ABCDE"} == {"A": 0, "B": 0, "C": 0, "D": 0, "E": 46}
    # notebook 06: E needed 4 + 20 - 1 = 23 positions, was scheduled 69 tokens: 46 computed twice, 2.0x the need
    assert sum(eng.trace.chunk_sizes("E", kind=None)) - (4 + 20 - 1) == 46
    assert sum(s.total_scheduled for s in eng.trace) == 147
    roomy, roomy_out = _thrash_run(64)
    assert roomy.num_preemptions == 0 and _token_ids(roomy_out) == _token_ids(out)
    seeded, seeded_out = _thrash_run(12, seeded=True)
    roomy_seeded, roomy_seeded_out = _thrash_run(64, seeded=True)
    assert seeded.num_preemptions == 4 and roomy_seeded.num_preemptions == 0
    assert _token_ids(seeded_out) == _token_ids(roomy_seeded_out)


def test_prefix_caching_cuts_the_recompute():
    eng, _ = _thrash_run(prefix_caching=True)
    assert eng.trace.preemptions() == [(5, "E"), (9, "E"), (13, "E"), (25, "E")]
    assert eng.trace.chunk_sizes("E") == [4, 9, 10, 3, 8]
    # the last two resumes start from 8 and 12 cached tokens, so they compute only 3 and 8
    assert [s.num_computed_before["E"] for s in eng.trace if "E" in s.resumed] == [0, 0, 8, 12]
    assert eng.trace.recomputed_tokens("E") == 26
    assert sum(eng.trace.chunk_sizes("E", kind=None)) - (4 + 20 - 1) == 26


def test_fcfs_preempts_the_newest_priority_the_least_important():
    fcfs, prio = _arrivals_run("fcfs"), _arrivals_run("priority")
    assert fcfs.trace[10].running == prio.trace[10].running == ["low", "high"]
    assert fcfs.trace.preemptions() == [(11, "high")]
    assert prio.trace.preemptions() == [(11, "low")]
    finished = lambda eng: {rid: s.step for s in eng.trace for rid in s.finished}  # noqa: E731
    assert finished(fcfs) == {"low": 19, "w": 22, "high": 30}
    assert finished(prio) == {"w": 14, "high": 21, "low": 30}
