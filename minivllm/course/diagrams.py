"""Diagrams of the engine's code, derived from the engine itself: ``schedule()`` as a flowchart, the request state
machine, and the KV connector's calls. Registered with ``python -m minivllm figures``; matplotlib only.

Nothing is drawn from a hand-kept list alone:

* ``schedule_flowchart_steps`` finds each box of the flowchart in ``Scheduler.schedule``'s syntax tree (the two
  loops, ``allocate_slots``, ``_preempt_request``, the ``if not preempted_reqs`` gate, the connector calls, the
  ``SchedulerOutput``) and labels it with its line in ``minivllm/core/sched/scheduler.py``; a box whose code is
  gone raises ``LookupError``.
* ``request_state_machine`` takes the states from ``RequestStatus`` (a new member appears as a new node) and
  checks every transition against the assignments ``*.status = RequestStatus.X`` in the method that makes it; an
  assignment in the scheduler that no transition explains raises ``LookupError``.
* ``connector_calls`` takes the methods from ``KVConnectorBase`` (scheduler side and worker side as its source
  groups them) and finds where the engine calls each one.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Tuple

from minivllm.course.figures import _save, register

ROOT = Path(__file__).resolve().parents[2]


def _tree(fn: Callable) -> Tuple[ast.AST, int]:
    """The syntax tree of ``fn`` and the line offset that makes its line numbers the file's."""
    lines, first = inspect.getsourcelines(fn)
    return ast.parse(textwrap.dedent("".join(lines))), first - 1


def _calls(tree: ast.AST, name: str) -> Iterator[ast.Call]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr == name) or (isinstance(f, ast.Name) and f.id == name):
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


def schedule_flowchart_steps() -> List[FlowStep]:
    """The boxes of the ``schedule()`` flowchart, in order, each located in ``Scheduler.schedule``.

    Raises:
        LookupError: when a box's code is not found (the scheduler changed: update the flowchart).
    """
    from minivllm.core.sched.scheduler import Scheduler

    tree, off = _tree(Scheduler.schedule)
    whiles = [n for n in ast.walk(tree) if isinstance(n, ast.While)]

    def loop_over(attr: str) -> ast.While:
        for w in whiles:
            if any(isinstance(n, ast.Attribute) and n.attr == attr for n in ast.walk(w.test)):
                return w
        raise LookupError(f"Scheduler.schedule: no `while` loop over self.{attr}")

    def first_call(node: ast.AST, name: str) -> ast.Call:
        found = sorted(_calls(node, name), key=lambda c: c.lineno)
        if not found:
            raise LookupError(f"Scheduler.schedule: no call of {name}() where the flowchart expects one")
        return found[0]

    running, waiting = loop_over("running"), loop_over("waiting")
    gate = next((n for n in ast.walk(tree) if isinstance(n, ast.If) and isinstance(n.test, ast.UnaryOp)
                 and isinstance(n.test.op, ast.Not) and isinstance(n.test.operand, ast.Name)
                 and n.test.operand.id == "preempted_reqs"), None)
    if gate is None:
        raise LookupError("Scheduler.schedule: no `if not preempted_reqs:` gate before the waiting loop")
    output = first_call(tree, "SchedulerOutput")
    steps = [
        FlowStep("running", "running loop: each running request in order\n"
                 "n = min(tokens left, long_prefill_token_threshold, budget)", running.lineno + off),
        FlowStep("allocate", "kv_cache_manager.allocate_slots(request, n)\nblocks free?",
                 first_call(running, "allocate_slots").lineno + off, "decision"),
        FlowStep("preempt", "_pick_victim() → _preempt_request(victim)\n"
                 "blocks freed, num_computed_tokens = 0, back to waiting;\npreempted_reqs.append(victim); retry",
                 first_call(running, "_preempt_request").lineno + off),
        FlowStep("scheduled", "schedule n tokens, budget -= n", first_call(running, "append").lineno + off),
        FlowStep("gate", "if not preempted_reqs:\nanyone preempted in this step?", gate.lineno + off, "decision"),
        FlowStep("waiting", "waiting loop: queue head, while budget and max_num_seqs allow\n"
                 "get_computed_blocks (prefix cache)", waiting.lineno + off),
        FlowStep("match", "connector.get_num_new_matched_tokens(request, n_local)",
                 first_call(waiting, "get_num_new_matched_tokens").lineno + off),
        FlowStep("admit", "allocate_slots(request, n, ...)\nblocks free?",
                 first_call(waiting, "allocate_slots").lineno + off, "decision"),
        FlowStep("after_alloc", "connector.update_state_after_alloc(request, blocks, n_ext)\n"
                 "pop from waiting, append to running", first_call(waiting, "update_state_after_alloc").lineno + off),
        FlowStep("output", "SchedulerOutput(new, cached, num_scheduled_tokens,\npreempted_req_ids, finished_req_ids)",
                 output.lineno + off, "io"),
        FlowStep("meta", "connector.build_connector_meta(output)\nonce per call, even with nothing scheduled",
                 first_call(tree, "build_connector_meta").lineno + off, "io"),
        FlowStep("advance", "_update_after_schedule(output)\nnum_computed_tokens += scheduled",
                 first_call(tree, "_update_after_schedule").lineno + off),
    ]
    lines = [s.line for s in steps]
    gate_line = next(s.line for s in steps if s.key == "gate")
    if not all(s.line < gate_line for s in steps[:4]) or not all(s.line > gate_line for s in steps[5:]):
        raise LookupError("Scheduler.schedule: the running loop no longer comes before the gate and the waiting loop")
    assert len(set(lines)) == len(lines), lines
    return steps


