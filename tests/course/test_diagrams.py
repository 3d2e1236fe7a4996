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

ROOT = Path(__file__).resolve().parents[2]
SCHEDULER = (ROOT / "minivllm/core/sched/scheduler.py").read_text().splitlines()
DIAGRAMS = ["schedule_flowchart.png", "request_state_machine.png", "connector_calls.png"]
needs_dot = pytest.mark.skipif(not diagrams.dot_available(),
                               reason=f"Graphviz's dot is not installed: {diagrams.DOT_INSTALL} (as root)")


def test_flowchart_boxes_point_at_their_code():
    steps = {s.key: s for s in diagrams.schedule_flowchart_steps()}
    expect = {"running": "while step.req_index < len(self.running)",
              "allocate": "allocate_slots(request, num_new_tokens)",
              "preempt": "_preempt_request(victim", "scheduled": "step.running_scheduled.append(request)",
              "gate": "return not step.preempted_reqs", "waiting": "while self.waiting",
              "lookup": "if did_prefix_cache_lookup:", "prefix": "get_computed_blocks(",
              "match": "get_num_new_matched_tokens(", "full_isl": "full_sequence_must_fit=cfg.scheduler_reserve_full_isl",
              "admit": "allocate_slots(", "after_alloc": "update_state_after_alloc(",
              "was_preempted": "if request.status == RequestStatus.PREEMPTED:",
              "resumed": "resumed_reqs.append(request)", "new": "new_reqs.append(request)",
              "admitted": "token_budget -= num_new_tokens", "output": "SchedulerOutput(",
              "meta": "build_connector_meta(output)", "advance": "_update_after_schedule(output)"}
    assert set(expect) == set(steps)
    for key, code in expect.items():
        assert code in SCHEDULER[steps[key].line - 1], (key, steps[key].line, SCHEDULER[steps[key].line - 1])
    # each box lies in the method of the split schedule() that a scheduler_cls subclass overrides for it (issue 26)
    from minivllm.core.sched.scheduler import Scheduler

    def span(method):
        lines, first = inspect.getsourcelines(getattr(Scheduler, method))
        return range(first, first + len(lines))

    where = {"running": "_schedule_running", "scheduled": "_schedule_running", "allocate": "_allocate_slots_or_preempt",
             "preempt": "_allocate_slots_or_preempt", "gate": "_admission_gate_open", "prefix": "_prefix_cache_lookup",
             "match": "_prefix_cache_lookup", "output": "_build_scheduler_output", "meta": "schedule",
             "advance": "schedule"}
    for key in steps:
        assert steps[key].line in span(where.get(key, "_schedule_waiting")), key
    assert steps["admit"].line < steps["full_isl"].line  # the whole-prompt check is an argument of that call
    assert steps["admit"].line < steps["was_preempted"].line < steps["resumed"].line < steps["admitted"].line
    assert steps["meta"].line < steps["advance"].line
    # every box has arrows, and every arrow joins two boxes
    keys = set(steps)
    ends = {k for t, h, _, _ in diagrams._FLOW_EDGES for k in (t, h)}
    assert ends == keys
    assert {k for _, ks in diagrams._FLOW_PARTS for k in ks} == keys - {"gate"}


def _patched_source(monkeypatch, old, new):
    """Make the diagrams read scheduler.py with ``old`` replaced by ``new`` (in whichever method holds it)."""
    real = inspect.getsourcelines
    assert old in inspect.getsource(__import__("minivllm.core.sched.scheduler", fromlist=["x"]))

    def fake(fn):
        lines, first = real(fn)
        return [line.replace(old, new) for line in lines], first

    monkeypatch.setattr(inspect, "getsourcelines", fake)


def test_flowchart_fails_loudly_without_the_whole_prompt_check(monkeypatch):
    _patched_source(monkeypatch, "full_sequence_must_fit=cfg.scheduler_reserve_full_isl", "full_sequence_must_fit=False")
    with pytest.raises(LookupError, match="scheduler_reserve_full_isl"):
        diagrams.schedule_flowchart_steps()


