"""The queue animator: a Play button and a step slider over a recorded run.

Every frame is rendered to HTML once, up front, and the frames sit in a ``widgets.Stack``; the slider's value is
linked to the stack's ``selected_index`` *in the browser* (``jsdlink``). Switching frames therefore needs no
Python: the animation plays in JupyterLab, and also in a notebook exported to HTML and opened without a kernel.
A Python-side link does the same while a kernel is alive, so ``animator.step = k`` is visible to code and tests.

Each frame says why (``minivllm.course.viz.explain``), names the next events' steps and marks the changes since the
step before; all of that is in the pre-rendered HTML, so it shows without a kernel too. The buttons that jump to
the next preemption, admission or finish, and the menu that picks whose block table the frames draw, run Python:
they act in a notebook with a kernel; in exported HTML they show the state saved with the notebook (the frames
still name the next events' steps, for the slider).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Union

import ipywidgets as widgets
from ipywidgets.widgets.widget_string import HTMLStyle

from minivllm.course.trace import SchedulerTrace
from minivllm.course.viz.colors import owner_colors, request_order
from minivllm.course.viz.explain import EVENT_KINDS, next_event
from minivllm.course.viz.frame import FRAME_CSS, NEXT_LABELS, render_frame_html
from minivllm.i18n import N_, _

_BUTTON_TOOLTIPS = {"preemption": N_("jump to the next step with a preemption"),
                    "admission": N_("jump to the next step with an admission"),
                    "finish": N_("jump to the next step with a finish")}
_NONE = "(none)"
"""The menu's value for "no block table" (its label is shown through ``_``)."""


def _default_selected(trace: SchedulerTrace) -> str:
    """The request whose block table is drawn by default: the first one preempted (its table empties and is
    rebuilt), else the first request seen."""
    for s in trace:
        if s.preempted:
            return s.preempted[0]
    return request_order(trace)[0]


