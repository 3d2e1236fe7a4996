"""Diagrams of the engine's code, derived from the engine itself: ``schedule()`` as a flowchart, the request state
machine, and the KV connector's calls. Registered with ``python -m minivllm figures``; laid out by Graphviz
(the ``graphviz`` Python package drives Debian's ``dot``: ``apt-get install graphviz``), so that no box, arrow or
label is placed by hand.

Nothing is drawn from a hand-kept list alone:

* ``schedule_flowchart_steps`` finds each box of the flowchart in the syntax tree of ``Scheduler.schedule`` and
  of the methods it is split into (``FLOW_METHODS``: the two loops, ``allocate_slots``, ``_preempt_request``, the
  gate ``not preempted_reqs``, the prefix-cache lookup, the connector calls, the whole-prompt admission check
  ``full_sequence_must_fit=scheduler_reserve_full_isl``, the resumed-or-new split, the ``SchedulerOutput``) and
  labels it with its line in ``minivllm/core/sched/scheduler.py``; a box whose code is gone, or a ``schedule()``
  that no longer calls the running loop, the gate and the waiting loop in that order, raises ``LookupError``.
* ``request_state_machine`` takes the states from ``RequestStatus`` (a new member appears as a new node) and
  checks every transition against the assignments ``*.status = RequestStatus.X`` in the method that makes it; an
  assignment in the scheduler that no transition explains raises ``LookupError``.
* ``connector_calls`` takes the methods from ``KVConnectorBase`` (scheduler side and worker side as its source
  groups them) and finds where the engine calls each one.

Each figure is a ``graphviz.Digraph`` (``schedule_flowchart_graph`` and the others in ``GRAPHS``). ``render``
writes its PNG only after ``layout_problems`` found, in Graphviz's own layout (``dot -Tjson``: every shape's
outline and every text line's position and width), no text outside its box and no edge label on a node.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import shutil
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from minivllm.course.figures import register
from minivllm.i18n import N_, _, is_chinese

# The folder that holds the minivllm package: the checkout, or site-packages in an install (the diagrams read
# only the package's own source, so both give the same pictures).
ROOT = Path(__file__).resolve().parents[2]

DOT_INSTALL = "apt-get update -qq && apt-get install -y -qq graphviz"
"""The Debian command that installs Graphviz's ``dot`` (the ``graphviz`` Python package only drives it)."""


def _tree(fn: Callable) -> Tuple[ast.AST, int]:
    """The syntax tree of ``fn`` and the line offset that makes its line numbers the file's."""
    lines, first = inspect.getsourcelines(fn)
    return ast.parse(textwrap.dedent("".join(lines))), first - 1