def _box(ax, x, y, text, kind, w=4.6, h=0.9, fc=None):
    from matplotlib.patches import FancyBboxPatch, Polygon

    colours = {"process": "#e8eef7", "decision": "#fff1d6", "io": "#e6f4ea", "state": "#e8eef7",
               "final": "#f3e3e3", "orphan": "#eeeeee"}
    fc = fc or colours[kind]
    if kind == "decision":
        ax.add_patch(Polygon([(x - w / 2, y), (x, y + h / 2 + 0.15), (x + w / 2, y), (x, y - h / 2 - 0.15)],
                             closed=True, fc=fc, ec="#555555", lw=1.2))
    else:
        ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02,rounding_size=0.15",
                                    fc=fc, ec="#555555", lw=1.2))
    ax.text(x, y, text, ha="center", va="center", fontsize=8.2, family="DejaVu Sans")


def _arrow(ax, p, q, label="", rad=0.0, color="#333333", label_pos=0.5, offset=(0.08, 0.0)):
    from matplotlib.patches import FancyArrowPatch

    ax.add_patch(FancyArrowPatch(p, q, arrowstyle="-|>", mutation_scale=12, lw=1.1, color=color,
                                 connectionstyle=f"arc3,rad={rad}", shrinkA=2, shrinkB=2))
    if label:
        x = p[0] + (q[0] - p[0]) * label_pos + offset[0]
        y = p[1] + (q[1] - p[1]) * label_pos + offset[1]
        ax.text(x, y, label, fontsize=7.5, color=color, ha="left", va="center",
                bbox=dict(fc="white", ec="none", pad=0.5))


