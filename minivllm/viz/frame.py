"""One step of a recorded run as self-contained HTML: the frame the queue animator shows.

A frame draws one ``StepRecord`` (see ``minivllm/engine/trace.py``): the waiting queue (front first) and the
running queue (admission order), one box per request with its id and token counters; the tokens each scheduled
request computes in this step, a prefill chunk drawn striped and a decode token drawn solid; how much of the
token budget (``max_num_batched_tokens``) the step used; the requests admitted, resumed, preempted and finished
in this step; and the KV block pool, each block coloured by the request(s) that hold it.

The HTML uses inline styles only, so it renders the same inside JupyterLab, in a notebook exported to HTML
without a kernel, and in a plain browser. Every element a test or a reader may look for carries a ``data-*``
attribute (``data-queue``, ``data-request-id``, ``data-kind``, ``data-tokens``, ``data-block``, ``data-owner``).
"""

from __future__ import annotations

from html import escape
from typing import Dict, List, Optional

from minivllm.engine.trace import SchedulerTrace, StepRecord
from minivllm.viz.colors import CACHED_FREE_COLOR, FREE_COLOR, owner_colors, text_color

_FONT = "font-family: -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; font-size: 13px; line-height: 1.35"


def _stripes(color: str) -> str:
    """CSS background of a prefill chunk: diagonal stripes of the owner's colour on white."""
    return f"repeating-linear-gradient(45deg, {color} 0 6px, #ffffff 6px 10px)"


def _attr(value: object) -> str:
    return escape(str(value), quote=True)


def _badge(text: str, color: str, cls: str) -> str:
    return (
        f'<span class="mv-badge {cls}" style="display:inline-block; margin-left:4px; padding:0 5px; '
        f'border-radius:8px; font-size:11px; background:{color}; color:#fff">{escape(text)}</span>'
    )


def _request_box(s: StepRecord, rid: str, queue: str, color: str) -> str:
    snap = s.requests.get(rid)
    n = s.num_scheduled_tokens.get(rid, 0)
    kind = s.kinds.get(rid, "none") if n else "none"
    badges = []
    if rid in s.new:
        badges.append(_badge("new", "#2e7d32", "mv-new"))
    if rid in s.resumed:
        badges.append(_badge("resumed", "#1565c0", "mv-resumed"))
    if rid in s.preempted:
        badges.append(_badge("preempted", "#c62828", "mv-preempted"))
    if rid in s.finished:
        badges.append(_badge(f"finished ({s.finished[rid]})", "#424242", "mv-finished"))
    if snap is not None:
        before = s.num_computed_before.get(rid, snap.num_computed_tokens)
        computed = (
            f"computed {before}&rarr;{snap.num_computed_tokens}" if n else f"computed {snap.num_computed_tokens}"
        )
        counts = f"prompt {snap.num_prompt_tokens} &middot; {computed} &middot; output {snap.num_output_tokens}"
        if snap.num_preemptions:
            counts += f" &middot; preempted &times;{snap.num_preemptions}"
    else:
        counts = ""
    if kind == "prefill":
        label = f"prefill chunk +{n}"
        if snap is not None and snap.num_preemptions and snap.num_output_tokens:
            label = f"prefill (recompute) +{n}"
        samples = snap is not None and snap.num_computed_tokens >= snap.num_tokens
        label += " &rarr; samples a token" if samples else " &middot; no token (partial prompt)"
        chunk = (
            f'<div class="mv-chunk mv-prefill" data-kind="prefill" data-tokens="{n}" style="margin-top:3px; '
            f'padding:1px 4px; border:1px solid {color}; background:{_stripes(color)}">'
            f'<span style="background:#fff; padding:0 3px">{label}</span></div>'
        )
    elif kind == "decode":
        chunk = (
            f'<div class="mv-chunk mv-decode" data-kind="decode" data-tokens="{n}" style="margin-top:3px; '
            f'padding:1px 4px; border:1px solid {color}; background:{color}; color:{text_color(color)}">'
            f"decode +{n} &rarr; samples a token</div>"
        )
    elif queue == "running":
        chunk = (
            '<div class="mv-chunk mv-idle" data-kind="none" data-tokens="0" style="margin-top:3px; padding:1px 4px; '
            'border:1px dashed #999; color:#666">no tokens this step (budget spent)</div>'
        )
    else:
        chunk = ""
    return (
        f'<div class="mv-req" data-request-id="{_attr(rid)}" data-queue="{queue}" data-kind="{kind}" '
        f'data-tokens="{n}" style="display:inline-block; vertical-align:top; margin:3px; padding:4px 6px; '
        f'min-width:150px; border:2px solid {color}; border-left-width:10px; border-radius:4px; background:#fff">'
        f'<div><b style="font-size:14px">{escape(rid)}</b>{"".join(badges)}</div>'
        f'<div class="mv-counts" style="font-size:11px; color:#333">{counts}</div>{chunk}</div>'
    )