def _calls(tree: ast.AST, name: str, on: str = "") -> Iterator[ast.Call]:
    """Calls of ``name`` (a method or a function) in ``tree``; with ``on``, only ``on.name(...)`` or
    ``x.on.name(...)`` (``step.running_scheduled.append``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == name:
                if not on or _named(f.value, on):
                    yield node
            elif isinstance(f, ast.Name) and f.id == name and not on:
                yield node


# ---- schedule() ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FlowStep:
    """One box of the ``schedule()`` flowchart: ``key``, its text, the line in ``scheduler.py``, its kind
    (``"process"``, ``"decision"`` or ``"io"``)."""

    key: str
    text: str
    line: int
    kind: str = "process"


def _named(e: ast.AST, name: str) -> bool:
    """``e`` is the name ``name`` or an attribute of that name (``preempted_reqs``, ``step.preempted_reqs``)."""
    return (isinstance(e, ast.Name) and e.id == name) or (isinstance(e, ast.Attribute) and e.attr == name)


# the methods of Scheduler that hold the flowchart's boxes: vLLM's schedule() is one method, minivllm's is split
# so that a scheduler_cls subclass can replace one part (issue 26)
FLOW_METHODS = ("schedule", "_schedule_running", "_allocate_slots_or_preempt", "_admission_gate_open",
                "_schedule_waiting", "_prefix_cache_lookup", "_build_scheduler_output")


def schedule_flowchart_steps() -> List[FlowStep]:
    """The boxes of the ``schedule()`` flowchart, in order (the running loop's four, the gate, then the rest),
    each located in the method of ``Scheduler`` that holds its code (``schedule`` and the parts it is split into,
    ``FLOW_METHODS``).

    Raises:
        LookupError: when a box's code is not found, or ``schedule()`` no longer calls the running loop, the gate
            and the waiting loop in that order (the scheduler changed: update the flowchart).
    """
    from minivllm.core.sched.scheduler import Scheduler

    trees: Dict[str, Tuple[ast.AST, int]] = {}
    for m in FLOW_METHODS:
        fn = getattr(Scheduler, m, None)
        if fn is None:
            raise LookupError(f"Scheduler.{m} is gone: the flowchart finds its boxes there")
        trees[m] = _tree(fn)

    def line(m: str, node: ast.AST) -> int:
        return node.lineno + trees[m][1]  # type: ignore[attr-defined]

    def loop_over(m: str, attr: str) -> ast.While:
        for w in (n for n in ast.walk(trees[m][0]) if isinstance(n, ast.While)):
            if any(isinstance(n, ast.Attribute) and n.attr == attr for n in ast.walk(w.test)):
                return w
        raise LookupError(f"Scheduler.{m}: no `while` loop over self.{attr}")

    def first_call(m: str, name: str, on: str = "", node: Optional[ast.AST] = None) -> ast.Call:
        found = sorted(_calls(trees[m][0] if node is None else node, name, on), key=lambda c: c.lineno)
        if not found:
            what = f"{on}.{name}" if on else name
            raise LookupError(f"Scheduler.{m}: no call of {what}() where the flowchart expects one")
        return found[0]

    def first_if(m: str, test: Callable[[ast.expr], bool], what: str) -> ast.If:
        found = sorted((n for n in ast.walk(trees[m][0]) if isinstance(n, ast.If) and test(n.test)),
                       key=lambda n: n.lineno)
        if not found:
            raise LookupError(f"Scheduler.{m}: no `if {what}:` where the flowchart expects one")
        return found[0]

    running, waiting = loop_over("_schedule_running", "running"), loop_over("_schedule_waiting", "waiting")
    gate = sorted((n for n in ast.walk(trees["_admission_gate_open"][0]) if isinstance(n, ast.UnaryOp)
                   and isinstance(n.op, ast.Not) and _named(n.operand, "preempted_reqs")), key=lambda n: n.lineno)
    if not gate:
        raise LookupError("Scheduler._admission_gate_open: no `not step.preempted_reqs` where the flowchart "
                          "expects the gate")
    # schedule(): the running loop, then the gate, whose `if` holds the waiting loop, then the output
    sched = trees["schedule"][0]
    order = [first_call("schedule", n).lineno for n in
             ("_schedule_running", "_admission_gate_open", "_schedule_waiting", "_build_scheduler_output")]
    gate_if = [n for n in ast.walk(sched) if isinstance(n, ast.If) and any(
        isinstance(c, ast.Call) and _named(c.func, "_admission_gate_open") for c in ast.walk(n.test))]
    if order != sorted(order) or not gate_if or not any(
            isinstance(c, ast.Call) and _named(c.func, "_schedule_waiting") for b in gate_if[0].body
            for c in ast.walk(b)):
        raise LookupError("Scheduler.schedule: the running loop no longer comes before the gate and the waiting "
                          "loop (only when the gate is open), then the output")
    lookup = first_if("_schedule_waiting", lambda t: _named(t, "did_prefix_cache_lookup"), "did_prefix_cache_lookup")
    was_preempted = first_if(
        "_schedule_waiting", lambda t: isinstance(t, ast.Compare) and any(
            isinstance(c, ast.Attribute) and c.attr == "PREEMPTED" for c in t.comparators),
        "request.status == RequestStatus.PREEMPTED")
    admit = first_call("_schedule_waiting", "allocate_slots", node=waiting)
    full_isl = next((k for k in admit.keywords if k.arg == "full_sequence_must_fit"
                     and any(isinstance(n, ast.Attribute) and n.attr == "scheduler_reserve_full_isl"
                             for n in ast.walk(k.value))), None)
    if full_isl is None:
        raise LookupError("Scheduler._schedule_waiting: the waiting loop's allocate_slots() no longer passes "
                          "full_sequence_must_fit=cfg.scheduler_reserve_full_isl")
    budget = sorted((n for n in ast.walk(waiting) if isinstance(n, ast.AugAssign) and _named(n.target, "token_budget")
                     and isinstance(n.op, ast.Sub)), key=lambda n: n.lineno)
    if not budget:
        raise LookupError("Scheduler._schedule_waiting: the waiting loop no longer subtracts from token_budget")
    steps = [
        FlowStep("running", _("_schedule_running: each running request\nin order, while budget is left; n = min("
                 "tokens\nleft, long_prefill_token_threshold, budget)"), line("_schedule_running", running)),
        FlowStep("allocate", _("kv_cache_manager.allocate_slots(request, n)\nblocks free?"),
                 line("_allocate_slots_or_preempt", first_call("_allocate_slots_or_preempt", "allocate_slots")),
                 "decision"),
        FlowStep("preempt", _("victim = _pick_victim(); _preempt_request(victim)\nits blocks freed, "
                 "num_computed_tokens = 0,\nstatus PREEMPTED, front of the waiting queue"),
                 line("_allocate_slots_or_preempt", first_call("_allocate_slots_or_preempt", "_preempt_request"))),
        FlowStep("scheduled", _("running_scheduled.append(request)\nschedule n tokens, budget -= n"),
                 line("_schedule_running", first_call("_schedule_running", "append", on="running_scheduled",
                                                      node=running))),
        FlowStep("gate", _("_admission_gate_open:\nnot preempted_reqs? (nobody\npreempted in this step)"),
                 line("_admission_gate_open", gate[0]), "decision"),
        FlowStep("waiting", _("_schedule_waiting: the queue head (a new\nor a preempted request), while budget "
                 "and\nmax_num_seqs allow"), line("_schedule_waiting", waiting)),
        FlowStep("lookup", _("num_computed_tokens == 0?\n(new, or preempted: reset to 0)"),
                 line("_schedule_waiting", lookup), "decision"),
        FlowStep("prefix", _("_prefix_cache_lookup: kv_cache_manager.\nget_computed_blocks(request): prefix-cache\n"
                 "hits, its full blocks still cached"),
                 line("_prefix_cache_lookup", first_call("_prefix_cache_lookup", "get_computed_blocks"))),
        FlowStep("match", _("connector.get_num_new_matched_tokens(\nrequest, n_local): tokens it can load"),
                 line("_prefix_cache_lookup", first_call("_prefix_cache_lookup", "get_num_new_matched_tokens"))),
        FlowStep("full_isl", _("full_sequence_must_fit =\ncfg.scheduler_reserve_full_isl?"),
                 line("_schedule_waiting", full_isl.value), "decision"),
        FlowStep("admit", _("kv_cache_manager.allocate_slots(\nrequest, n, ...)\nblocks free?"),
                 line("_schedule_waiting", admit), "decision"),
        FlowStep("after_alloc", _("connector.update_state_after_alloc(...)\npop from waiting, append to running\n"
                 "(an async load: WAITING_FOR_REMOTE_KVS, next)"),
                 line("_schedule_waiting", first_call("_schedule_waiting", "update_state_after_alloc", node=waiting))),
        FlowStep("was_preempted", _("request.status ==\nPREEMPTED?"), line("_schedule_waiting", was_preempted),
                 "decision"),
        FlowStep("resumed", _("resumed_reqs.append(request)\nresumed: all its tokens prefilled again"),
                 line("_schedule_waiting", first_call("_schedule_waiting", "append", on="resumed_reqs", node=waiting))),
        FlowStep("new", _("new_reqs.append(request)"),
                 line("_schedule_waiting", first_call("_schedule_waiting", "append", on="new_reqs", node=waiting))),
        FlowStep("admitted", _("status = RUNNING, schedule n tokens,\nbudget -= n; then the next waiting request"),
                 line("_schedule_waiting", budget[-1])),
        FlowStep("output", _("_build_scheduler_output: SchedulerOutput(new,\ncached (resumed_req_ids), "
                 "num_scheduled_tokens,\npreempted_req_ids, finished_req_ids)"),
                 line("_build_scheduler_output", first_call("_build_scheduler_output", "SchedulerOutput")), "io"),
        FlowStep("meta", _("connector.build_connector_meta(output)\nonce per call, even with nothing scheduled"),
                 line("schedule", first_call("schedule", "build_connector_meta")), "io"),
        FlowStep("advance", _("_update_after_schedule(output)\nnum_computed_tokens += scheduled"),
                 line("schedule", first_call("schedule", "_update_after_schedule"))),
    ]
    lines = [s.line for s in steps]
    assert len(set(lines)) == len(lines), lines
    return steps


# (tail, head, label, extra attributes): the flowchart's arrows between the boxes above
_FLOW_EDGES: List[Tuple[str, str, str, Dict[str, str]]] = [
    ("running", "allocate", "", {}),
    ("allocate", "scheduled", N_("yes"), {}),
    ("allocate", "preempt", N_("no"), {}),
    ("preempt", "allocate", N_("retry, until it fits or\nthe request preempted itself"), {}),
    ("scheduled", "running", N_("next running request"), {}),
    ("running", "gate", N_("no running request left,\nor budget spent"), {}),
    ("preempt", "gate", N_("it preempted itself:\nstop the running loop"), {}),
    ("gate", "waiting", N_("yes"), {}),
    ("gate", "output", N_("no: a preemption in\nthis step, no admissions"), {}),
    ("waiting", "lookup", "", {}),
    ("waiting", "output", N_("queue empty, budget or\nmax_num_seqs spent"), {}),
    ("lookup", "prefix", N_("yes"), {}),
    ("lookup", "full_isl", N_("no: its KV came from an\nasync connector load"), {}),
    ("prefix", "match", "", {}),
    ("match", "full_isl", "", {}),
    ("full_isl", "admit", N_("True (default): blocks for the\nwhole sequence, prompt included"), {}),
    ("full_isl", "admit", N_("False: blocks for\nthis chunk only"), {}),
    ("admit", "after_alloc", N_("yes"), {}),
    ("admit", "output", N_("no: stop (waiting requests\nnever preempt; nothing overtakes)"), {}),
    ("after_alloc", "was_preempted", "", {}),
    ("was_preempted", "resumed", N_("yes"), {}),
    ("was_preempted", "new", N_("no"), {}),
    ("resumed", "admitted", "", {}),
    ("new", "admitted", "", {}),
    ("admitted", "waiting", "", {}),  # its box says "then the next waiting request" (a label here lies across the frame)
    ("output", "meta", "", {}),
    ("meta", "advance", "", {}),
    ("preempt", "waiting", N_("a later step: resumed from\nthe front of the waiting queue"),
     {"style": "dashed", "color": "#a05050", "fontcolor": "#a05050", "constraint": "false"}),
]

# which boxes each part of schedule() holds (a Graphviz cluster each; the others, the gate, lie between them)
_FLOW_PARTS = [
    (N_("1. running requests (_schedule_running)"), ["running", "allocate", "preempt", "scheduled"]),
    (N_("2. waiting requests (_schedule_waiting), only in a step that preempted nobody"),
     ["waiting", "lookup", "prefix", "match", "full_isl", "admit", "after_alloc", "was_preempted", "resumed", "new",
      "admitted"]),
    (N_("3. the output (_build_scheduler_output, then schedule())"), ["output", "meta", "advance"]),
]


# ---- Graphviz: style, layout check, rendering --------------------------------------------------------------------
FONT = "DejaVu Sans"
FONT_ZH = "DejaVu Sans,Noto Sans CJK SC"
"""The font family list under ``set_language("zh_CN")``: Pango draws each glyph from the first family that has it,
so code names keep the English pictures' DejaVu Sans and only the Chinese characters come from Noto Sans CJK SC
(made findable by ``_pipe``, see ``minivllm.course.viz.fonts.fontconfig_file``)."""
_FILL = {"process": "#e8eef7", "decision": "#fff1d6", "io": "#e6f4ea", "state": "#e8eef7", "final": "#f3e3e3",
         "orphan": "#eeeeee"}
_DPI = 100


def _digraph(title: str, **graph_attr: str):
    """A ``graphviz.Digraph`` in the course's style, titled ``title`` at the top."""
    import graphviz

    font = FONT_ZH if is_chinese() else FONT
    g = graphviz.Digraph(graph_attr={"label": title, "labelloc": "t", "fontname": font, "fontsize": "13",
                                     "dpi": str(_DPI), "pad": "0.2", "nodesep": "0.35", "ranksep": "0.45",
                                     "newrank": "true", **graph_attr},
                         node_attr={"fontname": font, "fontsize": "10", "style": "filled", "color": "#555555",
                                    "penwidth": "1.2", "margin": "0.15,0.07"},
                         edge_attr={"fontname": font, "fontsize": "9", "color": "#333333", "arrowsize": "0.7"})
    return g


def _node(g, name: str, label: str, kind: str) -> None:
    if kind == "decision":
        g.node(name, label, shape="diamond", fillcolor=_FILL[kind], margin="0.02,0.02")
    else:
        g.node(name, label, shape="box", style="rounded,filled", fillcolor=_FILL[kind])


def dot_available() -> bool:
    """Whether Graphviz's ``dot`` is on ``PATH`` (the ``graphviz`` Python package calls it)."""
    return shutil.which("dot") is not None


def _pipe(graph, fmt: str) -> bytes:
    """``dot -T<fmt>`` of ``graph``; under ``zh_CN`` with ``FONTCONFIG_FILE`` pointing at a configuration that adds
    Noto Sans CJK SC (the ``graphviz`` package runs ``dot`` with this process's environment, so it is set here for
    the call and restored after it). English runs with the environment untouched: its pictures stay the same."""
    if not dot_available():
        raise RuntimeError(f"Graphviz's dot is not installed; the diagrams need it: {DOT_INSTALL} (as root)")
    if not is_chinese():
        return graph.pipe(format=fmt)
    from minivllm.course.viz.fonts import fontconfig_file

    before = os.environ.get("FONTCONFIG_FILE")
    os.environ["FONTCONFIG_FILE"] = str(fontconfig_file())
    try:
        return graph.pipe(format=fmt)
    finally:
        if before is None:
            del os.environ["FONTCONFIG_FILE"]
        else:
            os.environ["FONTCONFIG_FILE"] = before


def layout(graph) -> Dict[str, Any]:
    """Graphviz's own layout of ``graph``: ``dot -Tjson`` parsed (points, y up; every shape's outline in
    ``_draw_``, every text line in ``_ldraw_``)."""
    return json.loads(_pipe(graph, "json"))


Box = Tuple[float, float, float, float]  # x0, y0, x1, y1


def _texts(ops: List[Dict[str, Any]]) -> List[Tuple[str, Box]]:
    """The text lines of an ``_ldraw_`` list, each with its box: the line's width from Graphviz, its height the
    font's (ascent 0.8, descent 0.25 of the size, around the baseline ``pt``)."""
    out, size = [], 14.0
    for op in ops or []:
        if op["op"] == "F":
            size = float(op["size"])
        elif op["op"] == "T":
            (x, y), w = op["pt"], float(op["width"])
            x0 = {"l": x, "r": x - w}.get(op.get("align", "c"), x - w / 2)
            out.append((op["text"], (x0, y - 0.25 * size, x0 + w, y + 0.8 * size)))
    return out


def _outline(ops: List[Dict[str, Any]]):
    """The shape drawn by a node's ``_draw_``: ``("polygon", points)``, ``("ellipse", (cx, cy, rx, ry))`` or
    ``("box", (x0, y0, x1, y1))`` (a rounded box's Bézier outline: its control points' hull); ``None`` if none."""
    for op in ops or []:
        if op["op"] in ("p", "P"):
            return "polygon", [tuple(p) for p in op["points"]]
        if op["op"] in ("e", "E"):
            (cx, cy), (rx, ry) = op["rect"][:2], op["rect"][2:]
            return "ellipse", (cx, cy, rx, ry)
        if op["op"] in ("b", "B"):
            xs, ys = [p[0] for p in op["points"]], [p[1] for p in op["points"]]
            return "box", (min(xs), min(ys), max(xs), max(ys))
    return None


def _inside(shape, x: float, y: float, tol: float = 0.5) -> bool:
    kind, g = shape
    if kind == "box":
        return g[0] - tol <= x <= g[2] + tol and g[1] - tol <= y <= g[3] + tol
    if kind == "ellipse":
        cx, cy, rx, ry = g
        return ((x - cx) / (rx + tol)) ** 2 + ((y - cy) / (ry + tol)) ** 2 <= 1.0
    # a convex polygon (Graphviz's box, diamond, ...): the point is on the inner side of every edge
    sign = 0.0
    for (x0, y0), (x1, y1) in zip(g, g[1:] + g[:1]):
        cross = (x1 - x0) * (y - y0) - (y1 - y0) * (x - x0)
        length = max(((x1 - x0) ** 2 + (y1 - y0) ** 2) ** 0.5, 1e-9)
        d = cross / length  # signed distance from the edge
        if abs(d) <= tol:
            continue
        if sign and (d > 0) != (sign > 0):
            return False
        sign = sign or d
    return True


def _bounds(shape) -> Box:
    kind, g = shape
    if kind == "ellipse":
        cx, cy, rx, ry = g
        return cx - rx, cy - ry, cx + rx, cy + ry
    if kind == "box":
        return g
    xs, ys = [p[0] for p in g], [p[1] for p in g]
    return min(xs), min(ys), max(xs), max(ys)


def _path(ops: List[Dict[str, Any]], steps: int = 24) -> List[Tuple[float, float]]:
    """Points along an edge's line (its ``_draw_`` B-spline: cubic Bézier pieces sharing their end points)."""
    out: List[Tuple[float, float]] = []
    for op in ops or []:
        if op["op"] not in ("b", "B"):
            continue
        pts = [tuple(p) for p in op["points"]]
        for i in range(0, len(pts) - 3, 3):
            (x0, y0), (x1, y1), (x2, y2), (x3, y3) = pts[i:i + 4]
            for k in range(steps + 1):
                t = k / steps
                a, b, c, d = (1 - t) ** 3, 3 * t * (1 - t) ** 2, 3 * t * t * (1 - t), t ** 3
                out.append((a * x0 + b * x1 + c * x2 + d * x3, a * y0 + b * y1 + c * y2 + d * y3))
    return out


def _overlap(a: Box, b: Box, tol: float = 0.5) -> bool:
    return a[0] < b[2] - tol and b[0] < a[2] - tol and a[1] < b[3] - tol and b[1] < a[3] - tol


def layout_problems(lay: Dict[str, Any]) -> List[str]:
    """What is wrong with a Graphviz layout (``layout(graph)``), as sentences; ``[]`` when it reads cleanly.

    Checked on Graphviz's own geometry: every text line of a node inside the node's outline (a diamond's sides
    included, not just its bounding box); no edge label on a node's box or on another edge label; every cluster's
    title inside its cluster and off its nodes; the graph's title inside the drawing; no two nodes overlapping.
    """
    problems: List[str] = []
    nodes = []
    for obj in lay.get("objects", []):
        shape = _outline(obj.get("_draw_"))
        if "bb" in obj or shape is None:  # a cluster (it has a bounding box), or an invisible node
            continue
        nodes.append((obj["name"], shape))
        for text, (x0, y0, x1, y1) in _texts(obj.get("_ldraw_")):
            if not all(_inside(shape, x, y) for x, y in ((x0, y0), (x0, y1), (x1, y0), (x1, y1))):
                problems.append(f"node {obj['name']}: {text!r} overflows its box")
    for i, (a, sa) in enumerate(nodes):
        for b, sb in nodes[i + 1:]:
            if _overlap(_bounds(sa), _bounds(sb)):
                problems.append(f"nodes {a} and {b} overlap")
    edge_labels, paths = [], []
    for i, e in enumerate(lay.get("edges", [])):
        paths.append((i, _path(e.get("_draw_"))))
        for key in ("_ldraw_", "_hldraw_", "_tldraw_"):
            for text, box in _texts(e.get(key)):
                edge_labels.append((i, text, box))
    titles = [(f"cluster {obj['name']}'s title", text, box) for obj in lay.get("objects", []) if "bb" in obj
              for text, box in _texts(obj.get("_ldraw_"))]
    for i, line in paths:  # no edge's line runs through an edge label (but its own) or a cluster's title
        for what, text, box in [("edge label", t, b) for j, t, b in edge_labels if j != i] + titles:
            if any(box[0] < x < box[2] and box[1] < y < box[3] for x, y in line):
                problems.append(f"an edge runs through {what} {text!r}")
    for _e, text, box in edge_labels:
        for name, shape in nodes:
            if _overlap(box, _bounds(shape)):
                problems.append(f"edge label {text!r} lies on node {name}")
    for i, (_e, a, ba) in enumerate(edge_labels):
        for _f, b, bb in edge_labels[i + 1:]:
            if _overlap(ba, bb):
                problems.append(f"edge labels {a!r} and {b!r} overlap")
    for obj in lay.get("objects", []):
        if "bb" not in obj:
            continue
        frame = tuple(float(v) for v in obj["bb"].split(","))
        x0, y0, x1, y1 = frame
        for text, box in _texts(obj.get("_ldraw_")):
            if not (x0 - 0.5 <= box[0] and box[2] <= x1 + 0.5 and y0 - 0.5 <= box[1] and box[3] <= y1 + 0.5):
                problems.append(f"cluster {obj['name']}: title {text!r} overflows its frame")
            for name, shape in nodes:
                if _overlap(box, _bounds(shape)):
                    problems.append(f"cluster {obj['name']}: title {text!r} lies on node {name}")
            for _e, label, lbox in edge_labels:
                if _overlap(box, lbox):
                    problems.append(f"cluster {obj['name']}: title {text!r} lies under edge label {label!r}")
        for _e, label, (a0, b0, a1, b1) in edge_labels:  # a label is inside a cluster's frame or outside, not across
            crossed = [v for v, lo, hi in ((x0, a0, a1), (x1, a0, a1)) if lo + 0.5 < v < hi - 0.5 and
                       b0 < y1 and y0 < b1]
            crossed += [v for v, lo, hi in ((y0, b0, b1), (y1, b0, b1)) if lo + 0.5 < v < hi - 0.5 and
                        a0 < x1 and x0 < a1]
            if crossed:
                problems.append(f"edge label {label!r} lies across the frame of cluster {obj['name']}")
    x0, y0, x1, y1 = (float(v) for v in lay["bb"].split(","))
    for text, box in _texts(lay.get("_ldraw_")):
        if not (x0 - 0.5 <= box[0] and box[2] <= x1 + 0.5):
            problems.append(f"graph title {text!r} is wider than the drawing")
    return problems


def render(graph, path: Path) -> None:
    """Write ``graph`` as a PNG at ``path``, after checking its layout.

    Raises:
        ValueError: the layout has a problem (``layout_problems``): text outside a box, an edge label on a node.
        RuntimeError: Graphviz's ``dot`` is not installed.
    """
    problems = layout_problems(layout(graph))
    if problems:
        raise ValueError(f"{Path(path).name}: " + "; ".join(problems))
    Path(path).write_bytes(_pipe(graph, "png"))


def schedule_flowchart_graph():
    """``Scheduler.schedule()`` as a ``graphviz.Digraph``: the boxes of ``schedule_flowchart_steps`` (each with its
    line in scheduler.py) in the three parts of the method, and the arrows of ``_FLOW_EDGES``."""
    steps = {s.key: s for s in schedule_flowchart_steps()}
    g = _digraph(_("Scheduler.schedule(), one engine step (minivllm/core/sched/scheduler.py; "
                   "vLLM: vllm/v1/core/sched/scheduler.py)"))
    for i, (title, keys) in enumerate(_FLOW_PARTS):
        with g.subgraph(name=f"cluster_{i}") as c:
            c.attr(label=_(title), labeljust="l", fontsize="11", style="rounded,dashed", color="#999999", margin="16",
                   labelloc="b")  # at the bottom: the arrows into a part come in at its top
            for k in keys:
                s = steps.pop(k)
                _node(c, k, f"{s.text}\n[scheduler.py L{s.line}]", s.kind)
    for k, s in steps.items():  # between the parts: the gate
        _node(g, k, f"{s.text}\n[scheduler.py L{s.line}]", s.kind)
    for tail, head, label, attrs in _FLOW_EDGES:
        g.edge(tail, head, label=_(label) if label else "", **attrs)  # _("") is the catalog header
    return g


@register("schedule_flowchart.png")
def schedule_flowchart(path: Path) -> None:
    """Scheduler.schedule() as a flowchart: running loop, allocate or preempt, the gate, waiting loop (prefix
    cache, connector, whole-prompt admission check, resumed or new), output, connector metadata; each box
    labelled with its line in scheduler.py."""
    render(schedule_flowchart_graph(), path)


# ---- the request state machine ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Transition:
    """``source -> target`` made by ``method`` (``"Class.method"`` or ``"function"``; several joined by
    ``" | "``) because ``why``."""

    source: str
    target: str
    method: str
    why: str


# (source, target, where, why): checked against the code by request_state_machine()
_TRANSITIONS = [
    ("WAITING", "RUNNING", "Scheduler._schedule_waiting", N_("admitted")),
    ("PREEMPTED", "RUNNING", "Scheduler._schedule_waiting", N_("resumed")),
    ("WAITING", "WAITING_FOR_REMOTE_KVS", "Scheduler._schedule_waiting", N_("async connector load")),
    ("PREEMPTED", "WAITING_FOR_REMOTE_KVS", "Scheduler._schedule_waiting", N_("async connector load")),
    ("WAITING_FOR_REMOTE_KVS", "WAITING",
     "Scheduler._update_waiting_for_remote_kv | Scheduler._release_blocks_of_waiting_requests",
     N_("load finished, or blocks released")),
    ("WAITING_FOR_REMOTE_KVS", "PREEMPTED",
     "Scheduler._update_waiting_for_remote_kv | Scheduler._release_blocks_of_waiting_requests",
     N_("load finished, or blocks released")),
    ("RUNNING", "PREEMPTED", "Scheduler._preempt_request", N_("blocks needed")),
    ("RUNNING", "FINISHED_STOPPED", "check_stop", N_("EOS / stop token")),
    ("RUNNING", "FINISHED_LENGTH_CAPPED", "check_stop", N_("max_tokens / max_model_len")),
    ("RUNNING", "FINISHED_ABORTED", "Scheduler.finish_requests", N_("abort")),
    ("WAITING", "FINISHED_ABORTED", "Scheduler.finish_requests", N_("abort")),
    ("PREEMPTED", "FINISHED_ABORTED", "Scheduler.finish_requests", N_("abort")),
    ("WAITING_FOR_REMOTE_KVS", "FINISHED_ABORTED", "Scheduler.finish_requests", N_("abort")),
]


def _status_targets(fn: Callable) -> Tuple[set, bool]:
    """The ``RequestStatus`` members assigned to ``*.status`` in ``fn``, and whether a non-literal value (a
    parameter such as ``finished_status``) is assigned too."""
    tree, _offset = _tree(fn)
    targets, dynamic = set(), False
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == "status"
                                                for t in node.targets):
            names = [n.attr for n in ast.walk(node.value)
                     if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "RequestStatus"]
            targets.update(names)
            dynamic = dynamic or not names
    return targets, dynamic


