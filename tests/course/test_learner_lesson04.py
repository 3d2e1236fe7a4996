"""Lesson 04's learner part, the waiting loop (``minivllm.course.learner.lesson04``): the worked solution passes
its checker (hidden workloads included), the blank cell is blank, known wrong loops fail with a message naming the
difference, and the grader finds the exercise cell in the committed notebooks."""

import io
from pathlib import Path

import pytest

from minivllm.core.sched.scheduler import Scheduler
from minivllm.course.learner import cells, grade, lesson04, parts

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
BLANK_NB = NOTEBOOKS / "04_continuous_batching.ipynb"
SOLUTION_NB = NOTEBOOKS / "solutions" / "04_continuous_batching_solutions.ipynb"


def _cell(path):
    found = [c for c in cells.exercise_cells(str(path)) if c.part == "waiting_loop"]
    assert len(found) == 1, f"{path.name}: {len(found)} cells start '# Your turn: waiting_loop'"
    return found[0].source


SOLUTION = _cell(SOLUTION_NB)


def _load(src):
    ns = {}
    exec(compile(src, "waiting_loop", "exec"), ns)  # noqa: S102 - the learner's cell, as the grader runs it
    return ns["WaitingLoop"]


def _variant(*pairs):
    """The worked solution with each ``(old, new)`` replaced (each ``old`` must occur)."""
    src = SOLUTION
    for old, new in pairs:
        assert old in src, old
        src = src.replace(old, new)
    return _load(src)


def _failure(cls):
    status, msg = parts.run_check(parts.get("waiting_loop"), cls, hidden=True)
    assert status == "failed", (status, msg)
    return msg


PEEK = "            request = self.waiting.peek_request()  # left in the queue until it is admitted\n"
WHILE = "        while self.waiting and step.token_budget > 0 and len(self.running) < self.config.max_num_seqs:\n"
NO_BLOCKS_BREAK = "            if new_blocks is None:\n                break"


def test_solution_passes_hidden_workloads_included():
    status, msg = parts.run_check(parts.get("waiting_loop"), _load(SOLUTION), hidden=True)
    n = len(lesson04.NOTEBOOK_WORKLOADS) + len(lesson04.HIDDEN_WORKLOADS)
    assert (status, msg) == ("passed", f"{n} cases equal to the reference (hidden ones included)")
    assert len(lesson04.HIDDEN_WORKLOADS) >= 15


def test_blank_cell_is_blank():
    status, msg = parts.run_check(parts.get("waiting_loop"), _load(_cell(BLANK_NB)), hidden=True)
    assert status == "blank" and "NotImplementedError" in msg


def test_blank_cell_runs_the_reference_in_the_engine(capsys):
    assert parts.yours_or_reference("waiting_loop", _load(_cell(BLANK_NB))) is Scheduler
    assert "runs the reference part (minivllm.core.sched.scheduler.Scheduler)" in capsys.readouterr().out
    sol = _load(SOLUTION)
    assert parts.yours_or_reference("waiting_loop", sol) is sol


def test_overtaking_fails_naming_the_request_that_overtook():
    """`continue` past a head that does not fit (a for loop over the queue): C overtakes B."""
    cls = _variant(
        (WHILE + PEEK, "        for request in list(self.waiting):\n"
                       "            if step.token_budget <= 0 or len(self.running) >= self.config.max_num_seqs:\n"
                       "                break\n"),
        (NO_BLOCKS_BREAK, "            if new_blocks is None:\n                continue"),
        ("            self.waiting.pop_request()\n", "            self.waiting.remove_requests([request])\n"))
    msg = _failure(cls)
    assert "on workload 'whole prompt'" in msg
    assert "first difference: step 1, field num_scheduled_tokens, request C" in msg
    assert 'yours:    {"A": 1, "C": 4}' in msg


def test_continue_after_peek_is_stopped_and_named():
    msg = _failure(_variant((NO_BLOCKS_BREAK, "            if new_blocks is None:\n                continue")))
    assert "peeked at the waiting queue's head" in msg and "step 1" in msg and "(break)" in msg


