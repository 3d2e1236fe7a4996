"""The KV connector's calls over several steps: one swim lane per hook, scheduler side above, worker side below.

Needs a run recorded by a ``SchedulerTrace`` (``TracedLLMEngine``) with a ``RecordingConnector``
(``StepRecord.connector_calls``). Each lane is one hook, each column one engine step. A hook called in a step
without touching any request gets a small grey dot (``build_connector_meta`` and the worker's hooks run every
step); a hook about requests gets one coloured box per request (the request's colour of every other picture of the
run, ``owner_colors``) labelled with what it did: ``get_num_new_matched_tokens`` the tokens the store offered,
``update_state_after_alloc`` the external tokens, the metadata's loads and saves in blocks, the worker's loads and
saves it carried out. A hook never called in a step leaves the cell empty (``get_num_new_matched_tokens`` in a
step whose waiting loop did not run).

vLLM has no such picture; its connector calls are the ones of ``KVConnectorBase_V1``
(https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/distributed/kv_transfer/kv_connector/v1/base.py).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from minivllm.course.trace import SchedulerTrace
from minivllm.course.viz.colors import owner_colors, text_color
from minivllm.course.viz.fonts import use_language_font
from minivllm.i18n import N_, _

#: ``(side, lane label)`` from top to bottom.
LANES: Tuple[Tuple[str, str], ...] = (
    ("scheduler", "get_num_new_matched_tokens"),
    ("scheduler", "update_state_after_alloc"),
    ("scheduler", "build_connector_meta: loads"),
    ("scheduler", "build_connector_meta: saves"),
    ("scheduler", "request_finished"),
    ("worker", "start_load_kv"),
    ("worker", "save_kv_layer + wait_for_save"),
    ("worker", "get_finished"),
)

Cell = Optional[List[Tuple[str, str]]]
"""One lane in one step: ``None`` (not called), ``[]`` (called, about no request) or ``[(request, label), ...]``."""


def connector_lanes(trace: SchedulerTrace) -> List[List[Cell]]:
    """``lanes[i][k]``: what hook ``LANES[i]`` did in step ``k`` (see ``Cell``).

    Labels: ``get_num_new_matched_tokens`` ``"+N"`` (the store offers N tokens beyond the local hit; ``"+N async"``
    for an asynchronous load); ``update_state_after_alloc`` ``"ext N"``; the metadata's loads and saves, and the
    worker's, ``"N blk"`` (blocks); ``request_finished`` ``""``; ``get_finished`` (loads reported done)
    ``"loaded"``. The labels are in the current language.

    Raises:
        ValueError: an empty trace, or a trace recorded without a ``RecordingConnector`` (no step has calls).
    """
    if len(trace) == 0:
        raise ValueError("trace is empty: nothing to draw")
    if not any(s.connector_calls for s in trace):
        raise ValueError("the trace has no connector calls: record the run with a RecordingConnector")
    lanes: List[List[Cell]] = [[None] * len(trace) for _lane in LANES]
    for k, s in enumerate(trace):
        def put(i: int, rid: Optional[str] = None, label: str = "") -> None:
            cell = lanes[i][k]
            if cell is None:
                cell = lanes[i][k] = []
            if rid is not None:
                cell.append((rid, label))

        meta: Dict[str, Dict] = {}
        for d in s.connector_calls:
            c = d["call"]
            if c == "get_num_new_matched_tokens":
                n, is_async = d["result"]
                put(0, d["req_id"], _("+{n} async").format(n=n) if is_async and n else f"+{n}")
            elif c == "update_state_after_alloc":
                put(1, d["req_id"], _("ext {n}").format(n=d["num_external_tokens"]))
            elif c == "build_connector_meta":
                meta = d["meta"]
                put(2)
                put(3)
                for key in ("load", "load_async"):
                    for rid, n in meta.get(key, {}).items():
                        put(2, rid, (_("{n} blk async") if key == "load_async" else _("{n} blk")).format(n=n))
                for rid, n in meta.get("save", {}).items():
                    put(3, rid, _("{n} blk").format(n=n))
            elif c == "request_finished":
                put(4, d["req_id"])
            elif c == "start_load_kv":
                put(5)
                for key in ("load", "load_async"):
                    for rid, n in meta.get(key, {}).items():
                        put(5, rid, _("{n} blk").format(n=n))
            elif c in ("save_kv_layer", "wait_for_save"):
                if lanes[6][k] is None:
                    put(6)
                    for rid, n in meta.get("save", {}).items():
                        put(6, rid, _("{n} blk").format(n=n))
            elif c == "get_finished":
                put(7)
                for rid in d["finished_recving"]:
                    put(7, rid, _("loaded"))
    return lanes


def plot_connector_timeline(trace: SchedulerTrace, ax=None, *, steps: Optional[Tuple[int, int]] = None,
                            title: Optional[str] = N_("The KV connector's calls, step by step"),
                            colors: Optional[Dict[str, str]] = None):
    """Draw ``connector_lanes(trace)``: hooks (rows, scheduler side above the line, worker side below) x steps.

    Args:
        trace: a run recorded with a ``RecordingConnector``.
        ax: the axes to draw on (a new figure when ``None``).
        steps: ``(first, last)`` steps to draw, inclusive (default: all).
        title: the axes' title (``None``: none).
        colors: ``request id -> colour`` (default ``owner_colors(trace)``).

    Returns:
        The axes.

    Raises:
        ValueError: as ``connector_lanes``, or ``steps`` outside the trace or reversed.
    """
    lanes = connector_lanes(trace)
    lo, hi = steps if steps is not None else (0, len(trace) - 1)
    if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi < len(trace)):
        raise ValueError(f"steps must be (first, last) with 0 <= first <= last <= {len(trace) - 1}, got {steps!r}")
    colors = owner_colors(trace) if colors is None else colors
    use_language_font()
    n = hi - lo + 1
    if ax is None:
        _fig, ax = plt.subplots(figsize=(min(3.2 + 0.62 * n, 17), 0.45 * len(LANES) + 1.0))
    use_language_font(ax)
    for i, _lane in enumerate(LANES):
        for k in range(lo, hi + 1):
            cell = lanes[i][k]
            x = k - lo
            if cell is None:
                continue
            if not cell:
                ax.plot(x, i, marker="o", markersize=2.5, color="#9e9e9e")
                continue
            w = 0.92 / len(cell)
            for j, (rid, label) in enumerate(cell):
                x0 = x - 0.46 + j * w
                color = colors.get(rid, "#7f7f7f")
                ax.add_patch(Rectangle((x0, i - 0.38), w * 0.94, 0.76, color=color))
                text = f"{rid} {label}".strip() if len(cell) == 1 else rid
                ax.text(x0 + w * 0.47, i, text, ha="center", va="center", fontsize=6.5 if len(cell) == 1 else 7,
                        color=text_color(color))
    ax.axhline(4.5, color="#424242", linewidth=1)
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_ylim(len(LANES) - 0.5, -0.5)
    ax.set_yticks(range(len(LANES)), [f"{side[0].upper()}: {name}" for side, name in LANES], fontsize=8)
    ax.set_xticks(range(n), [str(k) for k in range(lo, hi + 1)], fontsize=7)
    ax.set_xlabel(_("engine step   (S: scheduler side, W: worker side; a grey dot: called, about no request)"))
    for spine in ("top", "right"):
        ax.spines[spine].set_visible(False)
    if title:
        ax.set_title(_(title))
    return ax