def request_state_machine() -> Tuple[List[str], List[Transition]]:
    """The states (``RequestStatus`` members, in order) and the transitions between them, each checked against
    the method that makes it.

    Raises:
        LookupError: a transition's method does not assign its target, or a method of the scheduler assigns a
        status that no transition explains.
    """
    from minivllm.core.sched import utils as sched_utils
    from minivllm.core.sched.scheduler import Scheduler
    from minivllm.request import Request, RequestStatus

    states = [s.name for s in RequestStatus]
    funcs: Dict[str, Callable] = {"check_stop": sched_utils.check_stop}
    for name, fn in inspect.getmembers(Scheduler, inspect.isfunction):
        funcs[f"Scheduler.{name}"] = fn
    transitions = [Transition(*t) for t in _TRANSITIONS if t[0] in states and t[1] in states]
    explained = set()
    for t in transitions:
        for method in t.method.split(" | "):
            targets, dynamic = _status_targets(funcs[method])
            if t.target not in targets and not (dynamic and RequestStatus.is_finished(RequestStatus[t.target])):
                raise LookupError(f"{method} no longer sets RequestStatus.{t.target}: update _TRANSITIONS")
            explained.add((method, t.target))
    for name, fn in funcs.items():
        for target in _status_targets(fn)[0]:
            if (name, target) not in explained:
                raise LookupError(f"{name} sets RequestStatus.{target}, which no drawn transition explains")
    init = _status_targets(Request.__init__)[0]
    if init != {"WAITING"}:
        raise LookupError(f"Request.__init__ sets {sorted(init)}, the diagram starts requests in WAITING")
    return states, transitions


