"""The diagrams drawn from the engine's code (``minivllm.course.diagrams``), and that every figure in ``images/``
is used by the README or a notebook."""

from __future__ import annotations

import enum
import inspect
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pytest

from minivllm.course import diagrams, figures

ROOT = Path(__file__).resolve().parents[1]
SCHEDULER = (ROOT / "minivllm/core/sched/scheduler.py").read_text().splitlines()
DIAGRAMS = ["schedule_flowchart.png", "request_state_machine.png", "connector_calls.png"]


def test_flowchart_boxes_point_at_their_code():
    steps = {s.key: s for s in diagrams.schedule_flowchart_steps()}
    expect = {"running": "while i < len(self.running)", "allocate": "allocate_slots(request, n)",
              "preempt": "_preempt_request(victim", "gate": "if not preempted_reqs:",
              "waiting": "while self.waiting", "match": "get_num_new_matched_tokens(",
              "after_alloc": "update_state_after_alloc(", "output": "SchedulerOutput(",
              "meta": "build_connector_meta(output)", "advance": "_update_after_schedule(output)"}
    for key, code in expect.items():
        assert code in SCHEDULER[steps[key].line - 1], (key, steps[key].line, SCHEDULER[steps[key].line - 1])
    order = [s.line for s in diagrams.schedule_flowchart_steps()]
    assert steps["gate"].line > steps["preempt"].line and steps["gate"].line < steps["waiting"].line
    assert order[-3:] == sorted(order[-3:])  # output, connector metadata, then the counters advance


def test_flowchart_fails_loudly_without_the_gate(monkeypatch):
    from minivllm.core.sched.scheduler import Scheduler

    src = inspect.getsource(Scheduler.schedule).replace("if not preempted_reqs:", "if True:")
    monkeypatch.setattr(inspect, "getsourcelines", lambda fn: (src.splitlines(True), 111))
    with pytest.raises(LookupError, match="preempted_reqs"):
        diagrams.schedule_flowchart_steps()


def test_state_machine_states_come_from_the_enum(monkeypatch, tmp_path):
    from minivllm import request

    states, transitions = diagrams.request_state_machine()
    assert states == [s.name for s in request.RequestStatus]
    pairs = {(t.source, t.target) for t in transitions}
    assert {("WAITING", "RUNNING"), ("RUNNING", "PREEMPTED"), ("PREEMPTED", "RUNNING"),
            ("RUNNING", "FINISHED_STOPPED"), ("RUNNING", "FINISHED_LENGTH_CAPPED")} <= pairs
    assert ("PREEMPTED", "WAITING") not in pairs  # a preempted request stays PREEMPTED in the waiting queue
    # a new member of RequestStatus shows up as a node of its own
    members = {s.name: s.value for s in request.RequestStatus}
    members["WAITING_FOR_GRAMMAR"] = max(members.values()) + 1
    extended = enum.IntEnum("RequestStatus", members)
    extended.is_finished = staticmethod(lambda s: s > extended.PREEMPTED and s.name.startswith("FINISHED"))
    monkeypatch.setattr(request, "RequestStatus", extended)
    states, _ = diagrams.request_state_machine()
    assert "WAITING_FOR_GRAMMAR" in states
    diagrams.request_state_machine_figure(tmp_path / "s.png")
    assert (tmp_path / "s.png").stat().st_size > 10_000


def test_connector_calls_cover_the_base_class():
    from minivllm.distributed.kv_transfer.base import KVConnectorBase

    calls = diagrams.connector_calls()
    public = {n for n, f in KVConnectorBase.__dict__.items() if inspect.isfunction(f) and not n.startswith("_")}
    assert {c.method for c in calls} == public
    side = {c.method: c.side for c in calls}
    assert side["build_connector_meta"] == side["get_num_new_matched_tokens"] == "scheduler"
    assert side["start_load_kv"] == side["wait_for_save"] == "worker"
    for c in calls:
        assert c.call_sites, f"{c.method} is never called by the engine"
        assert all(s.startswith(("minivllm/core/", "minivllm/worker/", "minivllm/engine/")) for s in c.call_sites)
    worker = [c.method for c in calls if c.side == "worker"]
    assert worker.index("bind_connector_metadata") < worker.index("start_load_kv") < worker.index("wait_for_save")
    assert worker.index("wait_for_save") < worker.index("clear_connector_metadata")


def test_figures_command_draws_the_diagrams(tmp_path):
    assert figures.main([*sum((["--only", n] for n in DIAGRAMS), []), "--out", str(tmp_path)]) == 0
    for n in DIAGRAMS:
        assert (tmp_path / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(DIAGRAMS) <= set(figures.load_all())


def test_every_figure_in_images_is_used():
    texts = [(ROOT / "README.md").read_text(encoding="utf-8")]
    texts += [p.read_text(encoding="utf-8") for p in sorted((ROOT / "notebooks").glob("*.ipynb"))]
    texts += [p.read_text(encoding="utf-8") for p in sorted((ROOT / "notebooks").glob("*.md"))]
    used = set(re.findall(r"[\w.-]+\.(?:png|svg|jpg)", "\n".join(texts)))
    images = sorted(p.name for p in (ROOT / "images").iterdir())
    assert images and [n for n in images if n not in used] == []
    # and every registered figure is in images/
    assert set(figures.load_all()) <= set(images)
