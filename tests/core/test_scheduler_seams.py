"""The seams of the split ``Scheduler.schedule`` (issue 26): a ``scheduler_cls`` subclass, passed to the engine as
vLLM's ``scheduler_cls`` is, replaces one part of the step and keeps the rest.

vLLM's ``schedule()`` is one method; minivllm's is split into ``_schedule_running``, ``_num_new_tokens_running``,
``_allocate_slots_or_preempt``, ``_pick_victim``, ``_preempt_request``, ``_admission_gate_open``,
``_schedule_waiting``, ``_prefix_cache_lookup``, ``_num_new_tokens_waiting``, ``_build_scheduler_output`` (see the
module docstring of ``minivllm/core/sched/scheduler.py``). A subclass that overrides a part by calling ``super()``
schedules exactly as the reference does; one that changes a part changes the schedule where that part decides.
The runs use the ``tiny`` random-weight model on the CPU (greedy), with a step observer recording each step's
``SchedulerOutput``.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import pytest

from minivllm import LLMEngine, SamplingParams
from minivllm.core.sched.scheduler import PrefixCacheHit, Scheduler, SchedulerStep
from minivllm.request import Request

SEAMS = ("_long_prefill_token_threshold", "_defer_prefills", "_schedule_running", "_num_new_tokens_running",
         "_allocate_slots_or_preempt", "_pick_victim", "_preempt_request", "_admission_gate_open",
         "_schedule_waiting", "_prefix_cache_lookup", "_num_new_tokens_waiting", "_build_scheduler_output",
         "_make_cached_request_data")


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


class StepRecorder:
    """A step observer: each step's scheduled tokens, new, resumed and preempted request ids."""

    def __init__(self) -> None:
        self.steps: List[dict] = []

    def on_schedule(self, engine_core, so) -> None:
        self.steps.append({"scheduled": dict(so.num_scheduled_tokens),
                           "new": [r.req_id for r in so.scheduled_new_reqs],
                           "resumed": sorted(so.scheduled_cached_reqs.resumed_req_ids),
                           "preempted": sorted(so.preempted_req_ids),
                           "new_block_ids": {r.req_id: list(r.block_ids) for r in so.scheduled_new_reqs}
                           | dict(zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.new_block_ids))})

    def on_step_end(self, engine_core, engine_core_outputs, request_outputs) -> None:
        pass


def run(engine: LLMEngine, arrivals: Optional[Dict[int, Callable[[LLMEngine], None]]] = None,
        max_steps: int = 200):
    """Step ``engine`` until done or ``max_steps``; ``arrivals[k]`` adds requests before step ``k``. Returns
    ``(steps recorded, finished token ids by request)``."""
    rec = StepRecorder()
    engine.add_step_observer(rec)
    arrivals = arrivals or {}
    tokens: Dict[str, List[int]] = {}
    k = 0
    while (engine.has_unfinished_requests() or k in arrivals) and k < max_steps:
        if k in arrivals:
            arrivals[k](engine)
        for o in engine.step():
            if o.finished:
                tokens[o.request_id] = list(o.outputs[0].token_ids)
        k += 1
    return rec.steps, tokens


def events(steps: List[dict]) -> Dict[int, dict]:
    """The steps that admitted, resumed or preempted someone."""
    return {k: {f: s[f] for f in ("new", "resumed", "preempted") if s[f]}
            for k, s in enumerate(steps) if s["new"] or s["resumed"] or s["preempted"]}


# ---- workloads ----------------------------------------------------------------------------------------------------
def mixed(cls) -> tuple:
    """FCFS, 9 blocks of 4: A, B, C (8-token prompts, 20 outputs each) preempt one another; D (B's prompt and 2
    more tokens: prefix-cache hits) arrives before step 11; E (24 tokens) and F (3) before step 30, E chunked by
    ``long_prefill_token_threshold=16``."""
    eng = LLMEngine("tiny", block_size=4, num_gpu_blocks=9, max_num_batched_tokens=64,
                    long_prefill_token_threshold=16, scheduler_cls=cls)
    for i, rid in enumerate("ABC"):
        eng.add_request(rid, list(range(10 * i + 1, 10 * i + 9)), greedy(20))
    def late(e: LLMEngine) -> None:
        e.add_request("E", list(range(100, 124)), greedy(3))
        e.add_request("F", [5, 6, 7], greedy(2))

    return eng, {11: lambda e: e.add_request("D", list(range(11, 19)) + [77, 78], greedy(4)), 30: late}


def priority_gate(cls) -> tuple:
    """Priority, 5 blocks of 4: A (priority 0) and V (priority 5) run; in step 1 A needs a block and V, the worst,
    is preempted; W (priority 1, one token) arrived just before, and one block is free after V's preemption."""
    eng = LLMEngine("tiny", block_size=4, num_gpu_blocks=5, max_num_batched_tokens=64, scheduling_policy="priority",
                    scheduler_cls=cls)
    eng.add_request("A", list(range(1, 9)), greedy(6), priority=0)
    eng.add_request("V", list(range(11, 19)), greedy(6), priority=5)
    return eng, {1: lambda e: e.add_request("W", [300], greedy(2), priority=1)}