def request_state_machine_graph():
    """The request state machine as a ``graphviz.Digraph``: ``RequestStatus``'s members and the transitions of
    ``request_state_machine``, each labelled with why and the method that makes it."""
    from minivllm.request import RequestStatus

    states, transitions = request_state_machine()
    used = {t.source for t in transitions} | {t.target for t in transitions}
    aborts = [t for t in transitions if t.target == "FINISHED_ABORTED"]  # dashed, the target's box says why
    g = _digraph(_("Request states (minivllm.request.RequestStatus; vLLM: vllm/v1/request.py) and the\n"
                   "Scheduler method (or check_stop) that moves a request"), rankdir="LR", nodesep="0.5",
                 ranksep="0.9")
    g.node("_start", "", shape="point", width="0.12", color="#333333")
    for s in states:
        finished = RequestStatus.is_finished(RequestStatus[s])
        label = s
        if s not in used:
            label += "\n" + _("(no transition drawn)")
        elif s == "FINISHED_ABORTED" and aborts:
            label += "\n" + _("finish_requests: an abort from\nany unfinished state")
        g.node(s, label, shape="box", style="rounded,filled",
               fillcolor=_FILL["orphan" if s not in used else "final" if finished else "state"])
    g.edge("_start", "WAITING", label="add_request")
    for t in transitions:
        if t in aborts:
            g.edge(t.source, t.target, style="dashed", color="#a05050")
            continue
        methods = "\n".join(m.replace("Scheduler.", "") for m in t.method.split(" | "))
        g.edge(t.source, t.target, label=f"{_(t.why)}\n{methods}")
    return g


