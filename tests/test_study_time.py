"""Study time: the estimate's arithmetic, the notebooks' headers and the lecturer's guide agree with it (within
``TOLERANCE_MIN``, so an edit of a few paragraphs does not break them), and the guide lists every exercise."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from minivllm.course import study_time as st

ROOT = Path(__file__).resolve().parents[1]
GUIDE = (ROOT / "notebooks" / "LECTURERS_GUIDE.md").read_text(encoding="utf-8")


def _cells(path):
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def test_estimate_counts_and_rates():
    cells = [
        {"cell_type": "markdown", "source": "# Title\n\nSome words [a link](http://x.y/z) here ![img](a.png)\n中文导读"},
        {"cell_type": "code", "source": "x = 1\n\ny = 2\n", "outputs": []},
        {"cell_type": "code", "source": "def f(a):\n    raise NotImplementedError\n", "outputs": []},
        {"cell_type": "code", "source": "# Solution\ndef f(a):\n    raise NotImplementedError\n", "outputs": []},
    ]
    t = st.estimate(cells)
    assert (t.words, t.cjk_chars, t.code_lines, t.code_cells, t.exercises) == (6, 4, 7, 3, 1)  # Title Some words a link here
    want = 6 / st.WORDS_PER_MIN + 4 / st.CJK_CHARS_PER_MIN + 7 / st.CODE_LINES_PER_MIN + 3 * st.SECONDS_PER_CELL / 60 \
        + st.MINUTES_PER_EXERCISE
    assert t.minutes == pytest.approx(want)
    assert t.rounded == 10  # 10.x minutes
    assert st.exercise_names(cells) == ["f"]


def test_rounding():
    mk = lambda m: st.StudyTime(0, 0, 0, 0, 0, m)  # noqa: E731
    assert [mk(m).rounded for m in (0.5, 7.4, 7.5, 12.6, 62.4)] == [5, 5, 10, 15, 60]


@pytest.mark.parametrize("path", st.notebooks(), ids=lambda p: p.name)
def test_header_states_the_study_time(path):
    cells = _cells(path)
    stated, t = st.stated_minutes(cells), st.estimate(cells)
    assert stated is not None, f"{path.name}: no '**Study time:** about N minutes' line in the first cell; run " \
                               "`python -m minivllm.course.study_time update`"
    assert abs(stated - t.rounded) <= st.TOLERANCE_MIN, (
        f"{path.name}: header says {stated} min, the estimate is {t.rounded} min; run "
        "`python -m minivllm.course.study_time update` and update notebooks/LECTURERS_GUIDE.md")


def test_guide_syllabus_matches_the_estimates():
    rows = dict(re.findall(r"^\| `(\d\d_\w+)` \| (\d+) min \|", GUIDE, flags=re.M))
    assert sorted(rows) == [p.stem for p in st.notebooks()]
    for p in st.notebooks():
        assert abs(int(rows[p.stem]) - st.notebook_estimate(p).rounded) <= st.TOLERANCE_MIN, p.stem
    assert f"{st.WORDS_PER_MIN} words a minute" in GUIDE and f"{st.CODE_LINES_PER_MIN} lines a minute" in GUIDE
    assert f"{st.SECONDS_PER_CELL} seconds per code cell" in GUIDE
    assert f"{st.MINUTES_PER_EXERCISE}\nminutes per" in GUIDE or f"{st.MINUTES_PER_EXERCISE} minutes per" in GUIDE


def test_guide_lists_every_exercise():
    section = GUIDE.split("## Exercises", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| (\d\d) \| `(\w+)` \| `check_\w+` \| ★+ \|", section, flags=re.M))
    in_notebooks = {(p.stem[:2], name) for p in st.notebooks() for name in st.exercise_names(_cells(p))}
    assert listed == in_notebooks, (f"missing from the guide: {sorted(in_notebooks - listed)}; "
                                    f"listed but not in a notebook: {sorted(listed - in_notebooks)}")


def test_update_writes_one_line(tmp_path):
    nb = {"cells": [{"cell_type": "markdown", "id": "a", "metadata": {}, "source": "# T\n\nText."},
                    {"cell_type": "code", "id": "b", "metadata": {}, "source": "x = 1", "outputs": [],
                     "execution_count": None}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    p = tmp_path / "n.ipynb"
    p.write_text(json.dumps(nb))
    assert st.update(p) is True and st.update(p) is False
    head = json.loads(p.read_text())["cells"][0]["source"]
    head = "".join(head) if isinstance(head, list) else head
    assert head.count("**Study time:**") == 1 and "about 5 minutes" in head
