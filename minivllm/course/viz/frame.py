"""One step of a recorded run as self-contained HTML: the frame the queue animator shows.

A frame draws one ``StepRecord`` (see ``minivllm/course/trace.py``): the waiting queue (front first) and the
running queue (admission order), one box per request with its id and token counters; the tokens each scheduled
request computes in this step, a prefill chunk drawn striped and a decode token drawn solid; how much of the
token budget (``max_num_batched_tokens``) the step used; the requests admitted, resumed, preempted and finished
in this step; and the KV block pool, each block coloured by the request(s) that hold it. By default a frame also
says why (``minivllm.course.viz.explain``: who was admitted, why the waiting queue's head was not, who was preempted
and why that victim, why the waiting loop did not run), names the steps of the next preemption, admission and
finish, and marks what changed since the step before (a request that changed queue: an amber outline and
``data-changed``; a block taken or freed: an amber or red outline and ``data-change``). Given ``selected``, it
draws that request's block table (logical block -> physical block, tokens written in each, blocks new in this
step marked).

The layout lives in one small style sheet (``FRAME_CSS``, class names prefixed ``mv-``); only the colours of a
request are inline. ``render_frame_html`` puts the style sheet in front of the frame by default, so a frame renders
the same in JupyterLab, in a notebook exported to HTML without a kernel, and in a plain browser; the animator
includes it once for all its frames. Every element a test or a reader may look for carries a ``data-*``
attribute (``data-queue``, ``data-request-id``, ``data-kind``, ``data-tokens``, ``data-block``, ``data-owner``, ``data-reason``,
``data-cause``, ``data-next``, ``data-changed``, ``data-change``, ``data-logical``).
"""

from __future__ import annotations

from html import escape
from typing import Dict, List, Optional

from minivllm.course.trace import SchedulerTrace, StepRecord
from minivllm.i18n import N_, _
from minivllm.course.viz.colors import owner_colors, text_color
from minivllm.course.viz.explain import EVENT_KINDS, StepChanges, explain_step, next_event, step_changes

FRAME_CSS = """
.mv-frame {font-family: -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; font-size: 13px; line-height: 1.35;
  color: #222; padding: 4px}
.mv-frame .mv-title {font-size: 15px}
.mv-frame .mv-dim {color: #666; font-weight: 400}
.mv-badge {display: inline-block; margin-left: 4px; padding: 0 5px; border-radius: 8px; font-size: 11px; color: #fff}
.mv-new {background: #2e7d32} .mv-resumed {background: #1565c0} .mv-preempted {background: #c62828}
.mv-finished {background: #424242}
.mv-req {display: inline-block; vertical-align: top; margin: 3px; padding: 4px 6px; min-width: 150px;
  border: 2px solid #777; border-left-width: 10px; border-radius: 4px; background: #fff}
.mv-req .mv-id {font-size: 14px; font-weight: 700}
.mv-counts {font-size: 11px; color: #333}
.mv-chunk {margin-top: 3px; padding: 1px 4px; border: 1px solid #777}
.mv-prefill span {background: #fff; padding: 0 3px}
.mv-idle {border-style: dashed; border-color: #999; color: #666}
.mv-queue {margin: 4px 0; padding: 3px; background: #fafafa; border: 1px solid #ddd; border-radius: 4px}
.mv-queue .mv-qtitle {font-weight: 600; margin-left: 3px}
.mv-empty {color: #888; margin: 3px}
.mv-budget, .mv-events, .mv-blocks {margin: 4px 0}
.mv-bar {display: flex; width: 100%; max-width: 600px; border: 1px solid #999; background: #fff}
.mv-seg {min-width: 2px; height: 16px; border-right: 1px solid #fff; box-sizing: border-box}
.mv-ev-preempted {color: #c62828}
.mv-pool {max-width: 900px}
.mv-block {display: inline-block; width: 26px; height: 20px; margin: 1px; text-align: center; font-size: 10px;
  line-height: 20px; box-sizing: border-box; border: 1px solid #555}
.mv-free {background: #eeeeee; border-color: #ccc; color: #999}
.mv-cached {background: #ffffff; border-style: dashed; color: #555}
.mv-why {margin: 4px 0; padding: 3px 6px; background: #fffbe6; border: 1px solid #e6d8a0; border-radius: 4px}
.mv-why ul {margin: 2px 0; padding-left: 18px}
.mv-why li[data-cause="unexplained"], .mv-why li[data-cause="not_last"], .mv-why li[data-cause="not_worst"],
.mv-why li[data-cause="open_despite_preemption"] {color: #c62828}
.mv-next {font-size: 12px; color: #444}
.mv-req[data-changed] {box-shadow: 0 0 0 3px #ffb300}
.mv-block[data-change="taken"] {box-shadow: inset 0 0 0 3px #ffb300}
.mv-block[data-change="freed"] {box-shadow: inset 0 0 0 3px #c62828}
.mv-table {margin: 4px 0}
.mv-table table {border-collapse: collapse; font-size: 12px}
.mv-table td, .mv-table th {border: 1px solid #bbb; padding: 1px 6px; text-align: center}
.mv-table td[data-new="1"] {box-shadow: inset 0 0 0 3px #ffb300}
"""
"""The frame's style sheet (layout only; each request's colour is set inline)."""

