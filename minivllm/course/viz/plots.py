"""Static plots of a recorded run (matplotlib): the timeline, free KV blocks over time, tokens per step.

Each function draws into ``ax`` (or a new figure's axes when ``ax`` is ``None``) and returns the axes, so plots can
be combined into one figure in a notebook or in ``python -m minivllm figures``.
"""

from __future__ import annotations

from typing import Dict, Optional

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import BoundaryNorm, ListedColormap
from matplotlib.patches import Patch

from minivllm.course.trace import SchedulerTrace
from minivllm.course.viz.fonts import use_language_font
from minivllm.i18n import N_, _
from minivllm.course.viz.timeline import STATE_COLORS, STATE_NAMES, timeline_states


def _axes(ax, size):
    use_language_font()
    if ax is None:
        _fig, ax = plt.subplots(figsize=size)
    use_language_font(ax)  # an axes the caller made before the font was added
    return ax


def plot_timeline(
    trace: SchedulerTrace,
    ax=None,
    *,
    arrivals: Optional[Dict[str, int]] = None,
    title: Optional[str] = N_("What each request did in each step"),
    legend: bool = True,
):
    """Requests (rows) x steps (columns), each cell coloured by state: waiting, prefill chunk, decode, preempted,
    running without tokens, or not in the engine (see ``timeline_states``; ``arrivals`` as there). Labels and the
    default title are in the current language (``minivllm.i18n``); a ``title`` given is shown through ``_`` too.

    Raises ``ValueError`` for an empty trace.
    """
    if len(trace) == 0:
        raise ValueError("trace is empty: nothing to plot")
    ids, states = timeline_states(trace, arrivals)
    ax = _axes(ax, (min(2 + 0.18 * len(trace), 14), 0.9 + 0.3 * len(ids)))
    cmap = ListedColormap(STATE_COLORS)
    norm = BoundaryNorm(np.arange(len(STATE_COLORS) + 1) - 0.5, len(STATE_COLORS))
    ax.imshow(states, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm,
              extent=(-0.5, len(trace) - 0.5, len(ids) - 0.5, -0.5))
    ax.set_yticks(range(len(ids)), ids)
    ax.set_xlabel(_("engine step"))
    ax.set_ylabel(_("request"))
    # thin white grid lines make single steps countable
    ax.set_xticks(np.arange(-0.5, len(trace), 1), minor=True)
    ax.set_yticks(np.arange(-0.5, len(ids), 1), minor=True)
    ax.grid(which="minor", color="white", linewidth=0.5)
    ax.tick_params(which="minor", length=0)
    if title:
        ax.set_title(_(title))
    if legend:
        present = sorted(set(np.unique(states).tolist()))
        handles = [Patch(facecolor=STATE_COLORS[c], edgecolor="#888", label=_(STATE_NAMES[c])) for c in present]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return ax


def plot_free_blocks(trace: SchedulerTrace, ax=None, *, label: Optional[str] = None, title: Optional[str] = None):
    """Free KV blocks after scheduling, per step, with the pool size as a dashed line and preemptions marked.

    Raises ``ValueError`` for an empty trace.
    """
    if len(trace) == 0:
        raise ValueError("trace is empty: nothing to plot")
    ax = _axes(ax, (7, 3))
    steps = [s.step for s in trace]
    ax.step(steps, [s.num_free_blocks for s in trace], where="mid", label=label or _("free blocks"))
    ax.axhline(trace[0].num_gpu_blocks, color="#888", linestyle="--", linewidth=1, label="num_gpu_blocks")
    pre = [s.step for s in trace if s.preempted]
    if pre:
        ax.scatter(pre, [trace[p - trace[0].step].num_free_blocks for p in pre], color="#e15759", zorder=3,
                   marker="v", label=_("preemption"))
    ax.set_xlabel(_("engine step"))
    ax.set_ylabel(_("free KV blocks"))
    ax.set_ylim(0, trace[0].num_gpu_blocks * 1.08)
    ax.set_title(_(title) if title else _("Free KV blocks over time"))
    ax.legend(fontsize=8)
    return ax


def plot_tokens_per_step(trace: SchedulerTrace, ax=None, *, title: Optional[str] = None):
    """Stacked bars per step: prefill tokens and decode tokens, against the token budget (dashed line).

    Raises ``ValueError`` for an empty trace.
    """
    if len(trace) == 0:
        raise ValueError("trace is empty: nothing to plot")
    ax = _axes(ax, (7, 3))
    steps = np.array([s.step for s in trace])
    prefill = np.array([sum(n for r, n in s.num_scheduled_tokens.items() if s.kinds[r] == "prefill") for s in trace])
    decode = np.array([sum(n for r, n in s.num_scheduled_tokens.items() if s.kinds[r] == "decode") for s in trace])
    ax.bar(steps, prefill, width=0.85, color=STATE_COLORS[2], label=_("prefill tokens"))
    ax.bar(steps, decode, width=0.85, bottom=prefill, color=STATE_COLORS[3], label=_("decode tokens"))
    ax.axhline(trace[0].token_budget, color="#333", linestyle="--", linewidth=1, label=_("token budget"))
    ax.set_xlabel(_("engine step"))
    ax.set_ylabel(_("tokens in the step"))
    ax.set_ylim(0, trace[0].token_budget * 1.12)
    ax.set_title(_(title) if title else _("Tokens per step against the budget (max_num_batched_tokens)"))
    ax.legend(fontsize=8)
    return ax
