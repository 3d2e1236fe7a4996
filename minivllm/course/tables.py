"""The course's pandas tables in the learner's language: labels are translated when a table is shown, not when it
is built.

The notebooks build their tables with English labels (``"free blocks"``, ``"mean TTFT"``, ``"3: one request
(A)"``) and index them by those labels in the same cell (``table.loc["7: buggy (B)", "loads"]``,
``df.drop(columns=["preempted"])``). Translating the keys where the table is built would break that code in the
Chinese edition, whose code cells are the English ones. So the labels stay English in the data and
:func:`translated_labels` makes the copy that is displayed: every string label of the index and the columns, and
the axis names, through gettext in the context :data:`minivllm.i18n.TABLE_LABEL`. A label is in the catalog when
the code that writes it marks it with ``L_("...")`` (extracted by ``python -m minivllm.course.i18n_catalog
update``); any other label (a request id, a code name such as ``num_computed_tokens``, a number) is shown as it
is, even where the same words are translated elsewhere as part of a sentence. In English the copy equals the
table.
"""

from __future__ import annotations

from typing import Any, TypeVar

from minivllm.i18n import TABLE_LABEL, pgettext

T = TypeVar("T")


def _label(label: Any) -> Any:
    return pgettext(TABLE_LABEL, label) if isinstance(label, str) else label


def translated_labels(table: T) -> T:
    """A copy of ``table`` (a ``pandas.DataFrame`` or ``Series``) with its index and column labels, and the names
    of its axes, in the current language (:func:`minivllm.i18n.get_language`). Values are not touched: they are
    data (request ids, token counts) or code names. The levels of a MultiIndex are translated label by label.

    Raises ``TypeError`` for anything that is not a DataFrame or a Series."""
    import pandas as pd

    if isinstance(table, pd.DataFrame):
        out = table.rename(index=_label, columns=_label)
        out.columns = out.columns.set_names([_label(n) for n in out.columns.names])
    elif isinstance(table, pd.Series):
        out = table.rename(index=_label).rename(_label(table.name))
    else:
        raise TypeError(f"table must be a pandas DataFrame or Series, got {type(table).__name__}")
    out.index = out.index.set_names([_label(n) for n in out.index.names])
    return out