def _queue(s: StepRecord, queue: str, ids: List[str], colors: Dict[str, str], title: str) -> str:
    boxes = "".join(_request_box(s, rid, queue, colors.get(rid, "#777777")) for rid in ids)
    if not boxes:
        boxes = '<span style="color:#888; margin:3px">(empty)</span>'
    return (
        f'<div class="mv-queue" data-queue="{queue}" style="margin:4px 0; padding:3px; background:#fafafa; '
        f'border:1px solid #ddd; border-radius:4px"><div style="font-weight:600; margin-left:3px">{title} '
        f'<span style="font-weight:400; color:#666">({len(ids)})</span></div>{boxes}</div>'
    )


def _budget(s: StepRecord, colors: Dict[str, str]) -> str:
    budget = max(s.token_budget, 1)
    used = s.total_scheduled
    segments = []
    for rid, n in s.num_scheduled_tokens.items():
        color = colors.get(rid, "#777777")
        background = _stripes(color) if s.kinds[rid] == "prefill" else color
        segments.append(
            f'<div class="mv-seg" data-request-id="{_attr(rid)}" data-kind="{s.kinds[rid]}" data-tokens="{n}" '
            f'title="{_attr(rid)}: {s.kinds[rid]} {n}" style="flex:0 0 {100 * n / budget:.3f}%; min-width:2px; '
            f'height:16px; background:{background}; border-right:1px solid #fff; box-sizing:border-box"></div>'
        )
    seqs = f" &middot; running {len(s.running)} / max_num_seqs {s.max_num_seqs}" if s.max_num_seqs else ""
    return (
        f'<div class="mv-budget" data-used="{used}" data-budget="{s.token_budget}" style="margin:4px 0">'
        f"<div>token budget: <b>{used}</b> / {s.token_budget} tokens used{seqs}</div>"
        f'<div style="display:flex; width:100%; max-width:600px; border:1px solid #999; background:#fff">'
        f'{"".join(segments)}</div></div>'
    )


def _events(s: StepRecord) -> str:
    def ids(xs) -> str:
        return " ".join(escape(x) for x in xs) or "&ndash;"

    finished = " ".join(f"{escape(r)} ({escape(str(why))})" for r, why in s.finished.items()) or "&ndash;"
    return (
        f'<div class="mv-events" style="margin:4px 0">new: <span data-event="new">{ids(s.new)}</span> &middot; '
        f'resumed: <span data-event="resumed">{ids(s.resumed)}</span> &middot; '
        f'preempted: <span data-event="preempted" style="color:#c62828">{ids(s.preempted)}</span> &middot; '
        f'finished: <span data-event="finished">{finished}</span></div>'
    )


