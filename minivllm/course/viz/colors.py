"""One colour per request, the same in every frame, plot and image of a run.

Colours are given in order of first appearance in the trace (the first request seen gets the first colour), so a
request keeps its colour while it moves between the waiting and running queues and across the KV block pool.
"""

from __future__ import annotations

from typing import Dict, List

from minivllm.course.trace import SchedulerTrace

# matplotlib's "tab20" reordered so that neighbours differ strongly (dark tones first, then their light tones).
PALETTE: List[str] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
    "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#c7c7c7", "#dbdb8d", "#9edae5",
]
FREE_COLOR = "#eeeeee"
"""Background of a free KV block that holds nothing reusable."""
CACHED_FREE_COLOR = "#ffffff"
"""Background of a free block that still carries a prefix-cache hash (evictable, reusable on a hit)."""


def request_order(trace: SchedulerTrace) -> List[str]:
    """Request ids in order of first appearance (running queue, then waiting queue, step by step): arrival order
    for FCFS runs."""
    seen: Dict[str, None] = {}
    for s in trace:
        for rid in list(s.running) + list(s.waiting) + list(s.num_scheduled_tokens):
            seen.setdefault(rid, None)
    return list(seen)


def owner_colors(trace: SchedulerTrace) -> Dict[str, str]:
    """``request id -> "#rrggbb"``; the palette repeats after 20 requests (ids stay written on every box)."""
    return {rid: PALETTE[i % len(PALETTE)] for i, rid in enumerate(request_order(trace))}


def text_color(background: str) -> str:
    """Black or white, whichever reads better on ``background`` (``"#rrggbb"``), by relative luminance."""
    r, g, b = (int(background[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return "#000000" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "#ffffff"
