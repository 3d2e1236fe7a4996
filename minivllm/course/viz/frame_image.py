"""One step of a recorded run drawn with matplotlib: the static twin of ``render_frame_html``, for slides and for
the PNGs in ``images/``.

Same content as the HTML frame: token budget bar (prefill chunks hatched, decode tokens solid), events of the
step, waiting queue and running queue in order, and the KV block pool coloured by owner.
"""

from __future__ import annotations

from typing import Dict, Optional

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from minivllm.course.trace import SchedulerTrace
from minivllm.course.viz.colors import CACHED_FREE_COLOR, FREE_COLOR, owner_colors, text_color
from minivllm.course.viz.fonts import use_language_font
from minivllm.course.viz.frame import KIND_LABELS, RUNNING_TITLE, WAITING_TITLE
from minivllm.i18n import _

_W = 12.0  # drawing width in data units
_MIN_SEG_W = 0.08  # the budget bar's narrowest segment: one decode token of a 2048-token budget stays visible
_BOX_W, _BOX_H, _GAP = 1.85, 1.05, 0.12


def _queue_row(ax, s, ids, y, title, colors):
    ax.text(0, y, title, fontsize=9, fontweight="bold", va="bottom")
    y -= 0.1
    per_row = int((_W + _GAP) // (_BOX_W + _GAP))
    if not ids:
        ax.text(0.1, y - 0.4, _("(empty)"), fontsize=8, color="#888", va="center")
        return y - _BOX_H - 0.35
    for i, rid in enumerate(ids):
        x = (i % per_row) * (_BOX_W + _GAP)
        top = y - (i // per_row) * (_BOX_H + _GAP)
        color = colors.get(rid, "#777777")
        snap = s.requests.get(rid)
        ax.add_patch(Rectangle((x, top - _BOX_H), _BOX_W, _BOX_H, facecolor="white", edgecolor=color, linewidth=2))
        ax.add_patch(Rectangle((x, top - _BOX_H), 0.12, _BOX_H, facecolor=color, edgecolor=color))
        marks = [_(w) for w, ids_ in (("new", s.new), ("resumed", s.resumed), ("preempted", s.preempted))
                 if rid in ids_]
        if rid in s.finished:
            marks.append(_("finished"))
        ax.text(x + 0.2, top - 0.08, f"{rid}  " + " ".join(marks), fontsize=8, fontweight="bold", va="top",
                color="#c62828" if rid in s.preempted else "black")
        if snap is not None:
            ax.text(x + 0.2, top - 0.36, _("prompt {prompt} out {output}\ncomputed {computed}").format(
                prompt=snap.num_prompt_tokens, output=snap.num_output_tokens, computed=snap.num_computed_tokens),
                fontsize=6.5, va="top", linespacing=1.2)
        n = s.num_scheduled_tokens.get(rid, 0)
        if n:
            kind = s.kinds[rid]
            ax.add_patch(Rectangle((x + 0.2, top - _BOX_H + 0.06), _BOX_W - 0.3, 0.2,
                                   facecolor="white" if kind == "prefill" else color, edgecolor=color,
                                   hatch="////" if kind == "prefill" else None, linewidth=1))
            ax.text(x + 0.25, top - _BOX_H + 0.16, (_("prefill +{n}") if kind == "prefill" else _("decode +{n}")).format(n=n),
                    fontsize=6.5, va="center", color="black" if kind == "prefill" else text_color(color),
                    bbox=dict(facecolor="white", edgecolor="none", pad=0.5) if kind == "prefill" else None)
    rows = (len(ids) - 1) // per_row + 1
    return y - rows * (_BOX_H + _GAP) - 0.3


def draw_frame(
    trace: SchedulerTrace,
    k: int,
    ax=None,
    *,
    colors: Optional[Dict[str, str]] = None,
    max_blocks: int = 256,
):
    """Draw step ``k`` of ``trace`` into ``ax`` (a new figure when ``None``) and return the axes.

    Raises ``ValueError`` for an empty trace or ``k`` outside ``[0, len(trace))``.
    """
    if len(trace) == 0:
        raise ValueError("trace is empty: record the run with a SchedulerTrace (a TracedLLMEngine) and step it at least once")
    if not isinstance(k, int) or not 0 <= k < len(trace):
        raise ValueError(f"k must be an int in [0, {len(trace) - 1}], got {k!r}")
    colors = owner_colors(trace) if colors is None else colors
    s = trace[k]
    use_language_font()
    if ax is None:
        n_rows = 2 + (len(s.waiting) - 1) // 6 + (len(s.running) - 1) // 6 + min(len(s.block_owners), max_blocks) // 40
        _fig, ax = plt.subplots(figsize=(9, 3.4 + 0.75 * n_rows))
    use_language_font(ax)
    y = 0.0
    used, budget = s.total_scheduled, max(s.token_budget, 1)
    seqs = (_("   running {running} / max_num_seqs {max_num_seqs}").format(
        running=len(s.running), max_num_seqs=s.max_num_seqs) if s.max_num_seqs else "")
    ax.text(0, y, _("step {step}    token budget: {used} / {budget} used").format(
        step=s.step, used=used, budget=s.token_budget) + seqs, fontsize=11,
            fontweight="bold", va="top")
    y -= 0.5
    x = 0.0
    ax.add_patch(Rectangle((0, y - 0.3), _W, 0.3, facecolor="white", edgecolor="#888"))
    for rid, n in s.num_scheduled_tokens.items():
        if n <= 0:
            continue
        # a segment's width is its share of the budget, but never under _MIN_SEG_W: a few decode tokens of a
        # large budget would otherwise be drawn thinner than a pixel and the bar would look empty
        w = min(max(_W * n / budget, _MIN_SEG_W), _W - x)
        c = colors.get(rid, "#777777")
        prefill = s.kinds[rid] == "prefill"
        ax.add_patch(Rectangle((x, y - 0.3), w, 0.3, facecolor="white" if prefill else c, edgecolor=c,
                               hatch="////" if prefill else None, linewidth=1, gid=f"budget:{rid}"))
        x += w
    if 0 < used < budget / 3:  # a mostly empty bar: name what the few tokens are, after the segments
        colon = _(": ")
        what = _(", ").join(f"{rid}{colon}{_(KIND_LABELS[s.kinds[rid]])} +{n}"
                            for rid, n in s.num_scheduled_tokens.items() if n > 0)
        if len(what) * 0.085 < _W - x - 0.2:
            ax.text(x + 0.12, y - 0.15, what, fontsize=7.5, va="center", color="#444")
    y -= 0.55
    ev = [_("{label}:").format(label=_(name)) + f" {' '.join(ids) or '-'}" for name, ids in
          (("new", s.new), ("resumed", s.resumed), ("preempted", s.preempted), ("finished", list(s.finished)))]
    ax.text(0, y, "    ".join(ev), fontsize=8.5, va="top")
    y -= 0.55
    y = _queue_row(ax, s, s.waiting, y, _(WAITING_TITLE), colors)
    y = _queue_row(ax, s, s.running, y, _(RUNNING_TITLE), colors)
    ax.text(0, y, _("KV block pool: {free} of {total} free (colour = owner, grey = free, dashed = free cached "
                    "prefix)").format(free=s.num_free_blocks, total=s.num_gpu_blocks),
            fontsize=9, fontweight="bold", va="bottom")
    y -= 0.1
    cached = set(s.cached_free_blocks)
    per_row, size = 40, _W / 40
    for b, owners in enumerate(s.block_owners[:max_blocks]):
        bx, by = (b % per_row) * size, y - (b // per_row + 1) * size
        if owners:
            fc, ec, ls = colors.get(owners[0], "#777777"), "#555", "-"
        elif b in cached:
            fc, ec, ls = CACHED_FREE_COLOR, "#555", "--"
        else:
            fc, ec, ls = FREE_COLOR, "#ccc", "-"
        ax.add_patch(Rectangle((bx, by), size * 0.92, size * 0.92, facecolor=fc, edgecolor=ec, linestyle=ls,
                               linewidth=0.6))
    rows = (min(len(s.block_owners), max_blocks) - 1) // per_row + 1
    y -= rows * size + 0.1
    ax.set_xlim(-0.05, _W + 0.05)
    ax.set_ylim(y, 0.15)
    ax.set_aspect("equal")
    ax.axis("off")
    return ax


def save_frame_png(trace: SchedulerTrace, k: int, path, *, dpi: int = 110, **kwargs) -> None:
    """``draw_frame(trace, k, **kwargs)`` saved as a PNG at ``path`` (the figure is closed afterwards)."""
    ax = draw_frame(trace, k, **kwargs)
    fig = ax.figure
    fig.savefig(path, dpi=dpi, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