FRAME_CSS_SLIDES = """
.reveal .mv-frame {font-size: 20px; line-height: 1.25; padding: 4px}
.reveal .mv-frame .mv-title {font-size: 24px}
.reveal .mv-badge {font-size: 16px; padding: 0 7px; border-radius: 10px}
.reveal .mv-req {min-width: 180px; margin: 3px; padding: 3px 8px; border-width: 3px; border-left-width: 14px}
.reveal .mv-req .mv-id {font-size: 22px}
.reveal .mv-counts {font-size: 16px}
.reveal .mv-chunk {font-size: 16px; margin-top: 2px; padding: 1px 5px}
.reveal .mv-queue {margin: 4px 0; padding: 3px}
.reveal .mv-budget, .reveal .mv-events, .reveal .mv-blocks {margin: 3px 0}
.reveal .mv-bar {max-width: 100%; border-width: 2px}
.reveal .mv-seg {height: 24px; min-width: 4px}
.reveal .mv-pool {max-width: 100%}
.reveal .mv-block {width: 40px; height: 30px; line-height: 30px; font-size: 16px; margin: 2px}
.reveal .mv-why {font-size: 16px; line-height: 1.15; padding: 1px 6px; margin: 2px 0}
.reveal .mv-why > b {display: none}
.reveal .mv-why ul {margin: 0; padding-left: 0; list-style: none}
.reveal .mv-why li {display: inline}
.reveal .mv-why li + li:before {content: " \\00b7  "}
.reveal .mv-next, .reveal .mv-table, .reveal .mv-controls, .reveal .mv-legend-changes {display: none}
.reveal .widget-play button {width: 60px; height: 44px; font-size: 22px}
.reveal .widget-slider, .reveal .widget-hslider {width: 900px !important; height: 44px; font-size: 20px}
.reveal .widget-slider .widget-label, .reveal .widget-readout {font-size: 20px; width: auto; min-width: 60px}
"""
"""The slides layout of a frame and of the animator's controls: the style sheet the exported decks add
(``minivllm.course.slides.export``), scoped to reveal.js's ``.reveal`` so that it only applies there. A frame at
``FRAME_CSS``'s 13 px is unreadable from the back of a room at a projector's 1280x800; here the text is 16-24 px,
a KV block 40x30 px, the budget bar 24 px high and the step slider 900 px wide (checked at 1280x800 by
``tests/course/test_slides_browser.py``). The "why" sentences run on as one 16 px paragraph, and the next-event
line, the block table, the legend of the change outlines and the animator's buttons and menu are left out: slides
have no kernel to run the buttons, and with all of it 04's first frame would not fit the 800-pixel screen (about
940 px high; about 710 px as here, of the 740 px the test allows, measured on 04's deck in Chromium at
1280x800)."""


