"""Lesson 06's parts (issue 26): the running loop with the no-admission gate (``running_loop``) and preemption
(``preempt_request``), checked against the reference ``Scheduler`` step by step.

The solutions are taken from ``notebooks/solutions/06_preemption_solutions.ipynb`` as the grader reads them; the
known wrong variants below are subclasses of them that change one decision each, and the checker must name the
step, the field and the request where they first differ from the reference.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from minivllm.core.sched.scheduler import Scheduler, SchedulerStep
from minivllm.course.learner import cells, compare, grade, lesson06, parts
from minivllm.request import Request, RequestStatus

ROOT = Path(__file__).resolve().parents[2]
BLANK = ROOT / "notebooks" / "06_preemption.ipynb"
SOLUTIONS = ROOT / "notebooks" / "solutions" / "06_preemption_solutions.ipynb"


def _namespace(path: Path) -> dict:
    ns = cells.run_cells(cells.exercise_cells(str(path)), str(path))
    assert ns["__errors__"] == {}
    return ns


SOLVED = _namespace(SOLUTIONS)
RunningLoop, Preemption = SOLVED["RunningLoop"], SOLVED["Preemption"]


def status(name: str, cls, hidden: bool = True):
    return parts.run_check(parts.get(name), cls, hidden)


# ---- the solutions, the blanks, the registry ---------------------------------------------------------------------
def test_the_solutions_pass_every_workload_hidden_ones_included():
    n_hidden = len(lesson06.notebook_workloads()) + len(lesson06.hidden_workloads())
    assert status("running_loop", RunningLoop) == ("passed", f"{n_hidden} cases equal to the reference "
                                                             "(hidden ones included)")
    assert status("preempt_request", Preemption)[0] == "passed"


def test_the_workloads_preempt_under_both_policies_and_a_request_preempts_itself():
    runs = {w["name"]: compare.run_steps(w) for w in lesson06.notebook_workloads()}
    preempted = {name: [(k, s["preempted"]) for k, s in enumerate(steps) if s["preempted"]]
                 for name, steps in runs.items()}
    assert preempted["06 section 1: three requests in 9 blocks (fcfs)"] == [(5, ["C"]), (9, ["B"]), (24, ["C"])]
    gate = runs["06 section 4: the gate (priority A:0 V:5 W:1)"]
    assert gate[1]["preempted"] == ["V"] and gate[1]["new"] == [] and gate[2]["new"] == ["W"]
    selfish = runs["a request preempts itself (priority V:5 A:0)"]
    k = next(k for k, s in enumerate(selfish) if s["preempted"])
    # V stands first in the running queue and is the worst: it preempts itself, and A, behind it, gets nothing
    assert k == 5 and selfish[k - 1]["running"] == ["V", "A"] and selfish[k]["preempted"] == ["V"]
    assert selfish[k]["num_scheduled_tokens"] == {}
    hidden = [sum(len(s["preempted"]) for s in compare.run_steps(w)) for w in lesson06.hidden_workloads()]
    assert sum(hidden) >= 20 and sum(1 for n in hidden if n) >= 8


def test_the_blank_notebook_is_blank_for_the_grader():
    ns = _namespace(BLANK)
    assert status("running_loop", ns["RunningLoop"])[0] == "blank"
    assert status("preempt_request", ns["Preemption"])[0] == "blank"
    out = io.StringIO()
    results = grade.grade(["06"], str(ROOT / "notebooks"), out=out)
    assert [(p.name, s) for p, s, _, _ in results] == [("running_loop", "blank"), ("preempt_request", "blank")]
    assert "lesson 06, parts passed: 0 of 2" in out.getvalue()


def test_the_grader_passes_the_solutions_notebook():
    out = io.StringIO()
    results = grade.grade(["06"], str(ROOT / "notebooks"), solutions=True, out=out)
    assert [(p.name, s) for p, s, _, _ in results] == [("running_loop", "passed"), ("preempt_request", "passed")]


def test_a_half_written_preemption_is_still_blank():
    def blank(self, request, drop_stale_output=False):
        raise NotImplementedError

    OnlyTheVictim = variant("OnlyTheVictim", Preemption, PM, _preempt_request=blank)
    assert status("preempt_request", OnlyTheVictim)[0] == "blank"


def test_the_reference_parts_combine_into_one_scheduler_cls():
    cls = lesson06.scheduler_cls(lesson06.ReferenceRunningLoop, lesson06.ReferencePreemption)
    mine = lesson06.scheduler_cls(RunningLoop, Preemption)
    w = lesson06.notebook_workloads()[0]
    assert compare.run_steps(w, mine) == compare.run_steps(w, cls) == compare.run_steps(w)
    with pytest.raises(TypeError, match="preemption must be a Scheduler subclass"):
        lesson06.scheduler_cls(RunningLoop, object)


# ---- known wrong variants of running_loop ---------------------------------------------------------------------------
# The checker wants each part's methods defined in the class itself (so that ``your_engine`` can combine every
# lesson's class), so a variant is a fresh ``Scheduler`` subclass with the solution's methods and one changed.
def variant(name: str, solution: type, methods, **changed) -> type:
    return type(name, (Scheduler,), {**{m: vars(solution)[m] for m in methods}, **changed})


def _gate_missing(self, step: SchedulerStep) -> bool:
    return True


def _persistent_gate(self, step: SchedulerStep) -> bool:
    self.closed_for_good = getattr(self, "closed_for_good", False) or bool(step.preempted_reqs)
    return not self.closed_for_good


def _continue_after_failure(self, step: SchedulerStep) -> None:
    """Goes on with the requests behind one that preempted itself (vLLM 0.33's priority rule, under 0.32)."""
    step.req_index = 0
    while step.req_index < len(self.running) and step.token_budget > 0:
        request = self.running[step.req_index]
        n = self._num_new_tokens_running(request, step)
        new_blocks = self._allocate_slots_or_preempt(request, n, step)
        if new_blocks is None:
            if request.status == RequestStatus.PREEMPTED:
                continue
            break
        step.running_scheduled.append(request)
        step.num_scheduled_tokens[request.request_id] = n
        step.new_block_ids[request.request_id] = [b.block_id for b in new_blocks]
        step.token_budget -= n
        step.req_index += 1


RL = lesson06.RUNNING_LOOP_METHODS
GateMissing = variant("GateMissing", RunningLoop, RL, _admission_gate_open=_gate_missing)
PersistentGate = variant("PersistentGate", RunningLoop, RL, _admission_gate_open=_persistent_gate)
ContinueAfterFailure = variant("ContinueAfterFailure", RunningLoop, RL, _schedule_running=_continue_after_failure)


def _failure(name: str, cls) -> str:
    st, msg = status(name, cls)
    assert st == "failed", (st, msg)
    return msg


def test_gate_missing_fails_where_w_is_admitted_in_the_preempting_step():
    msg = _failure("running_loop", GateMissing)
    assert "06 section 4: the gate" in msg
    assert "first difference: step 1, field num_scheduled_tokens, request W" in msg
    assert 'expected: {"A": 1}' in msg and 'yours:    {"A": 1, "W": 1}' in msg
    assert '≠ new                        []                                          ["W"]' in msg


def test_a_persistent_gate_fails_where_the_reference_admits_again():
    msg = _failure("running_loop", PersistentGate)
    # nobody is admitted again after the first preemption: B and C never come back, the run never ends
    assert "your PersistentGate raised RuntimeError" in msg and "still running after 400 steps" in msg
    assert "on workload '06 section 1: three requests in 9 blocks (fcfs)'" in msg


def test_continuing_after_a_self_preemption_fails_on_the_request_behind_it():
    msg = _failure("running_loop", ContinueAfterFailure)
    assert "a request preempts itself (priority V:5 A:0)" in msg
    assert "first difference: step 5, field num_scheduled_tokens, request A" in msg
    assert 'expected: {}' in msg and '"A": 1' in msg


# ---- known wrong variants of preempt_request ------------------------------------------------------------------------
def _first_victim(self) -> Request:
    return self.running[0] if self.policy == "fcfs" else max(self.running, key=lambda r: (r.priority, r.arrival_time))


def _computed_tokens_kept(self, request: Request, drop_stale_output: bool = False) -> None:
    computed = request.num_computed_tokens
    vars(Preemption)["_preempt_request"](self, request, drop_stale_output)
    request.num_computed_tokens = computed


def _victim_at_the_back(self, request: Request, drop_stale_output: bool = False) -> None:
    self._free_request_blocks(request)
    request.status = RequestStatus.PREEMPTED
    request.num_computed_tokens = 0
    request.num_preemptions += 1
    self.waiting.add_request(request)


def _no_budget_given_back(self, request, num_new_tokens, step):
    """Forgets that a priority victim may already have been scheduled in this step."""
    while True:
        new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
        if new_blocks is not None:
            return new_blocks
        victim = self._pick_victim()
        i = self.running.index(victim)
        del self.running[i]
        if i < step.req_index:
            step.req_index -= 1
        self._preempt_request(victim)
        step.preempted_reqs.append(victim)
        if victim is request:
            return None


PM = lesson06.PREEMPTION_METHODS
FirstVictim = variant("FirstVictim", Preemption, PM, _pick_victim=_first_victim)
ComputedTokensKept = variant("ComputedTokensKept", Preemption, PM, _preempt_request=_computed_tokens_kept)
VictimAtTheBack = variant("VictimAtTheBack", Preemption, PM, _preempt_request=_victim_at_the_back)
NoBudgetGivenBack = variant("NoBudgetGivenBack", Preemption, PM, _allocate_slots_or_preempt=_no_budget_given_back)


def test_the_first_running_request_as_victim_fails_at_the_first_preemption():
    msg = _failure("preempt_request", FirstVictim)
    assert "06 section 1: three requests in 9 blocks" in msg
    # A, first in the running queue, needs a block and preempts itself instead of C
    assert "first difference: step 5, field num_scheduled_tokens, request A" in msg
    assert '≠ preempted                  ["C"]                                       ["A"]' in msg


def test_keeping_num_computed_tokens_fails_at_the_resume():
    msg = _failure("preempt_request", ComputedTokensKept)
    assert "06 section 1: three requests in 9 blocks" in msg
    assert "first difference: step 20, field num_scheduled_tokens, request B" in msg
    assert 'expected: {"B": 17, "C": 13}' in msg and 'yours:    {"B": 1, "C": 1}' in msg


def test_the_victim_at_the_back_of_the_waiting_queue_fails_on_the_queue_order():
    msg = _failure("preempt_request", VictimAtTheBack)
    assert "06 section 1: three requests in 9 blocks" in msg
    assert "first difference: step 9, field waiting" in msg
    assert 'expected: ["B", "C"]' in msg and 'yours:    ["C", "B"]' in msg


def test_a_priority_victim_scheduled_earlier_in_the_step_must_give_its_tokens_back():
    msg = _failure("preempt_request", NoBudgetGivenBack)
    assert "06 section 7: low and high" in msg
    assert "first difference: step 11, field num_scheduled_tokens, request low" in msg
    assert 'expected: {"high": 1}' in msg and 'yours:    {"low": 1, "high": 1}' in msg


def test_overriding_another_parts_method_is_refused():
    Both = variant("Both", RunningLoop, RL, _pick_victim=vars(Preemption)["_pick_victim"])
    st, msg = status("running_loop", Both)
    assert st == "failed" and "also overrides _pick_victim" in msg


# ---- the picture: preemption before and after ------------------------------------------------------------------------
def test_the_preemption_picture_shows_the_victims_blocks_going_to_the_requests_that_needed_them():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from minivllm import SamplingParams
    from minivllm.course.trace import TracedLLMEngine
    from minivllm.course.viz.preemption_picture import plot_preemption, preemption_change

    eng = TracedLLMEngine("tiny", block_size=4, num_gpu_blocks=9, enable_prefix_caching=False)
    for i, rid in enumerate("ABC"):
        eng.add_request(rid, [10 + 7 * i + j for j in range(8)], SamplingParams(temperature=0, max_tokens=20))
    eng.run_to_completion()
    ch = preemption_change(eng.trace)
    assert (ch.step, ch.victims) == (5, ["C"])
    assert ch.before.running == ["A", "B", "C"] and ch.before.waiting == [] and ch.before.free_blocks == []
    assert ch.freed == {"C": [4, 5, 8]} and ch.gained == {"A": [4], "B": [5]} and ch.after.free_blocks == [8]
    assert ch.after.waiting == ["C"] and ch.after.computed["C"] == 0 and ch.before.computed["C"] == 12
    later = preemption_change(eng.trace, 9)  # B preempted while C waits: B goes in front of C
    assert later.before.waiting == ["C"] and later.after.waiting == ["B", "C"] and later.gained == {"A": [8]}
    fig, drawn = plot_preemption(eng.trace, 9)
    assert drawn.freed == later.freed and len(fig.axes) == 2
    plt.close(fig)
    with pytest.raises(ValueError, match=r"one of \[5, 9, 24\]"):
        preemption_change(eng.trace, 6)


def test_the_solutions_hand_the_settings_they_do_not_teach_to_the_reference():
    """Async scheduling (whose scheduler_cls must derive from AsyncScheduler), Model Runner V2, a KV connector
    (deferred block frees under async) and vLLM 0.33: the solutions, combined, schedule as the reference does."""
    from minivllm.core.sched.async_scheduler import AsyncScheduler

    mine = lesson06.scheduler_cls(RunningLoop, Preemption)
    mine_async = type("AsyncLesson06", (mine, AsyncScheduler), {})
    workloads = lesson06.notebook_workloads()
    for mode, cls in (("v1-async", mine_async), ("v2-async", mine_async), ("v2-sync", mine)):
        for connector in (False, True):
            for w in workloads:
                assert compare.run_steps(w, cls, connector, mode) == compare.run_steps(w, None, connector, mode), \
                    (mode, connector, w["name"])
    for w in workloads:
        w["extra_engine_kwargs"]["vllm_release"] = "0.33"
        assert compare.run_steps(w, mine) == compare.run_steps(w), w["name"]


def _solution_source(part):
    import json
    from pathlib import Path

    nb = json.loads((Path(__file__).parents[2] / "notebooks/solutions/06_preemption_solutions.ipynb").read_text())
    return next("".join(c["source"]) for c in nb["cells"] if "".join(c["source"]).startswith(f"# Your turn: {part}"))


def test_a_running_loop_that_sends_the_whole_table_fails_on_the_blocks_sent():
    """Found by a fresh learner: the whole block table (04's habit) instead of the blocks just allocated passed,
    and the engine then failed in 8c. The cached requests' block ids are compared now."""
    from minivllm.course.learner import parts

    src = _solution_source("running_loop")
    good = "step.new_block_ids[request.request_id] = [b.block_id for b in new_blocks]"
    assert good in src
    ns = {}
    exec(src.replace(good, "step.new_block_ids[request.request_id] = "
                           "self.kv_cache_manager.get_block_ids(request.request_id)"), ns)
    status, msg = parts.run_check(parts.get("running_loop"), ns["RunningLoop"])
    assert status == "failed"
    assert "first difference: step 1, field cached_new_block_ids, request A" in msg
    assert 'expected: {"A": [6], "B": [7], "C": [8]}' in msg


def test_a_running_loop_without_block_ids_is_told_which_entry_is_missing():
    from minivllm.course.learner import parts

    src = _solution_source("running_loop")
    ns = {}
    exec(src.replace("            step.new_block_ids[request.request_id] = [b.block_id for b in new_blocks]\n", ""),
         ns)
    status, msg = parts.run_check(parts.get("running_loop"), ns["RunningLoop"])
    assert status == "failed" and "KeyError: 'A'" in msg
    assert "request 'A' was scheduled" in msg and "no entry in step.new_block_ids" in msg