@register("schedule_flowchart.png")
def schedule_flowchart(path: Path) -> None:
    """Scheduler.schedule() as a flowchart: running loop, allocate or preempt, the gate, waiting loop, output,
    connector metadata; each box labelled with its line in scheduler.py."""
    import matplotlib.pyplot as plt

    steps = {s.key: s for s in schedule_flowchart_steps()}
    L, M, R = 3.0, 7.9, 12.6  # columns: running loop, preemption and output, waiting loop
    P = {
        "running": (L, 11), "allocate": (L, 9.2), "preempt": (M, 9.2), "scheduled": (L, 7.4), "gate": (L, 5.4),
        "waiting": (R, 7.9), "match": (R, 6.5), "admit": (R, 4.9), "after_alloc": (R, 3.3),
        "output": (M, 1.9), "meta": (M, 0.6), "advance": (M, -0.7),
    }
    fig, ax = plt.subplots(figsize=(14, 10.5))
    ax.set_xlim(0, 15.6)
    ax.set_ylim(-1.4, 11.8)
    ax.axis("off")
    W, HB, HD = 4.6, 1.0, 1.2  # box width, box height, diamond height
    for key, s in steps.items():
        _box(ax, *P[key], f"{s.text}\n[scheduler.py L{s.line}]", s.kind, w=W + (0.6 if s.kind == "decision" else 0),
             h=HD if s.kind == "decision" else HB)

    def top(k, d=0.0):
        return (P[k][0] + d, P[k][1] + (HD / 2 + 0.15 if steps[k].kind == "decision" else HB / 2))

    def bottom(k, d=0.0):
        return (P[k][0] + d, P[k][1] - (HD / 2 + 0.15 if steps[k].kind == "decision" else HB / 2))

    def left(k, dy=0.0):
        return (P[k][0] - (W + 0.6) / 2 if steps[k].kind == "decision" else P[k][0] - W / 2, P[k][1] + dy)

    def right(k, dy=0.0):
        return (P[k][0] + (W + 0.6) / 2 if steps[k].kind == "decision" else P[k][0] + W / 2, P[k][1] + dy)

    _arrow(ax, bottom("running"), top("allocate"))
    _arrow(ax, right("allocate"), left("preempt"), "no", label_pos=0.4, offset=(0, 0.15))
    _arrow(ax, top("preempt"), (P["allocate"][0] + 1.2, P["allocate"][1] + 0.55),
           "retry, until it fits or the\nrequest preempted itself", rad=0.45, label_pos=0.5, offset=(-0.2, 0.45))
    _arrow(ax, bottom("allocate"), top("scheduled"), "yes")
    _arrow(ax, left("scheduled"), left("running"), "next running\nrequest", rad=-0.35, label_pos=0.5,
           offset=(-0.75, 0))
    _arrow(ax, bottom("scheduled"), top("gate"), "no running request left, or budget spent")
    _arrow(ax, bottom("preempt"), (P["scheduled"][0] + 2.3, P["scheduled"][1] + 0.2),
           "the request preempted itself:\nstop the running loop", label_pos=0.45, offset=(0.1, 0))
    _arrow(ax, right("gate"), left("waiting"), "nobody preempted", label_pos=0.55, offset=(-0.6, 0.35))
    _arrow(ax, bottom("gate"), (P["output"][0] - 2.3, P["output"][1] + 0.2),
           "a preemption in this step:\nno admissions", label_pos=0.45, offset=(-2.3, 0))
    _arrow(ax, bottom("waiting"), top("match"), "num_computed_tokens == 0", offset=(0.1, 0))
    _arrow(ax, bottom("match"), top("admit"))
    _arrow(ax, bottom("admit"), top("after_alloc"), "yes")
    _arrow(ax, right("after_alloc"), right("waiting"), "next waiting\nrequest", rad=0.4, offset=(0.3, 0))
    _arrow(ax, left("admit"), top("output", 0.8), "no: stop (waiting requests never\npreempt; nothing overtakes)",
           label_pos=0.35, offset=(-2.2, 0.1))
    _arrow(ax, bottom("after_alloc"), right("output"), "queue empty, budget or\nmax_num_seqs spent", label_pos=0.45,
           offset=(0.1, 0.1))
    _arrow(ax, bottom("output"), top("meta"))
    _arrow(ax, bottom("meta"), top("advance"))
    ax.set_title("Scheduler.schedule(), one engine step (minivllm/core/sched/scheduler.py; vLLM: "
                 "vllm/v1/core/sched/scheduler.py)", fontsize=10)
    _save(fig, path)


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
    ("WAITING", "RUNNING", "Scheduler.schedule", "admitted"),
    ("PREEMPTED", "RUNNING", "Scheduler.schedule", "resumed"),
    ("WAITING", "WAITING_FOR_REMOTE_KVS", "Scheduler.schedule", "async connector load"),
    ("PREEMPTED", "WAITING_FOR_REMOTE_KVS", "Scheduler.schedule", "async connector load"),
    ("WAITING_FOR_REMOTE_KVS", "WAITING",
     "Scheduler._update_waiting_for_remote_kv | Scheduler._release_blocks_of_waiting_requests",
     "load finished, or blocks released"),
    ("WAITING_FOR_REMOTE_KVS", "PREEMPTED",
     "Scheduler._update_waiting_for_remote_kv | Scheduler._release_blocks_of_waiting_requests",
     "load finished, or blocks released"),
    ("RUNNING", "PREEMPTED", "Scheduler._preempt_request", "blocks needed"),
    ("RUNNING", "FINISHED_STOPPED", "check_stop", "EOS / stop token"),
    ("RUNNING", "FINISHED_LENGTH_CAPPED", "check_stop", "max_tokens / max_model_len"),
    ("RUNNING", "FINISHED_ABORTED", "Scheduler.finish_requests", "abort"),
    ("WAITING", "FINISHED_ABORTED", "Scheduler.finish_requests", "abort"),
    ("PREEMPTED", "FINISHED_ABORTED", "Scheduler.finish_requests", "abort"),
    ("WAITING_FOR_REMOTE_KVS", "FINISHED_ABORTED", "Scheduler.finish_requests", "abort"),
]