REFERENCE: Dict[str, tuple] = {}


def reference(workload) -> tuple:
    if workload.__name__ not in REFERENCE:
        REFERENCE[workload.__name__] = run(*workload(Scheduler))
    return REFERENCE[workload.__name__]


def test_the_mixed_workload_exercises_every_part():
    steps, tokens = reference(mixed)
    ev = events(steps)
    assert [k for k, e in ev.items() if "preempted" in e] and [k for k, e in ev.items() if "resumed" in e]
    assert sorted(tokens) == list("ABCDEF") and [len(tokens[r]) for r in "ABCDEF"] == [20, 20, 20, 4, 3, 2]
    admitted_d = next(s for s in steps if "D" in s["new"])
    assert admitted_d["scheduled"]["D"] == 2  # its first 8 tokens were B's: two cached blocks, 2 tokens computed
    assert [s["scheduled"]["E"] for s in steps if "E" in s["scheduled"]][:2] == [16, 8]  # capped at 16


# ---- (1) a part overridden through super() schedules exactly as the reference --------------------------------------
@pytest.mark.parametrize("seam", SEAMS)
def test_a_part_overridden_through_super_changes_nothing(seam):
    calls = []

    def passthrough(self, *args, **kwargs):
        calls.append(seam)
        return getattr(super(Sub, self), seam)(*args, **kwargs)

    Sub = type(f"Sub{seam}", (Scheduler,), {seam: passthrough})
    steps, tokens = run(*mixed(Sub))
    assert calls, f"{seam} was never called: the seam is not used by schedule()"
    ref_steps, ref_tokens = reference(mixed)
    assert steps == ref_steps
    assert tokens == ref_tokens


def test_the_running_loop_overridden_through_super_is_the_one_the_engine_runs():
    class MyScheduler(Scheduler):
        budgets: List[int] = []

        def _schedule_running(self, step: SchedulerStep) -> None:
            MyScheduler.budgets.append(step.token_budget)
            super()._schedule_running(step)

    eng, arrivals = mixed(MyScheduler)
    assert type(eng.scheduler) is MyScheduler
    steps, tokens = run(eng, arrivals)
    assert (steps, tokens) == reference(mixed)
    assert len(MyScheduler.budgets) == len(steps) and set(MyScheduler.budgets) == {64}


# ---- (2) the no-admission gate: off, and persistent -----------------------------------------------------------------
class GateOff(Scheduler):
    """Admits in a step that preempted: the waiting loop runs whatever the running loop did."""

    def _admission_gate_open(self, step: SchedulerStep) -> bool:
        return True


