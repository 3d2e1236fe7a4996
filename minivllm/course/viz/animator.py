"""The queue animator: a Play button and a step slider over a recorded run.

Every frame is rendered to HTML once, up front, and the frames sit in a ``widgets.Stack``; the slider's value is
linked to the stack's ``selected_index`` *in the browser* (``jsdlink``). Switching frames therefore needs no
Python: the animation plays in JupyterLab, and also in a notebook exported to HTML and opened without a kernel.
A Python-side link does the same while a kernel is alive, so ``animator.step = k`` is visible to code and tests.
"""

from __future__ import annotations

from typing import Dict, Optional

import ipywidgets as widgets
from ipywidgets.widgets.widget_string import HTMLStyle

from minivllm.course.trace import SchedulerTrace
from minivllm.course.viz.colors import owner_colors
from minivllm.course.viz.frame import FRAME_CSS, render_frame_html


class QueueAnimator:
    """Step through a ``SchedulerTrace`` with Play / slider; one pre-rendered frame per engine step.

    Args:
        trace: a recorded run (``TracedLLMEngine(...).trace``), at least one step.
        interval_ms: milliseconds between frames while playing (>= 50).
        start: the step shown first.
        max_blocks: KV blocks drawn per frame (see ``render_frame_html``).
        colors: ``request id -> colour``; default ``owner_colors(trace)``.

    Attributes:
        play: the ``widgets.Play`` (its value is ``jslink``ed to the slider).
        slider: the ``widgets.IntSlider``; its value is the step shown.
        stack: the ``widgets.Stack`` of ``widgets.HTML`` frames; ``selected_index`` follows the slider.
        style: a ``widgets.HTML`` holding the frames' style sheet (``FRAME_CSS``), shown once.
        frames: the HTML of every frame (without the style sheet).
        widget: the ``widgets.VBox`` that is displayed.

    Raises:
        ValueError: for an empty trace, ``start`` outside the trace, or ``interval_ms < 50``.

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
    ) -> None:
        n = len(trace)
        if n == 0:
            raise ValueError("trace is empty: record the run with a SchedulerTrace (a TracedLLMEngine) and step it at least once")
        if not isinstance(start, int) or not 0 <= start < n:
            raise ValueError(f"start must be an int in [0, {n - 1}], got {start!r}")
        if interval_ms < 50:
            raise ValueError(f"interval_ms must be >= 50, got {interval_ms}")
        self.trace = trace
        colors = owner_colors(trace) if colors is None else colors
        # the style sheet goes into the page once, the frames carry only their content
        self.frames = [
            render_frame_html(trace, k, colors=colors, max_blocks=max_blocks, with_css=False) for k in range(n)
        ]
        # one shared layout and style model instead of two per frame: a smaller notebook
        layout, style = widgets.Layout(), HTMLStyle()
        self.stack = widgets.Stack(
            [widgets.HTML(f, layout=layout, style=style) for f in self.frames], selected_index=start
        )
        self.slider = widgets.IntSlider(
            value=start, min=0, max=n - 1, step=1, description="step", continuous_update=True,
            layout=widgets.Layout(width="420px"),
        )
        self.play = widgets.Play(value=start, min=0, max=n - 1, step=1, interval=interval_ms, description="play")
        self._links = [
            widgets.jslink((self.play, "value"), (self.slider, "value")),
            # in the browser: works without a kernel (exported HTML)
            widgets.jsdlink((self.slider, "value"), (self.stack, "selected_index")),
            # in the kernel: keeps the Python-side state equal to what the browser shows
            widgets.dlink((self.slider, "value"), (self.stack, "selected_index")),
        ]
        self.style = widgets.HTML(f"<style>{FRAME_CSS}</style>")
        self.widget = widgets.VBox([self.style, widgets.HBox([self.play, self.slider]), self.stack])

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

    def __repr__(self) -> str:
        return f"QueueAnimator({len(self.frames)} steps)"

    def _repr_mimebundle_(self, **kwargs):
        # the VBox's own text/plain repr would spell out every frame's HTML: keep the notebook's text short
        bundle = self.widget._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = repr(self)
        return bundle