WAITING_TITLE = N_("waiting queue (front first)")
RUNNING_TITLE = N_("running queue (admission order)")
NEXT_LABELS = {"preemption": N_("next preemption"), "admission": N_("next admission"), "finish": N_("next finish")}
"""The labels of the next events (also the animator's jump buttons), English; shown through ``_``."""


def _stripes(color: str) -> str:
    """CSS background of a prefill chunk: diagonal stripes of the owner's colour on white."""
    return f"repeating-linear-gradient(45deg, {color} 0 6px, #ffffff 6px 10px)"


def _attr(value: object) -> str:
    return escape(str(value), quote=True)


def _badge(text: str, cls: str) -> str:
    return f'<span class="mv-badge {cls}">{escape(text)}</span>'


def _request_box(s: StepRecord, rid: str, queue: str, color: str, changes: Optional[StepChanges] = None) -> str:
    snap = s.requests.get(rid)
    n = s.num_scheduled_tokens.get(rid, 0)
    kind = s.kinds.get(rid, "none") if n else "none"
    badges = []
    if rid in s.new:
        badges.append(_badge(_("new"), "mv-new"))
    if rid in s.resumed:
        badges.append(_badge(_("resumed"), "mv-resumed"))
    if rid in s.preempted:
        badges.append(_badge(_("preempted"), "mv-preempted"))
    if rid in s.finished:
        badges.append(_badge(_("finished ({reason})").format(reason=s.finished[rid]), "mv-finished"))
    if snap is not None:
        before = s.num_computed_before.get(rid, snap.num_computed_tokens)
        computed = (
            _("computed {before}&rarr;{after}").format(before=before, after=snap.num_computed_tokens) if n
            else _("computed {n}").format(n=snap.num_computed_tokens)
        )
        counts = _("prompt {prompt} &middot; {computed} &middot; output {output}").format(
            prompt=snap.num_prompt_tokens, computed=computed, output=snap.num_output_tokens)
        if snap.num_preemptions:
            counts += _(" &middot; preempted &times;{n}").format(n=snap.num_preemptions)
        if snap.priority:  # only the priority policy sets it; 0 is the default for everyone
            counts += _(" &middot; priority {priority}").format(priority=snap.priority)
    else:
        counts = ""
    if kind == "prefill":
        label = _("prefill chunk +{n}").format(n=n)
        if snap is not None and snap.num_preemptions and snap.num_output_tokens:
            label = _("prefill (recompute) +{n}").format(n=n)
        samples = snap is not None and snap.num_computed_tokens >= snap.num_tokens
        label += _(" &rarr; samples a token") if samples else _(" &middot; no token (partial prompt)")
        chunk = (
            f'<div class="mv-chunk mv-prefill" data-kind="prefill" data-tokens="{n}" '
            f'style="border-color:{color}; background:{_stripes(color)}"><span>{label}</span></div>'
        )
    elif kind == "decode":
        chunk = (
            f'<div class="mv-chunk mv-decode" data-kind="decode" data-tokens="{n}" '
            f'style="border-color:{color}; background:{color}; color:{text_color(color)}">'
            + _("decode +{n} &rarr; samples a token").format(n=n) + "</div>"
        )
    elif queue == "running":
        chunk = ('<div class="mv-chunk mv-idle" data-kind="none" data-tokens="0">'
                 + _("no tokens this step (budget spent)") + "</div>")
    else:
        chunk = ""
    changed = ""
    if changes is not None and rid in changes.moved:
        a, b = changes.moved[rid]
        moved = _("{rid}: {before} &rarr; {after} since the step before").format(
            rid=_attr(rid), before=a or _("not in the engine"), after=b)
        changed = f' data-changed="{a or "absent"}-{b}" title="{moved}"'
    return (
        f'<div class="mv-req" data-request-id="{_attr(rid)}" data-queue="{queue}" data-kind="{kind}" '
        f'data-tokens="{n}"{changed} style="border-color:{color}"><div><span class="mv-id">{escape(rid)}</span>'
        f'{"".join(badges)}</div><div class="mv-counts">{counts}</div>{chunk}</div>'
    )


