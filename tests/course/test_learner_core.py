"""The core of the learner's engine parts (issue 26): the step-by-step comparison, the exercise cells read from a
saved notebook, the grader's table and exit status, predictions, and the composition of scheduler parts."""

import nbformat
import pytest

from minivllm.core.sched.scheduler import Scheduler
from minivllm.course.learner import compare, parts
from minivllm.course.learner import grade as grade_mod
from minivllm.course.learner.your_engine import Chosen, check_against_vllm, scheduler_cls

W = compare.workload("two prompts at budget 8", dict(max_num_batched_tokens=8, max_num_seqs=4,
                                                     long_prefill_token_threshold=4),
                     [("A", 10, 2), ("B", 6, 2)])


class NoThreshold(Scheduler):
    """Wrong: ignores long_prefill_token_threshold."""

    def _num_new_tokens_waiting(self, request, num_computed_tokens, step):
        return min(request.num_tokens - num_computed_tokens, step.token_budget)


class Blank(Scheduler):
    def _num_new_tokens_waiting(self, request, num_computed_tokens, step):
        raise NotImplementedError


class Right(Scheduler):
    def _num_new_tokens_waiting(self, request, num_computed_tokens, step):
        return super()._num_new_tokens_waiting(request, num_computed_tokens, step)


def test_first_difference_names_step_field_and_request():
    d = compare.first_difference(compare.run_steps(W), compare.run_steps(W, NoThreshold))
    assert (d.step, d.field, d.request) == (0, "num_scheduled_tokens", "A")
    assert d.expected == {"A": 4, "B": 4} and d.got == {"A": 8}
    text = d.format()
    assert "step 0, field num_scheduled_tokens, request A" in text


def test_equal_runs_have_no_difference_and_hidden_workloads_are_reproducible():
    ws = compare.random_workloads(3, 3)
    assert [w["requests"] for w in ws] == [w["requests"] for w in compare.random_workloads(3, 3)]
    for w in ws:
        assert compare.first_difference(compare.run_steps(w), compare.run_steps(w, Right)) is None


def test_check_scheduler_part_blank_wrong_right_and_stray_override():
    methods = ["_num_new_tokens_waiting"]
    with pytest.raises(parts.NotWritten):
        compare.check_scheduler_part("chunks", Blank, methods, [W])
    with pytest.raises(parts.PartFailed, match="field num_scheduled_tokens, request A"):
        compare.check_scheduler_part("chunks", NoThreshold, methods, [W])
    assert compare.check_scheduler_part("chunks", Right, methods, [W], compare.random_workloads(1, 2)) == 3

    class Stray(Right):
        def _admission_gate_open(self, step):
            return True

    with pytest.raises(parts.PartFailed, match="also overrides _admission_gate_open"):
        compare.check_scheduler_part("chunks", Stray, methods, [W])
    with pytest.raises(parts.PartFailed, match="define _num_new_tokens_waiting"):
        compare.check_scheduler_part("chunks", Scheduler, methods, [W])


@pytest.fixture
def toy_part(monkeypatch):
    """A registry holding one toy part, so the grader is tested apart from the lessons."""
    part = parts.Part(name="toy_chunks", lesson="05", symbol="Chunks", kind="scheduler",
                      seam="scheduler_cls: Scheduler._num_new_tokens_waiting", writes="chunk sizing",
                      check=lambda cls, hidden: compare.check_scheduler_part(
                          "toy_chunks", cls, ["_num_new_tokens_waiting"], [W]),
                      hints=("nudge", "idea", "line"), reference=Scheduler)
    monkeypatch.setattr(parts, "PARTS", {"toy_chunks": part})
    monkeypatch.setattr(parts, "LESSON_MODULES", ())
    return part


def _notebook(folder, body):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# 05"),
                nbformat.v4.new_code_cell("# Your turn: toy_chunks\nfrom minivllm.core.sched.scheduler import "
                                          "Scheduler\n\nclass Chunks(Scheduler):\n" + body),
                nbformat.v4.new_code_cell("check('toy_chunks', Chunks)")]
    nbformat.write(nb, str(folder / "05_toy.ipynb"))


@pytest.mark.parametrize("body, status, code", [
    ("    def _num_new_tokens_waiting(self, r, n, step):\n        raise NotImplementedError\n", "blank", 1),
    ("    def _num_new_tokens_waiting(self, r, n, step):\n        return min(r.num_tokens - n, step.token_budget)\n",
     "failed", 1),
    ("    def _num_new_tokens_waiting(self, r, n, step):\n        return super()._num_new_tokens_waiting(r, n, step)\n",
     "passed", 0),
    ("    def _num_new_tokens_waiting(self, r, n, step)\n        pass\n", "error", 1),
])
def test_grader_reads_the_saved_notebook(tmp_path, toy_part, capsys, body, status, code):
    _notebook(tmp_path, body)
    rc = grade_mod.main(["05", "--notebooks", str(tmp_path), "--hints", "2"])
    out = capsys.readouterr().out
    assert rc == code
    assert grade_mod.STATUS_MARK[status] in out
    assert "lesson 05, parts passed: %d of 1" % (status == "passed") in out
    if status == "failed":
        assert "first difference: step 0, field num_scheduled_tokens, request A" in out
        assert "Hint 1:\n      nudge" in out and "Hint 2:\n      idea" in out and "Hint 3" not in out
    if status == "error":
        assert "SyntaxError" in out


def test_notebook_check_prints_and_raises(toy_part, capsys):
    assert parts.check("toy_chunks", Right) is True
    assert parts.check("toy_chunks", Blank) is None
    assert "not written yet" in capsys.readouterr().out
    with pytest.raises(parts.PartFailed, match="request A"):
        parts.check("toy_chunks", NoThreshold)
    assert parts.yours_or_reference("toy_chunks", NoThreshold) is Scheduler
    assert "does not pass its checker yet" in capsys.readouterr().out


def test_check_prediction(capsys):
    assert parts.check_prediction("chunks", [64, 64, 32], [64, 64, 32]) is True
    assert parts.check_prediction("chunks", [64, 96], [64, 64, 32], "the budget is 64") is False
    assert parts.check_prediction("chunks", None, [64, 64, 32]) is None
    out = capsys.readouterr().out
    assert "✓ chunks" in out and "why: the budget is 64" in out and "What happened: [64, 64, 32]" in out


def test_scheduler_parts_compose_into_one_scheduler_cls(toy_part):
    class Gate(Scheduler):
        def _admission_gate_open(self, step):
            return super()._admission_gate_open(step)

    toy2 = parts.Part(name="toy_gate", lesson="06", symbol="Gate", kind="scheduler", seam="", writes="",
                      check=lambda c, h: 1, hints=("", "", ""), reference=Scheduler)
    parts.PARTS["toy_gate"] = toy2
    cls = scheduler_cls(Chosen(objs={"toy_chunks": Right, "toy_gate": Gate}))
    assert cls.__mro__[1:3] == (Gate, Right) and issubclass(cls, Scheduler)
    assert scheduler_cls(Chosen(objs={"toy_chunks": Scheduler})) is Scheduler
    results = check_against_vllm(Chosen(objs={"toy_chunks": Right, "toy_gate": Gate}),
                                 scenarios=["chunked_prefill_160_at_64", "two_victims_one_step"])
    assert [(n, ok) for n, ok, _ in results] == [("chunked_prefill_160_at_64", True), ("two_victims_one_step", True)]
    bad = check_against_vllm(Chosen(objs={"toy_chunks": NoThreshold}), scenarios=["two_victims_one_step"])
    assert not bad[0][1] and "first difference at step" in bad[0][2]
