"""Lesson 08's part ``fixed_connector`` (``minivllm/course/learner/lesson08.py``): the solution passes, hidden
scenarios included; the blank cell is blank; the traps of issue 26 fail (calling ``OffloadConnector``'s methods,
subclassing it, delegating to one, inheriting or reaching ``BuggyOffloadConnector``'s bug); known wrong variants
fail naming the scenario, step, field and request; an error in the learner's code is explained, never a bare
``KeyError``; the grader finds the exercise in notebook 08 (blank) and in its solutions notebook (passed)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from minivllm.course.buggy_connector import BuggyOffloadConnector
from minivllm.course.learner import cells, grade, parts
from minivllm.distributed.kv_transfer import BlockTransfer, OffloadConnector, OffloadConnectorBase

ROOT = Path(__file__).resolve().parents[2]
PART = parts.get("fixed_connector")


class FixedConnector(OffloadConnectorBase):
    """The solution of notebook 08's exercise (the same as in notebooks/solutions/08_kv_connector_solutions.ipynb)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.matches = {}
        self.requests_need_load = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        first, end = self.matched_blocks(request, num_computed_tokens)
        self.matches[request.request_id] = (first, end)
        return (end - first) * self.block_size, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens > 0:
            first, end = self.matches[request.request_id]
            self.requests_need_load[request.request_id] = BlockTransfer(
                request.request_id, [b.block_id for b in blocks[first:end]], list(request.block_hashes[first:end]))

    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        meta.loads.extend(self.requests_need_load.values())
        self.requests_need_load.clear()
        self.matches.clear()
        return meta


def _failed(cls) -> str:
    status, msg = parts.run_check(PART, cls, hidden=True)
    assert status == "failed", (status, msg)
    return msg


def test_the_solution_passes_every_scenario_hidden_ones_included():
    assert PART.kind == "connector" and PART.lesson == "08" and PART.reference is OffloadConnector
    assert PART.check(FixedConnector, False) == 3
    assert parts.run_check(PART, FixedConnector, hidden=True) == (
        "passed", "6 cases equal to the reference (hidden ones included)")


def test_the_blank_cell_is_blank():
    class Blank(OffloadConnectorBase):
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            raise NotImplementedError  # your code here

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            raise NotImplementedError  # your code here

        def build_connector_meta(self, scheduler_output):
            raise NotImplementedError  # your code here

    assert parts.run_check(PART, Blank)[0] == "blank"
    assert parts.run_check(PART, None)[0] == "blank"


def test_the_shortcut_calling_offload_connectors_methods_fails():
    class Shortcut(BuggyOffloadConnector):
        def get_num_new_matched_tokens(self, request, n):
            return OffloadConnector.get_num_new_matched_tokens(self, request, n)

        def update_state_after_alloc(self, request, blocks, n):
            OffloadConnector.update_state_after_alloc(self, request, blocks, n)

        def build_connector_meta(self, so):
            return OffloadConnector.build_connector_meta(self, so)

    msg = _failed(Shortcut)
    assert "called OffloadConnector.get_num_new_matched_tokens" in msg and "borrows the fix" in msg


def test_other_ways_of_borrowing_offload_connector_fail():
    class Sub(OffloadConnector):
        pass

    assert "subclasses OffloadConnector" in _failed(Sub)

    class Holds(FixedConnector):
        build_connector_meta = OffloadConnector.build_connector_meta

    assert "Holds.build_connector_meta is OffloadConnector.build_connector_meta" in _failed(Holds)

    class Inner(FixedConnector):  # delegation to a working connector inside, errors swallowed
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.inner = OffloadConnector(self.block_size, store=self.store)

        def get_num_new_matched_tokens(self, request, n):
            try:
                return self.inner.get_num_new_matched_tokens(request, n)
            except Exception:  # noqa: BLE001 - the guard is not an Exception, so it is not swallowed
                return 0, False

    assert "called OffloadConnector.get_num_new_matched_tokens" in _failed(Inner)


def test_super_to_the_buggy_parent_fails_naming_bug_1():
    class SuperToBuggy(BuggyOffloadConnector):
        def get_num_new_matched_tokens(self, request, n):
            return super().get_num_new_matched_tokens(request, n)

        def update_state_after_alloc(self, request, blocks, n):
            super().update_state_after_alloc(request, blocks, n)

        def build_connector_meta(self, so):
            meta = super().build_connector_meta(so)
            self.requests_need_load.clear()
            return meta

    msg = _failed(SuperToBuggy)
    assert "scenario '2: B waits for blocks" in msg and "first difference: step 0, field loads, request B" in msg
    assert "it got no blocks in this step (it is still waiting)" in msg
    assert "reached BuggyOffloadConnector.get_num_new_matched_tokens (through super()): bug 1" in msg