def _status_targets(fn: Callable) -> Tuple[set, bool]:
    """The ``RequestStatus`` members assigned to ``*.status`` in ``fn``, and whether a non-literal value (a
    parameter such as ``finished_status``) is assigned too."""
    tree, _ = _tree(fn)
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


@register("request_state_machine.png")
def request_state_machine_figure(path: Path) -> None:
    """The request state machine: RequestStatus's members and the transitions the scheduler makes (with the
    method that makes each)."""
    import matplotlib.pyplot as plt

    from minivllm.request import RequestStatus

    states, transitions = request_state_machine()
    fixed = {"WAITING": (2.3, 6), "RUNNING": (8.6, 6), "PREEMPTED": (8.6, 2.2), "WAITING_FOR_REMOTE_KVS": (2.3, 2.2),
             "FINISHED_STOPPED": (14.6, 8), "FINISHED_LENGTH_CAPPED": (14.6, 6), "FINISHED_ABORTED": (14.6, 4)}
    pos = {}
    extra = 0
    for s in states:  # a state the layout does not know yet still appears, in a row of its own
        pos[s] = fixed.get(s, (2.3 + 4.5 * extra, 0.2))
        extra += s not in fixed
    fig, ax = plt.subplots(figsize=(15, 8))
    ax.set_xlim(0, 16.6)
    ax.set_ylim(-0.6 if extra else 1.0, 9.3)
    ax.axis("off")
    used = {t.source for t in transitions} | {t.target for t in transitions}
    for s in states:
        kind = "final" if RequestStatus.is_finished(RequestStatus[s]) else "state"
        if s not in used:
            kind = "orphan"
        _box(ax, *pos[s], s + ("\n(no transition drawn)" if s not in used else ""), kind, w=3.6, h=0.8)
    _arrow(ax, (pos["WAITING"][0], 8.4), (pos["WAITING"][0], pos["WAITING"][1] + 0.45), "add_request")
    aborts = [t for t in transitions if t.target == "FINISHED_ABORTED" and t.source != "RUNNING"]
    for t in transitions:
        if t in aborts:
            continue
        (x0, y0), (x1, y1) = pos[t.source], pos[t.target]
        dx, dy = x1 - x0, y1 - y0
        n = max(abs(dx) / 1.85, abs(dy) / 0.45, 1e-9)
        # the two directions of a pair side by side
        sx = (0.35 if dy > 0 else -0.35) if dx == 0 else 0.0
        sy = (0.15 if dx > 0 else -0.15) if dy == 0 and any(
            (u.source, u.target) == (t.target, t.source) for u in transitions) else 0.0
        p = (x0 + dx / n + sx, y0 + dy / n + sy)
        q = (x1 - dx / n + sx, y1 - dy / n + sy)
        if dx == 0:
            offset = (0.15, 0.0) if dy > 0 else (-1.9, 0.0)
        elif dy == 0:
            offset = (-0.8, 0.4) if dx > 0 else (-0.8, -0.45)
        else:
            offset = (-1.2, 0.3) if dy > 0 else (0.1, 0.3)
        methods = "\n".join(m.replace("Scheduler.", "") for m in t.method.split(" | "))
        _arrow(ax, p, q, f"{t.why}\n{methods}", label_pos=0.5, offset=offset)
    if aborts:
        ax.text(14.6, 3.0, "abort from any unfinished state\n(" + ", ".join(t.source for t in aborts) +
                "):\nfinish_requests", ha="center", va="top", fontsize=7.5, color="#a05050")
    ax.set_title("Request states (minivllm.request.RequestStatus; vLLM: vllm/v1/request.py) and the Scheduler "
                 "method (or check_stop) that moves a request", fontsize=10)
    _save(fig, path)


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
    pkg = ROOT / "minivllm"
    for d in ENGINE_DIRS:
        for f in sorted((pkg / d).rglob("*.py")):
            tree = ast.parse(f.read_text(encoding="utf-8"))
            for func in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
                for call in ast.walk(func):
                    if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                            and call.func.attr in sites):
                        sites[call.func.attr].append((str(f.relative_to(ROOT)), call.lineno, func.name))
    out = []
    for name, side in methods:
        uniq = sorted(set(sites[name]), key=lambda s: (s[0], s[1]))
        out.append(ConnectorCall(name, side, tuple(f"{f}:{ln} {fn}()" for f, ln, fn in uniq)))
    order = {c.method: (max((int(s.split(":")[1].split()[0]) for s in c.call_sites), default=10**9))
             for c in out}
    side_rank = {"scheduler": 0, "worker": 1}
    return sorted(out, key=lambda c: (side_rank[c.side], order[c.method]))