class QueueAnimator:
    """Step through a ``SchedulerTrace`` with Play / slider; one pre-rendered frame per engine step.

    Args:
        trace: a recorded run (``TracedLLMEngine(...).trace``), at least one step.
        interval_ms: milliseconds between frames while playing (>= 50).
        start: the step shown first.
        max_blocks: KV blocks drawn per frame (see ``render_frame_html``).
        colors: ``request id -> colour``; default ``owner_colors(trace)``.
        explain: frames carry the "why" box and the next events' steps (``render_frame_html(explain=...)``).
        changes: frames mark what changed since the step before.
        selected: the request whose block table the frames draw; ``"auto"`` (default): the first preempted
            request, else the first request; ``None``: no block table.

    Attributes:
        play: the ``widgets.Play`` (its value is ``jslink``ed to the slider).
        slider: the ``widgets.IntSlider``; its value is the step shown.
        stack: the ``widgets.Stack`` of ``widgets.HTML`` frames; ``selected_index`` follows the slider.
        style: a ``widgets.HTML`` holding the frames' style sheet (``FRAME_CSS``), shown once.
        frames: the HTML of every frame (without the style sheet).
        buttons: ``{"preemption" | "admission" | "finish": widgets.Button}`` that jump to the next such event
            (``jump``); a button is disabled when no such event follows the step shown.
        request: the ``widgets.Dropdown`` of request ids (plus ``"(none)"``) whose block table the frames draw.
        controls: the ``widgets.HBox`` of the buttons and the menu (DOM class ``mv-controls``).
        widget: the ``widgets.VBox`` that is displayed.

    Raises:
        ValueError: for an empty trace, ``start`` outside the trace, ``interval_ms < 50``, or ``selected`` not a
            request of the trace.

    Display it as the last expression of a cell (or ``display(animator)``). In a kernel, drive it with
    ``animator.step = k`` (Play only animates in a browser).
    """

    def __init__(
        self,
        trace: SchedulerTrace,
        *,
        interval_ms: int = 700,
        start: int = 0,
        max_blocks: int = 512,
        colors: Optional[Dict[str, str]] = None,
        explain: bool = True,
        changes: bool = True,
        selected: Union[str, None] = "auto",
    ) -> None:
        n = len(trace)
        if n == 0:
            raise ValueError("trace is empty: record the run with a SchedulerTrace (a TracedLLMEngine) and step it at least once")
        if not isinstance(start, int) or not 0 <= start < n:
            raise ValueError(f"start must be an int in [0, {n - 1}], got {start!r}")
        if interval_ms < 50:
            raise ValueError(f"interval_ms must be >= 50, got {interval_ms}")
        ids = request_order(trace)
        if selected == "auto":
            selected = _default_selected(trace)
        if selected is not None and selected not in ids:
            raise ValueError(f"selected must be None, 'auto' or a request id of the trace ({', '.join(ids)}), "
                             f"got {selected!r}")
        self.trace = trace
        self._colors = owner_colors(trace) if colors is None else colors
        self._max_blocks, self._explain, self._changes = max_blocks, explain, changes
        self.frames = self._render(selected)
        # one shared layout and style model instead of two per frame: a smaller notebook
        layout, style = widgets.Layout(), HTMLStyle()
        self.stack = widgets.Stack(
            [widgets.HTML(f, layout=layout, style=style) for f in self.frames], selected_index=start
        )
        self.slider = widgets.IntSlider(
            value=start, min=0, max=n - 1, step=1, description=_("step"), continuous_update=True,
            layout=widgets.Layout(width="420px"),
        )
        self.play = widgets.Play(value=start, min=0, max=n - 1, step=1, interval=interval_ms, description=_("play"))
        self._links = [
            widgets.jslink((self.play, "value"), (self.slider, "value")),
            # in the browser: works without a kernel (exported HTML)
            widgets.jsdlink((self.slider, "value"), (self.stack, "selected_index")),
            # in the kernel: keeps the Python-side state equal to what the browser shows
            widgets.dlink((self.slider, "value"), (self.stack, "selected_index")),
        ]
        self.buttons = {kind: widgets.Button(description=_(NEXT_LABELS[kind]), tooltip=_(_BUTTON_TOOLTIPS[kind]),
                                             layout=widgets.Layout(width="auto"))
                        for kind in EVENT_KINDS}
        for kind, button in self.buttons.items():
            button.on_click(lambda _b, kind=kind: self.jump(kind))
        # (label, value) pairs: the label of "none" is translated, the value stays _NONE
        self.request = widgets.Dropdown(options=[(_("(none)"), _NONE)] + [(i, i) for i in ids],
                                        value=_NONE if selected is None else selected,
                                        description=_("block table"), layout=widgets.Layout(width="260px"))
        self.request.observe(self._on_request, names="value")
        self.slider.observe(self._on_step, names="value")
        self._on_step()
        self.style = widgets.HTML(f"<style>{FRAME_CSS}</style>")
        # the buttons and the menu run Python: the slides (no kernel) hide them by this class (FRAME_CSS_SLIDES)
        self.controls = widgets.HBox(list(self.buttons.values()) + [self.request])
        self.controls.add_class("mv-controls")
        self.widget = widgets.VBox([self.style, widgets.HBox([self.play, self.slider]), self.controls, self.stack])

    def __len__(self) -> int:
        return len(self.frames)

    @property
    def step(self) -> int:
        """The step shown (the slider's value). Setting it moves the slider, Play and the stack; any order."""
        return self.slider.value

    @step.setter
    def step(self, k: int) -> None:
        if not isinstance(k, int) or not 0 <= k < len(self.frames):
            raise ValueError(f"step must be an int in [0, {len(self.frames) - 1}], got {k!r}")
        self.slider.value = k
        self.play.value = k

    @property
    def selected(self) -> Optional[str]:
        """The request whose block table the frames draw (``None``: none). Setting it re-renders every frame."""
        v = self.request.value
        return None if v == _NONE else v

    @selected.setter
    def selected(self, rid: Optional[str]) -> None:
        value = _NONE if rid is None else rid
        if value not in [v for _label, v in self.request.options]:
            raise ValueError(f"selected must be None or a request id of the trace, got {rid!r}")
        self.request.value = value

    def jump(self, kind: str) -> Optional[int]:
        """Show the next step after the one shown with an event of ``kind`` (``"preemption"``, ``"admission"``,
        ``"finish"``); returns that step, or ``None`` (and stays) when none follows.

        Raises:
            ValueError: for another ``kind``.
        """
        k = next_event(self.trace, self.step, kind)
        if k is not None:
            self.step = k
        return k

    def _render(self, selected: Optional[str]) -> List[str]:
        # the style sheet goes into the page once, the frames carry only their content
        return [
            render_frame_html(self.trace, k, colors=self._colors, max_blocks=self._max_blocks, with_css=False,
                              explain=self._explain, changes=self._changes, selected=selected)
            for k in range(len(self.trace))
        ]

    def _on_step(self, _change=None) -> None:
        for kind, button in self.buttons.items():
            button.disabled = next_event(self.trace, self.step, kind) is None

    def _on_request(self, _change=None) -> None:
        self.frames = self._render(self.selected)
        for child, html in zip(self.stack.children, self.frames):
            child.value = html

    def __repr__(self) -> str:
        return f"QueueAnimator({len(self.frames)} steps)"

    def _repr_mimebundle_(self, **kwargs):
        # the VBox's own text/plain repr would spell out every frame's HTML: keep the notebook's text short
        bundle = self.widget._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = repr(self)
        return bundle