def test_inheriting_the_buggy_methods_names_the_bug():
    class OnlyClears(BuggyOffloadConnector):  # bug 2 fixed, bug 1 inherited
        def build_connector_meta(self, so):
            meta = super().build_connector_meta(so)
            self.requests_need_load.clear()
            return meta

    assert "inherits get_num_new_matched_tokens from BuggyOffloadConnector, so it keeps bug 1" in _failed(OnlyClears)
    assert "BuggyOffloadConnector itself" in _failed(BuggyOffloadConnector)


def test_a_connector_that_never_clears_fails_at_the_second_step():
    class NeverClears(FixedConnector):
        def build_connector_meta(self, so):
            meta = OffloadConnectorBase.build_connector_meta(self, so)
            meta.loads.extend(self.requests_need_load.values())
            return meta

    msg = _failed(NeverClears)
    assert "scenario '1: B shares two blocks" in msg and "first difference: step 1, field loads, request B" in msg
    assert 'expected: {}\n    yours:    {"B": [0, 1]}' in msg and "already emitted in step 0" in msg


def test_a_load_recorded_with_zero_external_tokens_fails():
    class RecordsZero(FixedConnector):
        def update_state_after_alloc(self, request, blocks, n):
            OffloadConnectorBase.update_state_after_alloc(self, request, blocks, n)
            first, end = self.matches[request.request_id]
            self.requests_need_load[request.request_id] = BlockTransfer(
                request.request_id, [b.block_id for b in blocks[first:end]], list(request.block_hashes[first:end]))

    msg = _failed(RecordsZero)
    assert "first difference: step 0, field loads, request C" in msg
    assert "num_external_tokens=0" in msg and "only if num_external_tokens > 0" in msg


def test_a_load_into_the_wrong_blocks_fails_after_the_preemption():
    class FromBlockZero(FixedConnector):  # ignores the local prefix-cache hit: loads into blocks[:n]
        def update_state_after_alloc(self, request, blocks, n):
            OffloadConnectorBase.update_state_after_alloc(self, request, blocks, n)
            if n > 0:
                k = n // self.block_size
                self.requests_need_load[request.request_id] = BlockTransfer(
                    request.request_id, [b.block_id for b in blocks[:k]], list(request.block_hashes[:k]))

    msg = _failed(FromBlockZero)
    assert "scenario '3: C is preempted twice" in msg and "first difference: step 16, field loads, request B" in msg
    assert "goes into other blocks" in msg


def test_a_wrong_answer_is_named_in_the_asked_field():
    class Asynchronous(FixedConnector):  # answers that the load is asynchronous: the request waits for a report
        def get_num_new_matched_tokens(self, request, n):
            first, end = self.matched_blocks(request, n)
            self.matches[request.request_id] = (first, end)
            return (end - first) * self.block_size, True  # the exercise loads synchronously

    msg = _failed(Asynchronous)
    assert "field asked, request B" in msg and "synchronously (is_async False)" in msg


def test_errors_in_the_learners_code_are_explained_not_bare_key_errors():
    class NoBookkeeping(FixedConnector):
        def update_state_after_alloc(self, request, blocks, n):
            if n > 0:
                first, end = self.matches[request.request_id]
                self.requests_need_load[request.request_id] = BlockTransfer(
                    request.request_id, [b.block_id for b in blocks[first:end]], [])

    msg = _failed(NoBookkeeping)
    assert "request 'B' is scheduled but the connector never saw its blocks" in msg
    assert "super().update_state_after_alloc(request, blocks, num_external_tokens)" in msg and ", step 0" in msg

    class PopsEarly(FixedConnector):
        def get_num_new_matched_tokens(self, request, n):
            answer = super().get_num_new_matched_tokens(request, n)
            self.matches.pop(request.request_id)
            return answer

    msg = _failed(PopsEarly)
    assert "raised KeyError: 'B'" in msg and "in scenario '1: B shares two blocks" in msg
    assert "in update_state_after_alloc" in msg and "already cleared or popped" in msg


def test_the_grader_finds_the_exercise_blank_and_the_solution_passing():
    blank = [c for c in cells.exercise_cells(str(ROOT / "notebooks" / "08_kv_connector.ipynb"))]
    assert [c.part for c in blank] == ["fixed_connector"]
    out = io.StringIO()
    rows = grade.grade(["08"], folder=str(ROOT / "notebooks"), out=out)
    assert [(p.name, status) for p, status, _m, _s in rows] == [("fixed_connector", "blank")]
    out = io.StringIO()
    rows = grade.grade(["08"], folder=str(ROOT / "notebooks"), solutions=True, out=out)
    assert [(p.name, status) for p, status, _m, _s in rows] == [("fixed_connector", "passed")], out.getvalue()


@pytest.mark.parametrize("cls", [FixedConnector, OffloadConnector])
def test_yours_or_reference_runs_the_learners_class_once_it_passes(cls, capsys):
    assert parts.yours_or_reference("fixed_connector", cls) is (cls if cls is FixedConnector else OffloadConnector)
    assert "fixed_connector: yours" in capsys.readouterr().out