def test_flowchart_fails_loudly_without_the_gate(monkeypatch):
    _patched_source(monkeypatch, "return not step.preempted_reqs", "return True")
    with pytest.raises(LookupError, match="preempted_reqs"):
        diagrams.schedule_flowchart_steps()


@pytest.mark.parametrize("old, new, match", [
    # the preemption step no longer preempts: its box's code is gone
    ("self._preempt_request(victim, drop_stale_output=self.requires_kv_delivery)", "pass", "_preempt_request"),
    # the prefix-cache lookup no longer asks the connector
    ("self.connector.get_num_new_matched_tokens(", "self.connector.ask(", "get_num_new_matched_tokens"),
    # schedule() still asks the gate, but runs the waiting loop whatever it says
    ("if self._admission_gate_open(step):", "self._admission_gate_open(step)\n        if True:",
     "gate and the waiting loop"),
    # schedule() builds the output before the waiting loop has run
    ("self._schedule_running(step)", "self._schedule_running(step); self._build_scheduler_output(step)",
     "gate and the waiting loop"),
])
def test_flowchart_fails_loudly_when_a_part_changed(monkeypatch, old, new, match):
    diagrams.schedule_flowchart_steps()  # the real scheduler draws
    _patched_source(monkeypatch, old, new)
    with pytest.raises(LookupError, match=match):
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
    if diagrams.dot_available():
        assert "WAITING_FOR_GRAMMAR" in diagrams.request_state_machine_graph().source
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


@needs_dot
@pytest.mark.parametrize("name", DIAGRAMS)
def test_diagram_layout_has_no_overflow_or_overlap(name):
    # Graphviz's own layout (dot -Tjson): each text line's position and width, each shape's outline
    lay = diagrams.layout(diagrams.GRAPHS[name]())
    assert diagrams.layout_problems(lay) == []
    texts = [t for obj in lay["objects"] for t, _ in diagrams._texts(obj.get("_ldraw_"))]
    texts += [t for e in lay.get("edges", []) for t, _ in diagrams._texts(e.get("_ldraw_"))]
    assert len(texts) > 10  # the check saw the labels (a layout without text would pass vacuously)


@needs_dot
@pytest.mark.parametrize("name", DIAGRAMS)
def test_chinese_diagram_layout_is_clean_and_in_chinese(name):
    # under zh_CN the labels are the catalog's Chinese, set in DejaVu Sans then Noto Sans CJK SC, and still fit
    import os

    pytest.importorskip("mplfonts", reason="the Chinese diagrams need the font package mplfonts")
    from minivllm.i18n import set_language

    before = os.environ.get("FONTCONFIG_FILE")
    set_language("zh_CN")
    try:
        lay = diagrams.layout(diagrams.GRAPHS[name]())
    finally:
        set_language("en")
    assert os.environ.get("FONTCONFIG_FILE") == before  # set for the dot call only
    assert diagrams.layout_problems(lay) == []
    ops = [op for obj in lay["objects"] + lay.get("edges", []) + [lay] for op in obj.get("_ldraw_", [])]
    assert {op["face"] for op in ops if op["op"] == "F"} == {diagrams.FONT_ZH}
    texts = [op["text"] for op in ops if op["op"] == "T"]
    chinese = [t for t in texts if re.search(r"[\u4e00-\u9fff]", t)]
    assert len(chinese) >= 3, texts
    # code names stay as they are: the graph's title still names the source file
    assert any(".py" in t for t in texts)


def test_fontconfig_file_adds_the_chinese_font():
    # dot finds fonts through fontconfig: the file made for it lists mplfonts' Noto Sans CJK SC (and only adds it)
    import os
    import shutil
    import subprocess

    pytest.importorskip("mplfonts", reason="the Chinese diagrams need the font package mplfonts")
    if shutil.which("fc-list") is None:
        pytest.skip("fontconfig's fc-list is not installed")
    from minivllm.course.viz import fonts

    conf = fonts.fontconfig_file()
    assert fonts.fontconfig_file() == conf  # made once per process
    listed = subprocess.run(["fc-list", "-f", "%{file}|%{family}\n"], env=dict(os.environ, FONTCONFIG_FILE=str(conf)),
                            capture_output=True, text=True, check=True).stdout.splitlines()
    ours = [line for line in listed if line.startswith(str(conf.parent))]
    assert len(ours) == 1 and fonts.FONT_NAME in ours[0], ours
    assert (conf.parent / "fonts" / fonts.FONT_FILE).resolve() == fonts.cjk_font_path().resolve()


