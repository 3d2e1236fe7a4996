"""Table labels in the learner's language (issue 30): ``L_`` marks a label for the catalog in its own gettext
context, :func:`minivllm.course.tables.translated_labels` shows a table's labels translated while the data keeps
its English ones (the notebooks index their tables by them), and the Chinese edition's stored tables show no
English label that the catalog translates."""

import json
import re
from pathlib import Path

import pandas as pd
import pytest

from minivllm import i18n
from minivllm.course import i18n_catalog
from minivllm.course.tables import translated_labels

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def english_after():
    yield
    i18n.set_language("en")


def _trace_table():
    frame = pd.DataFrame({"step": [0, 1], "free blocks": [3, 4], "prompt tokens": [7, 8], "positions": [5, 6]})
    return frame.set_index("step")


def test_english_shows_the_table_unchanged(english_after):
    i18n.set_language("en")
    table = _trace_table()
    shown = translated_labels(table)
    assert shown.equals(table) and list(shown.columns) == list(table.columns) and shown.index.name == "step"
    assert shown is not table


def test_chinese_translates_marked_labels_and_axis_names_only(english_after):
    table = _trace_table()
    i18n.set_language("zh_CN")
    shown = translated_labels(table)
    # "positions" is a model-runner name, not marked: it stays, although the catalog translates the word in prose
    assert list(shown.columns) == ["空闲块", "prompt token 数", "positions"]
    assert shown.index.name == "步" and list(shown.index) == [0, 1]
    assert list(table.columns) == ["free blocks", "prompt tokens", "positions"]   # the data keeps English labels
    assert table.loc[1, "free blocks"] == 4
    series = translated_labels(table["free blocks"])
    assert series.name == "空闲块" and series.index.name == "步"


def test_a_label_is_translated_apart_from_the_same_words_in_a_sentence(english_after):
    i18n.set_language("zh_CN")
    # the sentence fragment and the column label have the same msgid and different translations
    assert i18n._("prompt tokens") != i18n.pgettext(i18n.TABLE_LABEL, "prompt tokens") == "prompt token 数"
    assert i18n.L_("free blocks") == "free blocks"   # the marker never translates


def test_translated_labels_refuses_what_is_not_a_table():
    with pytest.raises(TypeError, match="table must be a pandas DataFrame or Series"):
        translated_labels([("free blocks", 3)])


def test_trace_table_columns_are_marked_for_the_catalog():
    pot = i18n_catalog.template()
    labels = {m.id for m in pot if m.id and m.context == i18n.TABLE_LABEL}
    assert {"step", "waiting", "running", "scheduled (P=prefill, D=decode)", "tokens", "preempted", "finished",
            "free blocks", "scheduler side", "worker side"} <= labels
    # the notebooks' own labels are extracted from their code cells with the same context
    assert {"3: one request (A)", "mean TTFT", "whole model", "rows not at the LM head"} <= labels


def _text_outputs(cell):
    out = []
    for o in cell.get("outputs", []):
        text = o.get("text") or o.get("data", {}).get("text/plain") or ""
        out.append("".join(text) if isinstance(text, list) else text)
    return "\n".join(out)


def test_the_chinese_edition_shows_no_translated_label_in_english():
    """Every stored table of a Chinese notebook's ``translated_labels(...)`` cell is free of the English labels
    that the catalog translates and that the English notebook's same cell shows (multi-word labels, so that a
    word such as ``step`` inside a value does not count)."""
    with open(i18n_catalog.po_path("zh_CN"), "rb") as f:
        from babel.messages.pofile import read_po

        catalog = read_po(f)
    labels = [m.id for m in catalog if m.id and m.context == i18n.TABLE_LABEL and m.string and m.string != m.id
              and re.search(r"[ %]", m.id)]
    assert len(labels) > 40
    checked = 0
    for english in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        chinese = ROOT / "notebooks" / "zh-CN" / english.name
        en_cells = {c["id"]: c for c in json.loads(english.read_text(encoding="utf-8"))["cells"]}
        for cell in json.loads(chinese.read_text(encoding="utf-8"))["cells"]:
            src = "".join(cell["source"])
            if cell["cell_type"] != "code" or "translated_labels(" not in src:
                continue
            en_out, zh_out = _text_outputs(en_cells[cell["id"]]), _text_outputs(cell)
            shown = [lab for lab in labels if lab in en_out]
            left = [lab for lab in shown if lab in zh_out]
            assert not left, f"{chinese.name} cell {cell['id']} shows {left} in English: re-execute it"
            checked += len(shown)
    assert checked > 60