def _queue(s: StepRecord, queue: str, ids: List[str], colors: Dict[str, str], title: str,
           changes: Optional[StepChanges] = None) -> str:
    boxes = "".join(_request_box(s, rid, queue, colors.get(rid, "#777777"), changes) for rid in ids)
    if not boxes:
        boxes = '<span class="mv-empty">' + _("(empty)") + "</span>"
    return (
        f'<div class="mv-queue" data-queue="{queue}"><div class="mv-qtitle">{title} '
        f'<span class="mv-dim">({len(ids)})</span></div>{boxes}</div>'
    )


def _budget(s: StepRecord, colors: Dict[str, str]) -> str:
    budget = max(s.token_budget, 1)
    used = s.total_scheduled
    segments = []
    colon = _(": ")
    for rid, n in s.num_scheduled_tokens.items():
        color = colors.get(rid, "#777777")
        background = _stripes(color) if s.kinds[rid] == "prefill" else color
        segments.append(
            f'<div class="mv-seg" data-request-id="{_attr(rid)}" data-kind="{s.kinds[rid]}" data-tokens="{n}" '
            f'title="{_attr(rid)}{colon}{_(KIND_LABELS[s.kinds[rid]])} {n}" style="flex:0 0 {100 * n / budget:.3f}%; '
            f'background:{background}"></div>'
        )
    seqs = (_(" &middot; running {running} / max_num_seqs {max_num_seqs}").format(
        running=len(s.running), max_num_seqs=s.max_num_seqs) if s.max_num_seqs else "")
    used_text = _("token budget: <b>{used}</b> / {budget} tokens used").format(used=used, budget=s.token_budget)
    return (
        f'<div class="mv-budget" data-used="{used}" data-budget="{s.token_budget}">'
        f"<div>{used_text}{seqs}</div>"
        f'<div class="mv-bar">{"".join(segments)}</div></div>'
    )


def _events(s: StepRecord) -> str:
    def ids(xs) -> str:
        return " ".join(escape(x) for x in xs) or "&ndash;"

    finished = " ".join(f"{escape(r)} ({escape(str(why))})" for r, why in s.finished.items()) or "&ndash;"
    # "{label}:" is a msgid of its own: Chinese puts a full-width colon after the label.
    labels = (_("new"), _("resumed"), _("preempted"), _("finished"))
    new, resumed, preempted, done = (_("{label}:").format(label=x) for x in labels)
    return (
        f'<div class="mv-events">{new} <span data-event="new">{ids(s.new)}</span> &middot; '
        f'{resumed} <span data-event="resumed">{ids(s.resumed)}</span> &middot; '
        f'{preempted} <span data-event="preempted" class="mv-ev-preempted">{ids(s.preempted)}</span> &middot; '
        f'{done} <span data-event="finished">{finished}</span></div>'
    )


_CHANGES_LEGEND = N_("; amber outline = taken, red = freed since the step before")
KIND_LABELS = {"prefill": N_("prefill"), "decode": N_("decode")}
"""A step's kind for a request (``StepRecord.kinds``) as the frames write it: ``_(KIND_LABELS[kind])``."""


