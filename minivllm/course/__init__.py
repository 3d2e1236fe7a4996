"""The course's tools, on top of the engine: they import the engine, the engine never imports them.

Files: ``trace`` (``SchedulerTrace``: one ``StepRecord`` per engine step), ``viz/`` (queue animator, frames,
the why of each step, timeline and block-pool plots of a trace), ``exercises/`` (checkers for the notebooks' "Your turn" cells),
``figures`` (``python -m minivllm figures``), ``batching`` (static versus continuous batching drivers of notebook
04), ``recording_connector`` (a KV connector wrapper that records every call), ``buggy_connector`` (the classic
connector mistake of notebook 08), ``calls_view`` (notebook 08's widget of connector calls per step).

vLLM has no counterpart: these exist to show what the engine does, step by step.
"""

# The course's language switch (English by default; the Chinese edition's notebooks call set_language("zh_CN")):
# re-exported from minivllm.i18n, where the engine's few translated errors read it too.
from minivllm.i18n import get_language, set_language  # noqa: E402,F401

__all__ = ["get_language", "set_language"]