@needs_dot
def test_flowchart_layout_carries_the_new_paths():
    lay = diagrams.layout(diagrams.schedule_flowchart_graph())
    text = "\n".join(t for obj in lay["objects"] + lay.get("edges", []) for t, _ in diagrams._texts(obj.get("_ldraw_")))
    assert "cfg.scheduler_reserve_full_isl?" in text and "resumed_reqs.append(request)" in text
    assert "a later step: resumed from" in text  # the preempted request's way back to the waiting loop
    for step in diagrams.schedule_flowchart_steps():
        assert f"[scheduler.py L{step.line}]" in text


@needs_dot
def test_layout_check_catches_a_too_long_label():
    # the flowchart with one box held at a fixed size and given a label far too long for it: Graphviz lays it
    # out anyway (text past the diamond's sides), and the check says so
    g = diagrams.schedule_flowchart_graph()
    g.node("allocate", "kv_cache_manager.allocate_slots(request, n) blocks free? " * 3, fixedsize="true",
           width="3", height="0.8")
    problems = diagrams.layout_problems(diagrams.layout(g))
    assert any(p.startswith("node allocate:") and "overflows its box" in p for p in problems), problems
    with pytest.raises(ValueError, match="overflows its box"):
        diagrams.render(g, Path("/nonexistent/never-written.png"))
    # inside the bounding box but outside the diamond's sides is an overflow too: the line (128 pt wide) fits a
    # 144 x 43 pt box, not the diamond drawn in that box
    g = diagrams._digraph("t")
    g.node("d", "a label as wide as the box", shape="diamond", fixedsize="true", width="2", height="0.6")
    assert any("overflows" in p for p in diagrams.layout_problems(diagrams.layout(g)))
    g = diagrams._digraph("t")
    g.node("d", "a label as wide as the box", shape="box", fixedsize="true", width="2", height="0.6")
    assert diagrams.layout_problems(diagrams.layout(g)) == []


@needs_dot
def test_layout_check_catches_an_edge_label_on_a_node():
    lay = diagrams.layout(diagrams.schedule_flowchart_graph())
    assert diagrams.layout_problems(lay) == []
    node = next(o for o in lay["objects"] if o.get("name") == "gate")
    x, y = (float(v) for v in node["pos"].split(","))
    edge = next(e for e in lay["edges"] if e.get("label") == "no")
    for op in edge["_ldraw_"]:  # move the "no" label onto the gate's text, as the old flowchart had it on "blocks"
        if op["op"] == "T":
            op["pt"] = [x, y]
    problems = diagrams.layout_problems(lay)
    assert "edge label 'no' lies on node gate" in problems, problems


def test_render_without_dot_names_the_install(monkeypatch, tmp_path):
    monkeypatch.setattr(diagrams.shutil, "which", lambda name: None)
    assert not diagrams.dot_available()
    with pytest.raises(RuntimeError, match="apt-get install -y -qq graphviz"):
        diagrams.schedule_flowchart(tmp_path / "f.png")
    assert not (tmp_path / "f.png").exists()


@needs_dot
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
    images = sorted(p.name for p in (ROOT / "images").iterdir() if p.is_file())
    assert images and [n for n in images if n not in used] == []
    # images/zh-CN/ holds Chinese versions of these (the Chinese edition shows them instead), nothing else
    zh = ROOT / "images" / figures.ZH_SUBDIR
    assert sorted(p.name for p in (ROOT / "images").iterdir() if not p.is_file()) == [figures.ZH_SUBDIR]
    assert [p.name for p in zh.iterdir() if p.name not in images] == []
    # and every registered figure is in images/
    assert set(figures.load_all()) <= set(images)
