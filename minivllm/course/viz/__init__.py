"""Pictures of a recorded run (``SchedulerTrace``): the queue animator, single frames, and static plots.

Record a run with ``TracedLLMEngine(...)`` from ``minivllm.course.trace`` (or register a ``SchedulerTrace`` with
``llm.llm_engine.add_step_observer(trace)``), then::

    from minivllm.course.viz import QueueAnimator, plot_timeline
    QueueAnimator(engine.trace)          # Play / slider over every step (works in exported HTML too), each frame
                                         # saying why; jump buttons; the block table of the request picked
    plot_timeline(engine.trace)          # requests x steps: waiting / prefill chunk / decode / preempted
    explain_line(engine.trace, k)        # why step k went as it did, in one line (explain_step: as Reasons)

Files: ``colors`` (one colour per request), ``frame`` (HTML of one step), ``frame_image`` (the same with
matplotlib), ``animator`` (the widget), ``explain`` (why each step went as it did, events, changes between steps),
``timeline`` (state of each request in each step), ``metrics`` (latency per request, batch occupancy, budget
usage), ``plots`` (static plots).
"""

from minivllm.course.viz.animator import QueueAnimator
from minivllm.course.viz.colors import owner_colors, request_order
from minivllm.course.viz.explain import (
    Reason, StepChanges, event_steps, explain_line, explain_step, next_event, step_changes,
)
from minivllm.course.viz.frame import render_frame_html
from minivllm.course.viz.frame_image import draw_frame, save_frame_png
from minivllm.course.viz.plots import plot_free_blocks, plot_timeline, plot_tokens_per_step
from minivllm.course.viz.metrics import RequestLatency, batch_occupancy, budget_usage, request_latencies
from minivllm.course.viz.timeline import ABSENT, DECODE, IDLE, PREEMPTED, PREFILL, STATE_NAMES, WAITING, timeline_states

__all__ = [
    "QueueAnimator", "render_frame_html", "draw_frame", "save_frame_png", "owner_colors", "request_order",
    "plot_timeline", "plot_free_blocks", "plot_tokens_per_step", "timeline_states", "request_latencies",
    "RequestLatency", "batch_occupancy", "budget_usage", "STATE_NAMES", "ABSENT", "WAITING", "PREFILL", "DECODE", "PREEMPTED", "IDLE",
    "Reason", "StepChanges", "explain_step", "explain_line", "event_steps", "next_event", "step_changes",
]
