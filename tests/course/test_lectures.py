"""The lecture materials in notebooks/lectures/ against the lecturer's guide and the notebooks.

* every lecture of the guide's course plan ("A course of seven 90-minute lectures covers it as: 00+01 (...), ...")
  has a run sheet ``lecture_NN.md`` and a quiz ``quiz_NN.md`` (NN = 01, 02, ... in the guide's order);
* a run sheet names the lecture's notebooks, and its segment table's minutes add up to the lecture's length;
* every notebook cell a run sheet or quiz cites as «NN · heading» exists: a markdown heading of notebook NN (the
  text after the ``#``s), or a FAQ tag such as ``[Q3-a]`` opening a code cell of that notebook;
* every quiz question (``### Q<n>.``) has a folded answer (``<details>`` ... ``</details>``), 6-10 per quiz.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NB_DIR = ROOT / "notebooks"
LECT_DIR = NB_DIR / "lectures"
GUIDE = NB_DIR / "LECTURERS_GUIDE.md"

NUMBER_WORDS = {"five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10}
CITE = re.compile(r"«(\d\d) · ([^»]+)»")
SEGMENT_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|", re.M)
QUESTION = re.compile(r"^### Q(\d+)\.", re.M)


def guide_lectures(text: str):
    """``[(notebooks, minutes)]`` for the guide's lectures, in order, e.g. ``[(("00", "01"), 90), ...]``."""
    m = re.search(r"A course of (\w+) (\d+)-minute lectures covers it as:(.*?)with 01-03", text, re.S)
    assert m, "the guide's course plan sentence was not found"
    count, minutes, plan = NUMBER_WORDS[m.group(1)], int(m.group(2)), " ".join(m.group(3).split())
    items = re.findall(r"(\d\d(?:\+\d\d)*) \(", plan)
    assert len(items) == count, (count, items)
    return [(tuple(item.split("+")), minutes) for item in items]


def segment_minutes(run_sheet: str):
    """The minutes column of the run sheet's segment table (rows ``| <n> | <minutes> | ...``)."""
    part = run_sheet.split("## Segments", 1)
    assert len(part) == 2, "no '## Segments' section"
    table = part[1].split("\n## ", 1)[0]
    return [int(m.group(2)) for m in SEGMENT_ROW.finditer(table)]


def stated_length(run_sheet: str) -> int:
    m = re.search(r"^Length: (\d+) minutes", run_sheet, re.M)
    assert m, "no 'Length: N minutes' line"
    return int(m.group(1))


def notebook_anchors(number: str):
    """Headings (text after the ``#``s) and FAQ-style tags (``[Q3-a]``) of notebook ``number``."""
    paths = sorted(NB_DIR.glob(f"{number}_*.ipynb"))
    assert len(paths) == 1, f"notebook {number}: {paths}"
    cells = json.loads(paths[0].read_text(encoding="utf-8"))["cells"]
    anchors = set()
    for cell in cells:
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if cell["cell_type"] == "markdown":
            anchors.update(" ".join(m.group(1).split()) for m in re.finditer(r"^#{1,6} (.+)$", src, re.M))
        elif cell["cell_type"] == "code":
            anchors.update(re.findall(r"^# (\[Q\d-[a-z]\])", src, re.M))
    return anchors


def missing_citations(text: str):
    cache, missing = {}, []
    for number, heading in CITE.findall(text):
        if number not in cache:
            cache[number] = notebook_anchors(number)
        heading = " ".join(heading.split())  # a citation may wrap across lines
        if heading not in cache[number]:
            missing.append(f"«{number} · {heading}»")
    return missing


def unanswered_questions(quiz: str):
    """Question numbers whose text (up to the next question) has no complete ``<details>`` block."""
    starts = [(m.start(), m.group(1)) for m in QUESTION.finditer(quiz)]
    bad = []
    for i, (pos, n) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else len(quiz)
        body = quiz[pos:end]
        if not re.search(r"<details>.*?<summary>.*?</summary>.+?</details>", body, re.S):
            bad.append(n)
    return bad


LECTURES = guide_lectures(GUIDE.read_text(encoding="utf-8"))
IDS = [f"lecture_{i:02d}" for i in range(1, len(LECTURES) + 1)]


def test_guide_plan_parsed():
    assert len(LECTURES) >= 6 and all(minutes > 0 for _, minutes in LECTURES)


@pytest.mark.parametrize("index", range(len(LECTURES)), ids=IDS)
def test_run_sheet(index):
    notebooks, minutes = LECTURES[index]
    path = LECT_DIR / f"lecture_{index + 1:02d}.md"
    assert path.exists(), f"{path.name} missing"
    text = path.read_text(encoding="utf-8")
    header = text.split("\n## ", 1)[0]
    for nb in notebooks:
        assert re.search(rf"\b{nb}_", header), f"{path.name}: notebook {nb} not named in the header"
    assert stated_length(text) == minutes, f"{path.name}: stated length differs from the guide's {minutes}"
    segs = segment_minutes(text)
    assert len(segs) >= 4, f"{path.name}: fewer than 4 segments"
    assert sum(segs) == minutes, f"{path.name}: segments add up to {sum(segs)} minutes, the lecture is {minutes}"
    assert not missing_citations(text), f"{path.name}: cited cells not in the notebook: {missing_citations(text)}"


@pytest.mark.parametrize("index", range(len(LECTURES)), ids=[i.replace("lecture", "quiz") for i in IDS])
def test_quiz(index):
    path = LECT_DIR / f"quiz_{index + 1:02d}.md"
    assert path.exists(), f"{path.name} missing"
    text = path.read_text(encoding="utf-8")
    numbers = [int(n) for n in QUESTION.findall(text)]
    assert 6 <= len(numbers) <= 10, f"{path.name}: {len(numbers)} questions"
    assert numbers == list(range(1, len(numbers) + 1)), f"{path.name}: questions not numbered 1..n"
    assert not unanswered_questions(text), f"{path.name}: no answer block for Q{unanswered_questions(text)}"
    assert not missing_citations(text), f"{path.name}: cited cells not in the notebook: {missing_citations(text)}"


def test_exam_bank_and_index():
    bank = (LECT_DIR / "exam_bank.md").read_text(encoding="utf-8")
    questions = re.findall(r"^### E(\d+)\.", bank, re.M)
    assert 20 <= len(questions) <= 30
    assert bank.count("**Model answer.**") == len(questions) and bank.count("**Marking.**") == len(questions)
    assert not missing_citations(bank)
    index = (LECT_DIR / "README.md").read_text(encoding="utf-8")
    for i in range(1, len(LECTURES) + 1):
        assert f"lecture_{i:02d}.md" in index and f"quiz_{i:02d}.md" in index


def test_checks_can_fail():
    """The checks above detect a changed segment, a missing answer and a wrong heading."""
    sheet = (LECT_DIR / "lecture_01.md").read_text(encoding="utf-8")
    segs = segment_minutes(sheet)
    changed = SEGMENT_ROW.sub(lambda m: f"| {m.group(1)} | {int(m.group(2)) + 5} |", sheet, count=1)
    assert sum(segment_minutes(changed)) == sum(segs) + 5 != LECTURES[0][1]
    quiz = (LECT_DIR / "quiz_01.md").read_text(encoding="utf-8")
    assert unanswered_questions(quiz.replace("</details>", "", 1))
    assert missing_citations("«05 · 2. What the scheduler does: 64, 64, 33»")
    assert not missing_citations("«05 · 2. What the scheduler does: 64, 64, 32» «10 · [Q3-a]»")
