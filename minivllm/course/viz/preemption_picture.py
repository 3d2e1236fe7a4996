"""Preemption before and after: the queues and the KV block pool just before a step that preempts, and right after
its ``schedule()``, drawn from a recorded run (``SchedulerTrace``) with matplotlib (notebook 06, issue 26).

"Before step k" is the state the scheduler starts step k from: step k-1's record (taken after its ``schedule()``)
without the requests that finished in step k-1 (their blocks went back to the pool when its output was processed),
and with the requests that arrived between the two steps at the back of the waiting queue. "After" is step k's
record. ``preemption_change`` gives the same comparison as data (who was preempted, which blocks each victim
freed, which blocks each request gained), so that a notebook can print and assert what the picture shows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from minivllm.course.trace import SchedulerTrace, StepRecord
from minivllm.course.viz.colors import FREE_COLOR, owner_colors, text_color
from minivllm.course.viz.fonts import use_language_font
from minivllm.course.viz.frame import RUNNING_TITLE, WAITING_TITLE
from minivllm.i18n import _

_BOX_W, _BOX_H, _GAP = 1.7, 0.95, 0.12
_BLOCK = 0.62
_BLOCKS_PER_ROW = 10
_VICTIM = "#c62828"


@dataclass
class QueueState:
    """The queues and the block pool at one moment.

    Attributes:
        waiting / running: request ids in queue order.
        blocks: request id -> its block ids, in block-table order (requests holding none are absent).
        computed: request id -> ``num_computed_tokens``.
        num_tokens: request id -> ``num_tokens`` (prompt + generated tokens so far).
        num_gpu_blocks: the pool's size.
    """

    waiting: List[str]
    running: List[str]
    blocks: Dict[str, List[int]]
    computed: Dict[str, int]
    num_tokens: Dict[str, int]
    num_gpu_blocks: int

    @property
    def free_blocks(self) -> List[int]:
        held = {b for bs in self.blocks.values() for b in bs}
        return [b for b in range(self.num_gpu_blocks) if b not in held]


@dataclass
class PreemptionChange:
    """What step ``step`` changed (``preemption_change``).

    Attributes:
        step: the step that preempted.
        victims: the requests it preempted.
        freed: victim -> the block ids it gave back.
        gained: request id -> block ids it holds after the step and did not hold before it.
        before / after: the two states.
    """

    step: int
    victims: List[str]
    freed: Dict[str, List[int]]
    gained: Dict[str, List[int]]
    before: QueueState
    after: QueueState


def _state_after(s: StepRecord) -> QueueState:
    return QueueState(list(s.waiting), list(s.running),
                      {rid: list(r.block_ids) for rid, r in s.requests.items() if r.block_ids},
                      {rid: r.num_computed_tokens for rid, r in s.requests.items()},
                      {rid: r.num_tokens for rid, r in s.requests.items()}, s.num_gpu_blocks)


def _state_before(prev: StepRecord, cur: StepRecord) -> QueueState:
    done = set(prev.finished)
    arrived = [rid for rid in cur.requests if rid not in prev.requests]
    waiting = [rid for rid in prev.waiting if rid not in done] + arrived
    running = [rid for rid in prev.running if rid not in done]
    live = set(waiting) | set(running)
    blocks = {rid: list(r.block_ids) for rid, r in prev.requests.items() if rid in live and r.block_ids}
    computed = {rid: r.num_computed_tokens for rid, r in prev.requests.items() if rid in live}
    computed.update({rid: 0 for rid in arrived})
    # num_tokens at the start of step k: step k-1's sampled token is appended by then (step k's snapshot)
    num_tokens = {rid: cur.requests[rid].num_tokens if rid in cur.requests else prev.requests[rid].num_tokens
                  for rid in live}
    return QueueState(waiting, running, blocks, computed, num_tokens, prev.num_gpu_blocks)


def preemption_change(trace: SchedulerTrace, step: Optional[int] = None) -> PreemptionChange:
    """The state before and after the step ``step`` (default: the run's first preemption) and what changed.

    Raises:
        ValueError: the trace has no preemption (``step`` is ``None``), or ``step`` is not a step >= 1 of the trace
            that preempted.
    """
    if step is None:
        pre = trace.preemptions()
        if not pre:
            raise ValueError("the trace has no preemption: record a run whose KV cache is too small for its load")
        step = pre[0][0]
    if not isinstance(step, int) or not 1 <= step < len(trace) or not trace[step].preempted:
        steps = sorted({k for k, _rid in trace.preemptions()})
        raise ValueError(f"step must be a step of the trace that preempted (one of {steps}, and not step 0), "
                         f"got {step!r}")
    before = _state_before(trace[step - 1], trace[step])
    after = _state_after(trace[step])
    victims = list(trace[step].preempted)
    freed = {v: before.blocks.get(v, []) for v in victims}
    gained = {rid: [b for b in bs if b not in before.blocks.get(rid, [])] for rid, bs in after.blocks.items()}
    return PreemptionChange(step, victims, freed, {r: g for r, g in gained.items() if g}, before, after)


def _queue(ax, y: float, title: str, ids: List[str], st: QueueState, colors: Dict[str, str],
           victims: List[str]) -> float:
    ax.text(0, y, title, fontsize=8.5, fontweight="bold", va="bottom")
    y -= 0.1
    if not ids:
        ax.text(0.1, y - 0.35, _("(empty)"), fontsize=8, color="#888", va="center")
    for i, rid in enumerate(ids):
        x = i * (_BOX_W + _GAP)
        c = colors.get(rid, "#777777")
        ec, lw = (_VICTIM, 2.6) if rid in victims else (c, 1.6)
        ax.add_patch(Rectangle((x, y - _BOX_H), _BOX_W, _BOX_H, facecolor="white", edgecolor=ec, linewidth=lw))
        ax.add_patch(Rectangle((x, y - _BOX_H), 0.12, _BOX_H, facecolor=c, edgecolor=c))
        ax.text(x + 0.22, y - 0.1, rid, fontsize=9, fontweight="bold", va="top",
                color=_VICTIM if rid in victims else "black")
        ax.text(x + 0.22, y - 0.42, _("computed {computed}\nof {tokens} tokens\n{blocks} blocks").format(
                computed=st.computed.get(rid, 0), tokens=st.num_tokens.get(rid, 0),
                blocks=len(st.blocks.get(rid, []))), fontsize=6.5, va="top", linespacing=1.15)
    return y - _BOX_H - 0.35


def _pool(ax, y: float, st: QueueState, colors: Dict[str, str], mark: Dict[int, str]) -> float:
    owner = {b: rid for rid, bs in st.blocks.items() for b in bs}
    ax.text(0, y, _("KV block pool: {free} of {total} free").format(free=len(st.free_blocks),
                                                                      total=st.num_gpu_blocks), fontsize=8.5,
            fontweight="bold", va="bottom")
    y -= 0.1
    for b in range(st.num_gpu_blocks):
        x, top = (b % _BLOCKS_PER_ROW) * (_BLOCK + 0.06), y - (b // _BLOCKS_PER_ROW) * (_BLOCK + 0.3)
        rid = owner.get(b)
        fc = colors.get(rid, "#777777") if rid else FREE_COLOR
        ec, lw = ("#c62828", 2.2) if b in mark else ("#555" if rid else "#ccc", 0.7)
        ax.add_patch(Rectangle((x, top - _BLOCK), _BLOCK, _BLOCK, facecolor=fc, edgecolor=ec, linewidth=lw))
        ax.text(x + _BLOCK / 2, top - _BLOCK / 2, f"{rid or ''}\n{b}", ha="center", va="center", fontsize=6.5,
                color=text_color(fc), linespacing=1.0)
        if b in mark:
            ax.text(x + _BLOCK / 2, top - _BLOCK - 0.04, mark[b], ha="center", va="top", fontsize=5.8,
                    color=_VICTIM)
    rows = (st.num_gpu_blocks - 1) // _BLOCKS_PER_ROW + 1
    return y - rows * (_BLOCK + 0.3) - 0.2


def _panel(ax, title: str, st: QueueState, colors: Dict[str, str], victims: List[str],
           mark: Dict[int, str]) -> None:
    ax.text(0, 0, title, fontsize=10.5, fontweight="bold", va="top")
    y = _queue(ax, -0.55, _(WAITING_TITLE), st.waiting, st, colors, victims)
    y = _queue(ax, y, _(RUNNING_TITLE), st.running, st, colors, victims)
    y = _pool(ax, y, st, colors, mark)
    width = max(len(st.waiting), len(st.running), 1) * (_BOX_W + _GAP)
    width = max(width, min(st.num_gpu_blocks, _BLOCKS_PER_ROW) * (_BLOCK + 0.06), 6.0)
    ax.set_xlim(-0.05, width + 0.05)
    ax.set_ylim(y, 0.15)
    ax.set_aspect("equal")
    ax.axis("off")


def plot_preemption(trace: SchedulerTrace, step: Optional[int] = None,
                    colors: Optional[Dict[str, str]] = None) -> Tuple[plt.Figure, PreemptionChange]:
    """Draw the queues and the block pool before step ``step`` (default: the first preemption) and after its
    ``schedule()``, side by side; the victims are outlined in red, on the left the blocks they give back, on the
    right the blocks that changed owner or were freed. Returns ``(figure, preemption_change(trace, step))``.

    Raises ``ValueError`` as ``preemption_change`` does.
    """
    ch = preemption_change(trace, step)
    colors = owner_colors(trace) if colors is None else colors
    use_language_font()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    freed_mark = {b: _("{request} frees").format(request=v) for v, bs in ch.freed.items() for b in bs}
    after_mark = {b: _("now {request}").format(request=rid) for rid, bs in ch.gained.items() for b in bs}
    after_mark.update({b: _("free") for bs in ch.freed.values() for b in bs if b in ch.after.free_blocks})
    _panel(left, _("before step {step}").format(step=ch.step), ch.before, colors, ch.victims, freed_mark)
    _panel(right, _("after step {step}'s schedule(): preempted {victims}").format(
        step=ch.step, victims=", ".join(ch.victims)), ch.after, colors, ch.victims, after_mark)
    fig.tight_layout()
    return fig, ch


__all__ = ["PreemptionChange", "QueueState", "plot_preemption", "preemption_change"]