def _blocks(s: StepRecord, colors: Dict[str, str], max_blocks: int) -> str:
    cached = set(s.cached_free_blocks)
    cells = []
    for b, owners in enumerate(s.block_owners[:max_blocks]):
        if owners:
            cs = [colors.get(o, "#777777") for o in owners]
            if len(cs) == 1:
                background = cs[0]
            else:  # a prefix-cache hit: one block, several owners, one band of colour each
                stops = ", ".join(f"{c} {100 * i / len(cs):.0f}% {100 * (i + 1) / len(cs):.0f}%" for i, c in enumerate(cs))
                background = f"linear-gradient(90deg, {stops})"
            border, fg = "1px solid #555", text_color(cs[0])
            tip = f"block {b}: held by {', '.join(owners)}"
        elif b in cached:
            background, border, fg = CACHED_FREE_COLOR, "1px dashed #555", "#555"
            tip = f"block {b}: free, still holds a cached prefix (evictable)"
        else:
            background, border, fg = FREE_COLOR, "1px solid #ccc", "#999"
            tip = f"block {b}: free"
        cells.append(
            f'<span class="mv-block" data-block="{b}" data-owner="{_attr(" ".join(owners))}" '
            f'data-cached="{int(b in cached)}" title="{_attr(tip)}" style="display:inline-block; width:26px; '
            f"height:20px; margin:1px; text-align:center; font-size:10px; line-height:20px; box-sizing:border-box; "
            f'background:{background}; border:{border}; color:{fg}">{b}</span>'
        )
    more = len(s.block_owners) - max_blocks
    tail = ""
    if more > 0:
        held = sum(1 for owners in s.block_owners[max_blocks:] if owners)
        tail = f'<span style="color:#666"> &hellip; {more} more blocks not drawn ({held} of them held)</span>'
    return (
        f'<div class="mv-blocks" data-free="{s.num_free_blocks}" data-total="{s.num_gpu_blocks}" style="margin:4px 0">'
        f"<div>KV block pool: <b>{s.num_free_blocks}</b> of {s.num_gpu_blocks} blocks free "
        f'<span style="color:#666">(colour = owner; grey = free; dashed = free but still a cached prefix)</span>'
        f'</div><div style="max-width:900px">{"".join(cells)}{tail}</div></div>'
    )


def render_frame_html(
    trace: SchedulerTrace,
    k: int,
    *,
    colors: Optional[Dict[str, str]] = None,
    max_blocks: int = 512,
) -> str:
    """HTML of step ``k`` of ``trace``: queues, scheduled tokens, budget, events and KV block pool.

    Args:
        trace: a recorded run (``LLMEngine(..., record_trace=True).trace``).
        k: the step, ``0 <= k < len(trace)``.
        colors: ``request id -> "#rrggbb"``; default ``owner_colors(trace)`` (stable over the whole run).
        max_blocks: draw at most this many KV blocks (the rest is summarised in one line).

    Returns:
        A ``<div class="mv-frame" data-step="k">`` string with inline styles only.

    Raises:
        ValueError: if ``trace`` is empty, ``k`` is outside ``[0, len(trace))`` or ``max_blocks < 1``.

    The counters in a request box are taken right after ``schedule()`` (as vLLM's scheduler advances
    ``num_computed_tokens`` at schedule time): ``computed a->b`` is before and after this step's tokens, ``output``
    counts tokens sampled in earlier steps.
    """
    if len(trace) == 0:
        raise ValueError("trace is empty: run the engine with record_trace=True and step it at least once")
    if not isinstance(k, int) or not 0 <= k < len(trace):
        raise ValueError(f"k must be an int in [0, {len(trace) - 1}], got {k!r}")
    if max_blocks < 1:
        raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
    colors = owner_colors(trace) if colors is None else colors
    s = trace[k]
    return (
        f'<div class="mv-frame" data-step="{s.step}" style="{_FONT}; color:#222; padding:4px">'
        f'<div class="mv-title" style="font-size:15px"><b>step <span class="mv-step">{s.step}</span></b> '
        f'<span style="color:#666">of 0&ndash;{trace[len(trace) - 1].step}</span></div>'
        f"{_budget(s, colors)}{_events(s)}"
        f'{_queue(s, "waiting", s.waiting, colors, "waiting queue (front first)")}'
        f'{_queue(s, "running", s.running, colors, "running queue (admission order)")}'
        f"{_blocks(s, colors, max_blocks)}</div>"
    )