def _blocks(s: StepRecord, colors: Dict[str, str], max_blocks: int, changes: Optional[StepChanges] = None) -> str:
    cached = set(s.cached_free_blocks)
    taken = set(changes.blocks_taken) if changes else set()
    freed = set(changes.blocks_freed) if changes else set()
    cells = []
    for b, owners in enumerate(s.block_owners[:max_blocks]):
        change = ' data-change="taken"' if b in taken else ' data-change="freed"' if b in freed else ""
        head = f'<span class="mv-block{{}}" data-block="{b}" data-owner="{_attr(" ".join(owners))}" ' \
               f'data-cached="{int(b in cached)}"{change}'
        if owners:
            cs = [colors.get(o, "#777777") for o in owners]
            if len(cs) == 1:
                background = cs[0]
            else:  # a prefix-cache hit: one block, several owners, one band of colour each
                stops = ", ".join(f"{c} {100 * i / len(cs):.0f}% {100 * (i + 1) / len(cs):.0f}%" for i, c in enumerate(cs))
                background = f"linear-gradient(90deg, {stops})"
            held_by = _("block {block}: held by {owners}").format(block=b, owners=_attr(", ".join(owners)))
            cells.append(head.format("") + f' title="{held_by}" '
                         f'style="background:{background}; color:{text_color(cs[0])}">{b}</span>')
        elif b in cached:
            cached_text = _("block {block}: free, still a cached prefix").format(block=b)
            cells.append(head.format(" mv-cached") + f' title="{cached_text}">{b}</span>')
        else:
            cells.append(head.format(" mv-free") + f">{b}</span>")
    more = len(s.block_owners) - max_blocks
    tail = ""
    if more > 0:
        held = sum(1 for owners in s.block_owners[max_blocks:] if owners)
        tail = '<span class="mv-dim"> &hellip; ' + _("{more} more blocks not drawn ({held} of them held)").format(
            more=more, held=held) + "</span>"
    legend = '<span class="mv-legend-changes">' + _(_CHANGES_LEGEND) + "</span>" if changes else ""
    key = _("colour = owner; grey = free; dashed = free but still a cached prefix")
    pool = _("KV block pool: <b>{free}</b> of {total} blocks free").format(free=s.num_free_blocks,
                                                                            total=s.num_gpu_blocks)
    return (
        f'<div class="mv-blocks" data-free="{s.num_free_blocks}" data-total="{s.num_gpu_blocks}">'
        f"<div>{pool} "
        f'<span class="mv-dim">({key}'
        f'{legend})</span>'
        f'</div><div class="mv-pool">{"".join(cells)}{tail}</div></div>'
    )


def _why(trace: SchedulerTrace, k: int) -> str:
    items = "".join(
        f'<li data-reason="{r.kind}" data-cause="{r.cause}" data-request-id="{_attr(r.request_id or "")}">'
        f"{escape(r.text)}</li>"
        for r in explain_step(trace, k)
    ) or ('<li data-reason="none" data-cause="">' + _("nothing admitted, preempted or finished, nobody waiting")
          + "</li>")
    return '<div class="mv-why"><b>' + _("why") + f"</b><ul>{items}</ul></div>"


def _next(trace: SchedulerTrace, k: int) -> str:
    parts = []
    colon = _(": ")   # a full-width colon after a Chinese label
    for kind in EVENT_KINDS:
        j = next_event(trace, k, kind)
        label = _(NEXT_LABELS[kind])
        where = "&ndash;" if j is None else _("step {step}").format(step=j)
        parts.append(f'{label}{colon}<span data-next="{kind}" data-step="{"" if j is None else j}">{where}</span>')
    return f'<div class="mv-next">{" &middot; ".join(parts)}</div>'


def _block_table(s: StepRecord, rid: str, color: str) -> str:
    """``rid``'s block table at step ``s``: one column per logical block with its physical block and the tokens
    written in it by the end of the step (``num_computed_tokens`` after scheduling)."""
    snap = s.requests.get(rid)
    head = (f'<div class="mv-table" data-request-id="{_attr(rid)}"><div>'
            + _("block table of <b>{request}</b>").format(request=escape(rid)) + " ")
    if snap is None:
        return head + '<span class="mv-dim">' + _("(not in the engine at this step)") + "</span></div></div>"
    if not snap.block_ids:
        return head + ('<span class="mv-dim">' + _("({status}: holds no KV block)").format(status=snap.status.lower())
                       + "</span></div></div>")
    new = set(s.new_block_ids.get(rid, []))
    bs = s.block_size
    logical, physical, filled = (["<th>" + _("logical") + "</th>"], ["<th>" + _("physical") + "</th>"],
                                 ["<th>" + _("tokens") + "</th>"])
    for i, b in enumerate(snap.block_ids):
        shared = len(s.block_owners[b]) > 1 if b < len(s.block_owners) else False
        mark = f' data-new="{int(b in new)}" data-shared="{int(shared)}"'
        logical.append(f"<td>{i}</td>")
        physical.append(f'<td data-logical="{i}" data-block="{b}"{mark} style="background:{color}; '
                        f'color:{text_color(color)}">{b}{"*" if shared else ""}</td>')
        n = min(bs, max(0, snap.num_computed_tokens - i * bs)) if bs else None
        filled.append(f"<td>{'' if n is None else f'{n}/{bs}'}</td>")
    note = _("amber = given to it in this step (a new block, or its whole table when admitted); * = shared with "
             "another request (a prefix-cache hit); tokens = slots whose KV is written by the end of this step")
    note = _("({text})").format(text=note)   # full-width brackets around Chinese
    return (
        head + f'<span class="mv-dim">{note}</span></div><table><tr>{"".join(logical)}</tr>'
        f'<tr>{"".join(physical)}</tr><tr>{"".join(filled)}</tr></table></div>'
    )


