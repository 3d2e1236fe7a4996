"""Study time: the estimate's arithmetic, the notebooks' headers and the lecturer's guide agree with it (within
``TOLERANCE_MIN``, so an edit of a few paragraphs does not break them), and the guide lists every exercise."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from minivllm.course import study_time as st

ROOT = Path(__file__).resolve().parents[2]
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
    t = st.estimate(cells, {"f": 1})
    assert (t.words, t.cjk_chars, t.code_lines, t.code_cells, t.exercises) == (6, 4, 7, 3, 1)  # Title Some words a link here
    want = 6 / st.WORDS_PER_MIN + 4 / st.CJK_CHARS_PER_MIN + 7 / st.CODE_LINES_PER_MIN + 3 * st.SECONDS_PER_CELL / 60 \
        + st.MINUTES_PER_STARS[1]
    assert t.minutes == pytest.approx(want)
    assert t.rounded == 10  # 10.x minutes
    assert st.exercise_names(cells) == ["f"]
    # the difficulty weighs: ★★★ adds 30 minutes to ★'s 10
    assert st.estimate(cells, {"f": 3}).minutes == pytest.approx(want + 30)
    assert st.estimate(cells, {"f": 3}).exercise_minutes == 40
    with pytest.raises(ValueError, match="no difficulty.*'f'"):
        st.estimate(cells)
    with pytest.raises(ValueError, match="1, 2 or 3"):
        st.estimate(cells, {"f": 4})
    pred = cells + [{"cell_type": "code", "source": "predicted = None  # your prediction, e.g. [1]\ncheck_p(predicted)",
                     "outputs": []}]
    assert st.prediction_names(pred) == ["predicted"]
    assert st.estimate(pred, {"f": 1, "predicted": 2}).exercise_minutes == 30
    with pytest.raises(KeyError, match="EXERCISE_STARS"):
        st.exercise_stars("99", cells)


def test_rounding():
    mk = lambda m: st.StudyTime(0, 0, 0, 0, 0, m)  # noqa: E731
    assert [mk(m).rounded for m in (0.5, 7.4, 7.5, 12.6, 62.4)] == [5, 5, 10, 15, 60]


@pytest.mark.parametrize("path", st.notebooks(), ids=lambda p: p.name)
def test_header_states_the_study_time(path):
    cells = _cells(path)
    stated, t = st.stated_minutes(cells), st.notebook_estimate(path)
    assert stated is not None, f"{path.name}: no '**Time:** about N minutes of study' line in the first cell; run " \
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
    weights = " ".join(GUIDE.split("## How study time is estimated", 1)[1].split("## Syllabus", 1)[0].split())
    assert ", ".join(f"{'★' * k} {m} minutes" for k, m in st.MINUTES_PER_STARS.items()) in weights
    hours = sum(st.notebook_estimate(p).rounded for p in st.notebooks()) / 60
    m = re.search(r"In total about (\d+) hours of study, about (\d+) of them for the (\d+) exercises", GUIDE)
    assert m and abs(int(m.group(1)) - hours) <= 0.5, (m and m.group(0), hours)
    ex = [st.notebook_estimate(p) for p in st.notebooks()]
    assert int(m.group(3)) == sum(t.exercises for t in ex)
    assert abs(int(m.group(2)) - sum(t.exercise_minutes for t in ex) / 60) <= 0.5


@pytest.mark.parametrize("path", st.notebooks(), ids=lambda p: p.name)
def test_one_time_line_per_notebook(path):
    """The issue: contradictory "Time" headers. A notebook states its time once: the study time, then how long its
    cells run, in one line."""
    lines = st.time_lines(_cells(path))
    assert len(lines) == 1 and st.HEADER_RE.search(lines[0]), (path.name, lines)
    assert len(st.time_lines([{"cell_type": "markdown", "source": "**Run time:** a minute.\n" + lines[0]}])) == 2


def test_guide_stars_are_the_weights_used():
    """The guide's exercise table (★ column) and ``EXERCISE_STARS`` agree, so the stated difficulty is the one
    that weighs the study time."""
    section = GUIDE.split("## Exercises", 1)[1].split("\n## ", 1)[0]
    listed = {(nb, name): len(stars) for nb, name, stars in
              re.findall(r"^\| (\d\d) \| `(\w+)` \| `check_\w+` \| (★+) \|", section, flags=re.M)}
    listed[("05", "predicted")] = len(re.search(r"`predicted`, checked by `check_chunk_prediction`, (★+)",
                                                " ".join(section.split())).group(1))
    assert listed == st.EXERCISE_STARS


def test_guide_lists_every_exercise():
    section = GUIDE.split("## Exercises", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| (\d\d) \| `(\w+)` \| `check_\w+` \| ★+ \|", section, flags=re.M))
    listed.add(("05", "predicted"))  # stated in the prose under the table
    # predictions (``name = None  # your prediction``, checked by check_prediction) are rows of the table too
    in_notebooks = {(p.stem[:2], name) for p in st.notebooks()
                    for name in st.exercise_names(_cells(p)) + st.prediction_names(_cells(p))}
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
    assert head.count("**Time:**") == 1 and "about 5 minutes of study" in head
