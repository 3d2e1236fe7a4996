"""The lecturer's materials in Chinese (notebooks/lectures/zh-CN/, issue 30): every English file has its Chinese
one, with the same lecture structure, so that a lecturer teaching from the Chinese edition has the same run sheets,
quizzes and exam bank, and the Chinese decks get the run sheets as speaker notes.

* each run sheet parses to the same segments (numbers, minutes, how many cells each cites) as the English one, and
  every «NN · heading» it cites is a heading of the Chinese notebook NN (notebooks/zh-CN/);
* each quiz has the English quiz's questions, each with its answer block; the exam bank its questions, each with a
  model answer and marking;
* the speaker notes of every Chinese deck are built from them without a missing anchor.
"""

import json
import re
from pathlib import Path

import pytest

from minivllm.course import slides

ROOT = Path(__file__).resolve().parents[2]
LECT = ROOT / "notebooks" / "lectures"
LECT_ZH = LECT / "zh-CN"
ZH = ROOT / "notebooks" / "zh-CN"
CJK = re.compile(r"[\u4e00-\u9fff]")
CITE = re.compile(r"«(\d\d) · ([^»]+)»")
QUESTION = re.compile(r"^### Q(\d+)\.", re.M)
ENGLISH = sorted(p.name for p in LECT.glob("*.md"))


def _zh_anchors(number):
    paths = sorted(ZH.glob(f"{number}_*.ipynb"))
    assert len(paths) == 1, paths
    anchors = set()
    for cell in json.loads(paths[0].read_text(encoding="utf-8"))["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            anchors.update(" ".join(m.group(1).split()) for m in re.finditer(r"^#{1,6} (.+)$", src, re.M))
        else:
            anchors.update(re.findall(r"^# (\[Q\d-[a-z]\])", src, re.M))
    return anchors


@pytest.mark.parametrize("name", ENGLISH)
def test_every_lecture_file_has_its_chinese_one(name):
    zh = LECT_ZH / name
    assert zh.exists(), f"notebooks/lectures/zh-CN/{name} missing"
    text = zh.read_text(encoding="utf-8")
    assert len(CJK.findall(text)) > 0.3 * len(text.split()), f"{name}: not written in Chinese"
    missing = [f"«{n} · {h}»" for n, h in CITE.findall(text) if " ".join(h.split()) not in _zh_anchors(n)]
    assert missing == [], f"{name}: cites headings the Chinese notebooks lack: {missing}"


@pytest.mark.parametrize("name", [n for n in ENGLISH if n.startswith("lecture_")])
def test_run_sheets_keep_the_english_segments(name):
    en = slides.run_sheet_segments((LECT / name).read_text(encoding="utf-8"))
    zh = slides.run_sheet_segments((LECT_ZH / name).read_text(encoding="utf-8"))
    shape = lambda segs: [(g["number"], g["minutes"], len(g["cited"])) for g in segs]  # noqa: E731
    assert shape(zh) == shape(en)
    # in Chinese (a title that is one vLLM term, "roofline", may stay as it is)
    assert sum(bool(CJK.search(g["title"])) for g in zh) >= len(zh) - 1, [g["title"] for g in zh]


@pytest.mark.parametrize("name", [n for n in ENGLISH if n.startswith("quiz_")] + ["exam_bank.md"])
def test_quizzes_and_exam_keep_their_questions_and_answers(name):
    en = (LECT / name).read_text(encoding="utf-8")
    zh = (LECT_ZH / name).read_text(encoding="utf-8")
    if name == "exam_bank.md":
        assert re.findall(r"^### E(\d+)\.", zh, re.M) == re.findall(r"^### E(\d+)\.", en, re.M)
    else:
        assert QUESTION.findall(zh) == QUESTION.findall(en)
        assert zh.count("<details>") == en.count("<details>") and zh.count("</details>") == en.count("</details>")


def test_the_chinese_decks_get_the_chinese_run_sheets_as_speaker_notes():
    import nbformat

    notes = slides.lecture_notes(LECT_ZH)
    for stem in slides.SLIDE_NOTEBOOKS:
        nb = nbformat.read(ZH / f"{stem}.ipynb", as_version=4)
        slides.add_notes(nb, notes.get(stem, []), stem)  # raises KeyError for a cited heading the deck lacks
        assert notes.get(stem), f"{stem}: no speaker notes"