@register("request_state_machine.png")
def request_state_machine_figure(path: Path) -> None:
    """The request state machine: RequestStatus's members and the transitions the scheduler makes (with the
    method that makes each)."""
    render(request_state_machine_graph(), path)


# ---- the connector's calls --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConnectorCall:
    """A ``KVConnectorBase`` method, its side (``"scheduler"`` or ``"worker"``) and where the engine calls it
    (``"file:line function"`` strings; empty if the engine never calls it)."""

    method: str
    side: str
    call_sites: Tuple[str, ...]


ENGINE_DIRS = ("core", "engine", "worker")  # the engine's packages that may call a connector


def connector_calls() -> List[ConnectorCall]:
    """``KVConnectorBase``'s public methods by side, in call order, with the engine's call sites.

    The side is the section of ``base.py`` the method is defined in (``# ---- scheduler side`` / ``# ---- worker
    side``). Within a side, methods are ordered by their last call site (a step that schedules nothing returns
    early after an earlier ``get_finished``; the last call is the full step's order).
    """
    from minivllm.distributed.kv_transfer.base import KVConnectorBase

    src_lines, first = inspect.getsourcelines(KVConnectorBase)
    marks = [(first + i, "scheduler" if "scheduler side" in line else "worker")
             for i, line in enumerate(src_lines) if line.strip().startswith("# ----") and " side" in line]
    if [m[1] for m in marks] != ["scheduler", "worker"]:
        raise LookupError("KVConnectorBase: expected a '# ---- scheduler side' then a '# ---- worker side' section")
    methods = []
    for name, fn in KVConnectorBase.__dict__.items():
        if name.startswith("_") or not inspect.isfunction(fn):
            continue
        line = inspect.getsourcelines(fn)[1]
        side = "worker" if line > marks[1][0] else "scheduler"
        methods.append((name, side))
    sites: Dict[str, List[Tuple[str, int, str]]] = {m: [] for m, _ in methods}
    # the place of each call site in a step: its line, behind the lines of the calls that lead to its function
    # from schedule() (Scheduler.schedule is split into methods, issue 26: a call in _schedule_waiting happens
    # where schedule() calls _schedule_waiting, before the build_connector_meta that schedule() calls after it)
    when: Dict[Tuple[str, int], Tuple[int, ...]] = {}
    pkg = ROOT / "minivllm"
    for d in ENGINE_DIRS:
        for f in sorted((pkg / d).rglob("*.py")):
            tree = ast.parse(f.read_text(encoding="utf-8"))
            funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            entry = _entry_lines({fn.name: fn for fn in funcs}, "schedule")
            for func in funcs:
                for call in ast.walk(func):
                    if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                            and call.func.attr in sites):
                        rel = str(f.relative_to(ROOT))
                        sites[call.func.attr].append((rel, call.lineno, func.name))
                        when[(rel, call.lineno)] = entry.get(func.name, ()) + (call.lineno,)
    out, order = [], {}
    for name, side in methods:
        uniq = sorted(set(sites[name]), key=lambda s: (s[0], s[1]))
        out.append(ConnectorCall(name, side, tuple(f"{f}:{ln} {fn}()" for f, ln, fn in uniq)))
        order[name] = max((when[(f, ln)] for f, ln, _ in uniq), default=(10**9,))
    side_rank = {"scheduler": 0, "worker": 1}
    return sorted(out, key=lambda c: (side_rank[c.side], order[c.method]))


