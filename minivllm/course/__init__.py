"""The course's tools, on top of the engine: they import the engine, the engine never imports them.

Files: ``trace`` (``SchedulerTrace``: one ``StepRecord`` per engine step), ``viz/`` (queue animator, frames,
the why of each step, timeline and block-pool plots of a trace), ``exercises/`` (checkers for the notebooks' "Your turn" cells),
``figures`` (``python -m minivllm figures``), ``batching`` (static versus continuous batching drivers of notebook
04), ``recording_connector`` (a KV connector wrapper that records every call), ``buggy_connector`` (the classic
connector mistake of notebook 08), ``calls_view`` (notebook 08's widget of connector calls per step).

vLLM has no counterpart: these exist to show what the engine does, step by step.
"""

# The course's language switch (English by default; the Chinese edition's notebooks call set_language("zh_CN")):
# minivllm.i18n holds the language, where the engine's few translated errors read it too.
from minivllm.i18n import get_language  # noqa: E402,F401
from minivllm.i18n import set_language as _set_messages_language  # noqa: E402


def set_language(language: str) -> str:
    """Switch the package's messages to ``language`` (:func:`minivllm.i18n.set_language`: ``"en"`` or
    ``"zh_CN"``; returns the normalised language; ``ValueError`` for any other value, nothing changed) and, in
    Chinese, make matplotlib able to draw Chinese from now on (:func:`minivllm.course.viz.fonts.use_language_font`).

    The font has to be in ``rcParams["font.family"]`` before a notebook creates its axes: an axes' title and axis
    labels take their font when the axes are made, so a course function that later writes Chinese into axes the
    notebook made (``plot_timeline(trace, ax)``, ``draw_block_table_map(..., ax=ax)``) would draw empty boxes.
    In Chinese, pandas also counts a Chinese character as two columns when it prints a table (its option
    ``display.unicode.east_asian_width``), so that the translated labels line up.
    Raises as :func:`~minivllm.course.viz.fonts.cjk_font_path` (``mplfonts`` missing), in Chinese only, after the
    messages have switched."""
    lang = _set_messages_language(language)
    from minivllm.course.viz.fonts import use_language_font  # matplotlib only when the language is set

    use_language_font()
    _align_wide_characters(lang == "zh_CN")
    return lang


def _align_wide_characters(on: bool) -> None:
    # A Chinese character takes two columns in a terminal or a notebook's text output; pandas counts one unless
    # told, and a table printed with Chinese labels (``print(translated_labels(df).to_string())``) comes out
    # with its columns askew.
    import pandas as pd

    pd.set_option("display.unicode.east_asian_width", on)


__all__ = ["get_language", "set_language"]