class PersistentGate(Scheduler):
    """Never admits again once anybody was preempted."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.ever_preempted = False

    def _admission_gate_open(self, step: SchedulerStep) -> bool:
        self.ever_preempted = self.ever_preempted or bool(step.preempted_reqs)
        return not self.ever_preempted


def test_vllms_gate_holds_w_back_one_step_under_priority():
    steps, tokens = reference(priority_gate)
    assert events(steps) == {0: {"new": ["A", "V"]}, 1: {"preempted": ["V"]}, 2: {"new": ["W"]},
                             6: {"resumed": ["V"]}}
    assert steps[1]["scheduled"] == {"A": 1}  # budget and a free block were left: only the gate kept W out
    assert sorted(tokens) == ["A", "V", "W"]


def test_gate_off_admits_w_in_the_step_that_preempted_v():
    steps, tokens = run(*priority_gate(GateOff))
    assert events(steps) == {0: {"new": ["A", "V"]}, 1: {"new": ["W"], "preempted": ["V"]},
                             6: {"resumed": ["V"]}}
    assert steps[1]["scheduled"] == {"A": 1, "W": 1}
    assert tokens == reference(priority_gate)[1]  # the same tokens, one step earlier for W


def test_a_persistent_gate_never_admits_again_and_the_victims_starve():
    steps, tokens = run(*priority_gate(PersistentGate), max_steps=30)
    assert events(steps) == {0: {"new": ["A", "V"]}, 1: {"preempted": ["V"]}}
    assert sorted(tokens) == ["A"]  # V and W never run again
    # A's last token is sampled in step 5; from then on the engine steps and schedules nothing, V and W waiting
    assert [s["scheduled"] for s in steps[:6]] == [{"A": 8, "V": 8}] + [{"A": 1}] * 5
    assert len(steps) == 30 and all(s["scheduled"] == {} for s in steps[6:])

    steps, tokens = run(*mixed(PersistentGate), max_steps=60)
    ref = events(reference(mixed)[0])
    first = min(k for k, e in ref.items() if "preempted" in e)
    assert {k: e for k, e in events(steps).items() if k <= first} == {k: e for k, e in ref.items() if k <= first}
    assert [k for k, e in events(steps).items() if k > first and ("new" in e or "resumed" in e)] == []
    assert "D" not in tokens and "E" not in tokens and len(steps) == 60


def test_gate_off_changes_nothing_under_fcfs_here():
    # FCFS puts the victim at the front of the waiting queue, and the victim never fits in the step that preempted
    # it (the blocks it freed went to the request that needed them): the waiting loop stops at it either way.
    assert run(*mixed(GateOff)) == reference(mixed)


def test_gate_off_departs_from_vllms_recording_only_in_the_connectors_calls(monkeypatch):
    # vLLM 0.32's recorded FCFS scenario built to show the gate: with the gate off, minivllm still schedules every
    # step as vLLM did (the victim B heads the queue and does not fit), but its waiting loop runs in the preempting
    # step and asks the connector about B, which vLLM never does there.
    from minivllm.bench.vllm_check import minivllm_replay
    from minivllm.course import vllm_recordings as vr

    name, mode = "no_admission_in_preempting_step", "v1-sync-scripted"
    vr.compare_with_minivllm(name, minivllm_replay.replay(vr.scenario(name), mode), mode)  # the reference: equal
    kwargs = minivllm_replay._engine_kwargs
    monkeypatch.setattr(minivllm_replay, "_engine_kwargs", lambda eng, m: {**kwargs(eng, m), "scheduler_cls": GateOff})
    with pytest.raises(AssertionError) as e:
        vr.compare_with_minivllm(name, minivllm_replay.replay(vr.scenario(name), mode), mode)
    report = str(e.value)
    assert "first difference at step 5" in report
    assert [line.split()[1] for line in report.splitlines() if line.startswith("≠ ")] == ["connector_calls:"]
    assert "get_num_new_matched_tokens(B, num_computed_tokens=64)" in report
    assert [line.split()[:3] for line in report.splitlines() if line.strip().startswith("preempted")] == \
        [["preempted", '["B"]', '["B"]']]


# ---- (3) chunk sizing: the lone-request rule ----------------------------------------------------------------------
class NoLoneRequestRule(Scheduler):
    """Caps every chunk at ``long_prefill_token_threshold``, even a lone request's: the chunk sizing of a waiting
    and of a running request, with the configured cap in place of the step's (which vLLM 0.32 lifts for a request
    that is alone, ``_long_prefill_token_threshold``)."""

    def _num_new_tokens_waiting(self, request: Request, num_computed_tokens: int,
                                step: SchedulerStep) -> Optional[int]:
        n = request.num_tokens - num_computed_tokens
        if 0 < self.config.long_prefill_token_threshold < n:
            n = self.config.long_prefill_token_threshold
        return min(n, step.token_budget)

    def _num_new_tokens_running(self, request: Request, step: SchedulerStep) -> int:
        n = super()._num_new_tokens_running(request, step)
        if 0 < self.config.long_prefill_token_threshold < n:
            n = self.config.long_prefill_token_threshold
        return n


class NoLoneRequestThreshold(Scheduler):
    """The same rule dropped where the step's cap is decided."""

    def _long_prefill_token_threshold(self) -> int:
        return self.config.long_prefill_token_threshold


def lone_prompt(cls):
    eng = LLMEngine("tiny", max_num_batched_tokens=64, long_prefill_token_threshold=32, scheduler_cls=cls)
    eng.add_request("B", list(range(100, 260)), greedy(2))  # 160 tokens, alone
    return eng, {}


def test_the_lone_160_token_prompt_uses_the_whole_budget_unless_the_rule_is_dropped():
    ref_steps, ref_tokens = reference(lone_prompt)
    assert [s["scheduled"] for s in ref_steps] == [{"B": 64}, {"B": 64}, {"B": 32}, {"B": 1}]
    for cls in (NoLoneRequestRule, NoLoneRequestThreshold):
        steps, tokens = run(*lone_prompt(cls))
        assert [s["scheduled"] for s in steps] == [{"B": 32}] * 5 + [{"B": 1}], cls.__name__
        assert tokens == ref_tokens  # chunking changes the steps, not the greedy tokens


def test_with_a_second_request_both_cap_at_the_threshold():
    def two(cls):
        eng, _ = lone_prompt(cls)
        eng.add_request("C", [5, 6, 7], greedy(1))
        return eng, {}

    ref_steps, _ = run(*two(Scheduler))
    steps, _ = run(*two(NoLoneRequestRule))
    assert ref_steps[0]["scheduled"] == steps[0]["scheduled"] == {"B": 32, "C": 3}


# ---- the prefix-cache lookup at admission -------------------------------------------------------------------------
class NoPrefixCacheReads(Scheduler):
    """Admits every request as if nothing were cached (the lookup finds no hit)."""

    def _prefix_cache_lookup(self, request: Request) -> Optional[PrefixCacheHit]:
        return PrefixCacheHit([], 0, 0, False)


def test_a_lookup_that_finds_nothing_recomputes_ds_shared_prefix():
    steps, tokens = run(*mixed(NoPrefixCacheReads))
    admitted_d = next(s for s in steps if "D" in s["new"])
    assert admitted_d["scheduled"]["D"] == 10  # all 10 prompt tokens; the reference computes 2 (8 were cached)
    assert tokens["D"] == reference(mixed)[1]["D"]
