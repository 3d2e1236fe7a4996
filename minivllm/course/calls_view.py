"""The queue animator with one more panel: the KV connector calls of the step on screen.

Needs a run recorded by a ``SchedulerTrace`` (``TracedLLMEngine``) and a ``RecordingConnector`` (``StepRecord.connector_calls``).
The panel is a ``widgets.Stack`` of pre-rendered HTML tables whose ``selected_index`` is linked to the animator's
slider in the browser (``jsdlink``), like the animator's own frames, so it also plays in exported HTML.
"""

from __future__ import annotations

from html import escape
from typing import Any, Dict, List

import ipywidgets as widgets

from minivllm.course.recording_connector import format_call
from minivllm.i18n import TABLE_LABEL, L_, _, pgettext

_CELL = "padding:1px 8px;border-bottom:1px solid #ddd;text-align:left;font-family:monospace;font-size:12px"


def connector_calls_html(calls: List[Dict[str, Any]], step: int) -> str:
    """One step's recorded calls as an HTML table (``save_kv_layer`` records folded into one row)."""
    rows: List[tuple] = []
    layers: List[int] = []
    for d in calls:
        if d["call"] == "save_kv_layer":
            layers.append(d["layer"])
            continue
        if layers:
            rows.append(("worker", _("save_kv_layer × {n} (after each layer)").format(n=len(layers))))
            layers = []
        rows.append((d["side"], f"{d['call']}: {format_call(d)}"))
    if layers:
        rows.append(("worker", _("save_kv_layer × {n} (after each layer)").format(n=len(layers))))
    shown = {side: pgettext(TABLE_LABEL, side) for side in (L_("scheduler"), L_("worker"))}   # English: unchanged
    body = "".join(
        f"<tr><td style='{_CELL};color:{'#1565c0' if side == 'scheduler' else '#6a1b9a'}'>{shown.get(side, side)}</td>"
        f"<td style='{_CELL}'>{escape(text)}</td></tr>"
        for side, text in rows
    ) or f"<tr><td style='{_CELL}'>" + _("no calls") + "</td></tr>"
    title = _("KV connector calls in step {step}").format(step=step)
    return (f"<div data-connector-step='{step}'><b>{title}</b>"
            f"<table style='border-collapse:collapse;margin:4px 0'>{body}</table></div>")


class ConnectorAnimator:
    """``QueueAnimator`` of a trace plus the connector calls of the step shown.

    Args:
        trace: a ``SchedulerTrace`` recorded with a ``RecordingConnector``.
        **animator_kwargs: passed to ``minivllm.course.viz.QueueAnimator`` (``interval_ms``, ``start``, ...).

    Attributes:
        animator: the ``QueueAnimator``; ``panel``: the ``widgets.Stack`` of call tables; ``widget``: both.

    Raises:
        ValueError: from ``QueueAnimator`` (empty trace, bad ``start``).
    """

    def __init__(self, trace, **animator_kwargs) -> None:
        from minivllm.course.viz import QueueAnimator

        self.animator = QueueAnimator(trace, **animator_kwargs)
        self.tables = [connector_calls_html(s.connector_calls, s.step) for s in trace.steps]
        self.panel = widgets.Stack([widgets.HTML(t) for t in self.tables], selected_index=self.animator.step)
        slider = self.animator.slider
        self._links = [
            widgets.jsdlink((slider, "value"), (self.panel, "selected_index")),
            widgets.dlink((slider, "value"), (self.panel, "selected_index")),
        ]
        self.widget = widgets.VBox([self.animator.widget, self.panel])

    @property
    def step(self) -> int:
        """The step shown; setting it moves the animator and the panel."""
        return self.animator.step

    @step.setter
    def step(self, k: int) -> None:
        self.animator.step = k

    def __repr__(self) -> str:
        return f"ConnectorAnimator({len(self.tables)} steps)"

    def _repr_mimebundle_(self, **kwargs):
        bundle = self.widget._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = repr(self)
        return bundle