def _entry_lines(funcs: Dict[str, ast.AST], root: str) -> Dict[str, Tuple[int, ...]]:
    """For each function reachable from ``root`` through ``self.<method>(...)`` calls among ``funcs`` (one
    file's), the lines of the calls that lead to it from ``root``, first path found (breadth first)."""
    if root not in funcs:
        return {}
    entry: Dict[str, Tuple[int, ...]] = {root: ()}
    todo = [root]
    while todo:
        name = todo.pop(0)
        calls = sorted((c for c in ast.walk(funcs[name]) if isinstance(c, ast.Call)
                        and isinstance(c.func, ast.Attribute) and isinstance(c.func.value, ast.Name)
                        and c.func.value.id == "self" and c.func.attr in funcs), key=lambda c: c.lineno)
        for c in calls:
            callee = c.func.attr  # type: ignore[attr-defined]
            if callee not in entry:
                entry[callee] = entry[name] + (c.lineno,)
                todo.append(callee)
    return entry


def connector_calls_graph():
    """``connector_calls`` as a ``graphviz.Digraph``: the scheduler side and the worker side in call order, each
    method with the engine's call sites, and what passes between the sides."""
    calls = connector_calls()
    g = _digraph(_("KV connector calls per step (minivllm/distributed/kv_transfer/base.py;\n"
                   "vLLM: vllm/distributed/kv_transfer/kv_connector/v1/base.py)"), nodesep="0.6")
    sides = (("scheduler", _("scheduler side (EngineCore process in vLLM)")),
             ("worker", _("worker side (each worker in vLLM)")))
    for side, title in sides:
        group = [c for c in calls if c.side == side]
        with g.subgraph(name=f"cluster_{side}") as c:
            c.attr(label=title, labelloc="b", fontsize="11", style="rounded,dashed", color="#999999")
            for call in group:
                where = "\n".join(call.call_sites) if call.call_sites else _("(not called by the engine)")
                _node(c, call.method, f"{call.method}()\n{where}", "process" if call.call_sites else "orphan")
            if side == "scheduler" and any(x.method == "get_finished" for x in calls):
                _node(c, "_update_from_output", "Scheduler.update_from_output(ModelRunnerOutput)\n" + _(
                      "next step: the waiting loop admits\nrequests whose loads finished"), "io")
                group_names = [x.method for x in group] + ["_update_from_output"]
            else:
                group_names = [x.method for x in group]
            for a, b in zip(group_names, group_names[1:]):
                c.edge(a, b)
    work = [c.method for c in calls if c.side == "worker"]
    green = {"color": "#2f6f3e", "fontcolor": "#2f6f3e"}
    if work and any(c.method == "build_connector_meta" for c in calls):
        g.edge("build_connector_meta", work[0], label="SchedulerOutput.\nkv_connector_metadata", **green)
    if "get_finished" in work:
        g.edge("get_finished", "_update_from_output", label="finished_sending /\nfinished_recving", **green)
    return g


@register("connector_calls.png")
def connector_calls_figure(path: Path) -> None:
    """The KV connector's scheduler-side and worker-side methods (from KVConnectorBase) in call order, with the
    engine's call sites."""
    render(connector_calls_graph(), path)


GRAPHS: Dict[str, Callable[[], Any]] = {
    "schedule_flowchart.png": schedule_flowchart_graph,
    "request_state_machine.png": request_state_machine_graph,
    "connector_calls.png": connector_calls_graph,
}
"""The diagrams' file names in ``images/`` and the functions that build their graphs."""