def test_ignoring_max_num_seqs_fails_naming_the_limit():
    msg = _failure(_variant((WHILE, "        while self.waiting and step.token_budget > 0:\n")))
    assert "step 1: after your waiting loop 5 requests run (A, B, C, D, E), more than max_num_seqs=3" in msg
    assert "on workload 'two limits'" in msg


def test_budget_not_decremented_fails_naming_the_budget():
    msg = _failure(_variant(("            step.token_budget -= num_new_tokens", "")))
    assert "step 0: after your waiting loop step.token_budget is 24" in msg
    assert "scheduled 26 tokens" in msg and "which leaves -2" in msg


def test_forgetting_the_whole_prompt_check_fails_on_b():
    msg = _failure(_variant(("                full_sequence_must_fit=self.config.scheduler_reserve_full_isl,\n", "")))
    assert "on workload 'whole prompt'" in msg
    assert "first difference: step 1, field num_scheduled_tokens, request B" in msg


def test_whole_prompt_check_always_on_fails_where_it_is_off():
    msg = _failure(_variant(("full_sequence_must_fit=self.config.scheduler_reserve_full_isl,",
                             "full_sequence_must_fit=True,")))
    assert "scheduler_reserve_full_isl=False" in msg and "on workload 'first chunk'" in msg
    assert "first difference: step 1, field num_scheduled_tokens, request B" in msg


def test_resumed_request_listed_as_new_fails_naming_the_field():
    msg = _failure(_variant(("                step.resumed_reqs.append(request)\n",
                             "                step.new_reqs.append(request)\n")))
    assert "first difference: step 4, field new, request B" in msg


def test_ignoring_a_too_long_head_without_chunking_fails_on_the_hidden_workload():
    msg = _failure(_variant(("            if num_new_tokens is None:\n                break",
                             "            if num_new_tokens is None:\n                num_new_tokens = step.token_budget")))
    assert "on workload 'no chunking, head too long'" in msg
    assert "first difference: step 0, field num_scheduled_tokens, request B" in msg


def test_missing_watermark_argument_fails_on_the_hidden_workload():
    msg = _failure(_variant(("                has_scheduled_reqs=bool(self.running),\n", "")))
    assert "on workload 'watermark'" in msg and "step 0, field num_scheduled_tokens, request B" in msg


def test_overriding_another_parts_method_is_refused():
    cls = _load(SOLUTION + "\n    def _num_new_tokens_waiting(self, request, num_computed_tokens, step):\n"
                           "        return super()._num_new_tokens_waiting(request, num_computed_tokens, step)\n")
    assert "override only _schedule_waiting; your class also overrides _num_new_tokens_waiting" in _failure(cls)


def test_grader_finds_the_cell_in_the_committed_notebooks():
    out = io.StringIO()
    [(part, status, _msg, _s)] = grade.grade(["04"], folder=str(NOTEBOOKS), out=out)
    assert (part.name, status) == ("waiting_loop", "blank")
    out = io.StringIO()
    [(part, status, msg, _s)] = grade.grade(["04"], folder=str(NOTEBOOKS), solutions=True, out=out)
    assert (part.name, status) == ("waiting_loop", "passed"), msg
    assert "lesson 04, parts passed: 1 of 1" in out.getvalue()


HAND_MADE = [w for w in lesson04.NOTEBOOK_WORKLOADS + lesson04.HIDDEN_WORKLOADS if not w["name"].startswith("hidden")]


@pytest.mark.parametrize("w", HAND_MADE, ids=lambda w: w["name"])
def test_every_hand_made_workload_admits_someone_after_step_0(w):
    """A workload where the waiting loop only ever runs at step 0 would not test it: each hand-made one admits a
    request later or leaves one waiting for a while."""
    from minivllm.course.learner.compare import run_steps

    steps = run_steps(w)
    assert any(s["new"] or s["resumed"] for s in steps[1:]) or any(s["waiting"] for s in steps), w["name"]