@register("connector_calls.png")
def connector_calls_figure(path: Path) -> None:
    """The KV connector's scheduler-side and worker-side methods (from KVConnectorBase) in call order, with the
    engine's call sites."""
    import matplotlib.pyplot as plt

    calls = connector_calls()
    sched = [c for c in calls if c.side == "scheduler"]
    work = [c for c in calls if c.side == "worker"]
    rows = max(len(sched) + 1, len(work))
    gap = 1.35  # vertical distance between boxes
    fig, ax = plt.subplots(figsize=(13, 1.3 * rows + 1.8))
    ax.set_xlim(0, 13)
    ax.set_ylim(-0.2, gap * rows + 0.9)
    ax.axis("off")
    ax.text(3.1, gap * rows + 0.45, "scheduler side (EngineCore process in vLLM)", ha="center", fontsize=10, weight="bold")
    ax.text(9.9, gap * rows + 0.45, "worker side (each worker in vLLM)", ha="center", fontsize=10, weight="bold")
    ypos: Dict[str, float] = {}
    for col, group in ((3.1, sched), (9.9, work)):
        for i, c in enumerate(group):
            y = gap * (rows - i) - 0.6
            ypos[c.method] = y
            where = "\n".join(c.call_sites) if c.call_sites else "(not called by the engine)"
            _box(ax, col, y, f"{c.method}()\n{where}", "process" if c.call_sites else "orphan", w=5.8, h=0.95)
            if i:
                _arrow(ax, (col, y + gap - 0.48), (col, y + 0.48))
    if "build_connector_meta" in ypos and work:
        _arrow(ax, (6.0, ypos["build_connector_meta"]), (7.0, ypos[work[0].method]),
               "SchedulerOutput.\nkv_connector_metadata", label_pos=0.5, offset=(-0.55, 0.35), color="#2f6f3e")
    if "get_finished" in ypos and sched:
        y = gap * (rows - len(sched)) - 0.6
        _box(ax, 3.1, y, "Scheduler.update_from_output(ModelRunnerOutput)\n(next step: the waiting loop admits "
             "requests whose loads finished)", "io", w=5.8, h=0.95)
        _arrow(ax, (7.0, ypos["get_finished"]), (6.0, y), "finished_sending /\nfinished_recving",
               label_pos=0.5, offset=(-0.5, 0.3), color="#2f6f3e")
    ax.set_title("KV connector calls per step (minivllm/distributed/kv_transfer/base.py; vLLM: "
                 "vllm/distributed/kv_transfer/kv_connector/v1/base.py)", fontsize=10)
    _save(fig, path)