def render_frame_html(
    trace: SchedulerTrace,
    k: int,
    *,
    colors: Optional[Dict[str, str]] = None,
    max_blocks: int = 512,
    with_css: bool = True,
    explain: bool = True,
    changes: bool = True,
    selected: Optional[str] = None,
) -> str:
    """HTML of step ``k`` of ``trace``: queues, scheduled tokens, budget, events and KV block pool; by default
    also why (``explain_step``), the next events and the changes since step ``k - 1``.

    Args:
        trace: a recorded run (``TracedLLMEngine(...).trace``).
        k: the step, ``0 <= k < len(trace)``.
        colors: ``request id -> "#rrggbb"``; default ``owner_colors(trace)`` (stable over the whole run).
        max_blocks: draw at most this many KV blocks (the rest is summarised in one line).
        with_css: put ``<style>FRAME_CSS</style>`` in front (leave it out when the page has it already).
        explain: add the "why" box (``minivllm.course.viz.explain.explain_step``) and the steps of the next
            preemption, admission and finish.
        changes: mark what changed since step ``k - 1`` (``step_changes``): requests that changed queue, blocks
            taken or freed.
        selected: a request id: add its block table at this step (``None``: no table).

    Returns:
        ``[<style>...</style>]<div class="mv-frame" data-step="k">...</div>``.

    Raises:
        ValueError: if ``trace`` is empty, ``k`` is outside ``[0, len(trace))``, ``max_blocks < 1`` or
            ``selected`` is not a request of the trace.

    The counters in a request box are taken right after ``schedule()`` (as vLLM's scheduler advances
    ``num_computed_tokens`` at schedule time): ``computed a->b`` is before and after this step's tokens, ``output``
    counts tokens sampled in earlier steps.
    """
    if len(trace) == 0:
        raise ValueError("trace is empty: record the run with a SchedulerTrace (a TracedLLMEngine) and step it at least once")
    if not isinstance(k, int) or not 0 <= k < len(trace):
        raise ValueError(f"k must be an int in [0, {len(trace) - 1}], got {k!r}")
    if max_blocks < 1:
        raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
    colors = owner_colors(trace) if colors is None else colors
    if selected is not None and selected not in colors and selected not in owner_colors(trace):
        raise ValueError(f"selected must be a request id of the trace, got {selected!r}")
    s = trace[k]
    diff = step_changes(trace, k) if changes else None
    title = _("step {step}").format(step=f'<span class="mv-step">{s.step}</span>')
    of_steps = _("of 0&ndash;{last}").format(last=trace[len(trace) - 1].step)
    return (
        (f"<style>{FRAME_CSS}</style>" if with_css else "")
        + f'<div class="mv-frame" data-step="{s.step}">'
        f'<div class="mv-title"><b>{title}</b> '
        f'<span class="mv-dim">{of_steps}</span></div>'
        f"{_why(trace, k) + _next(trace, k) if explain else ''}"
        f"{_budget(s, colors)}{_events(s)}"
        f'{_queue(s, "waiting", s.waiting, colors, _(WAITING_TITLE), diff)}'
        f'{_queue(s, "running", s.running, colors, _(RUNNING_TITLE), diff)}'
        f"{_blocks(s, colors, max_blocks, diff)}"
        f"{'' if selected is None else _block_table(s, selected, colors.get(selected, '#777777'))}</div>"
    )
