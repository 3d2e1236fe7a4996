"""notebooks/LECTURERS_GUIDE.zh-CN.md is the lecturer's guide in Chinese (issue 30), for a lecturer who teaches from
the Chinese edition (notebooks/zh-CN/). It follows the English guide section for section, so that a change of the
English one (``python -m minivllm.course.study_time update`` rewriting a study time, a new exercise, a changed
command) that is not carried into the Chinese one fails here:

* the same ``##`` / ``###`` sections in the same order, with Chinese headings;
* in each section the same tables, each with the same number of rows and columns; the syllabus gives each notebook
  the English study time and links the Chinese edition's notebook; the exercise table's rows are the English ones;
* every number of an English section (study times, rates, counts, ports, limits) occurs in the Chinese section at
  least as often, and every number of an English table row in the Chinese row;
* the same code blocks (comments may be translated) and the same inline code, a ``notebooks/`` path allowed to
  name its Chinese edition (``notebooks/zh-CN/...``), an ``images/`` figure its Chinese one (``images/zh-CN/...``);
* the two guides link each other at their top; a link to a notebook goes to the Chinese edition; the lecture
  lecture files it links are the Chinese ones (lectures/zh-CN/) or marked 英文; every relative link resolves;
* the glossary's forbidden forms (块 for a chunk, 令牌 for token, ...) do not occur.

The Chinese guide may say more than the English one (where the Chinese edition differs); it may not say less.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from tests.course.test_chinese import forbidden_uses

ROOT = Path(__file__).resolve().parents[2]
NB_DIR = ROOT / "notebooks"
GUIDE = NB_DIR / "LECTURERS_GUIDE.md"
GUIDE_ZH = NB_DIR / "LECTURERS_GUIDE.zh-CN.md"
CJK = re.compile(r"[\u4e00-\u9fff]")
NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def sections(text: str):
    """``[(heading line, body)]`` of the ``##`` / ``###`` sections, code fences skipped when looking for headings;
    the text before the first one is the section ``("", ...)``."""
    out, head, body, fence = [], "", [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        if not fence and re.match(r"^#{2,3} ", line):
            out.append((head, "\n".join(body)))
            head, body = line, []
        else:
            body.append(line)
    out.append((head, "\n".join(body)))
    return out


def tables(body: str):
    """The markdown tables of ``body``: each a list of rows, a row the list of its stripped cells (the
    ``|---|`` line left out)."""
    found, rows = [], []
    for line in body.splitlines() + [""]:
        if line.startswith("|"):
            if not re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", line.strip()):
                rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif rows:
            found.append(rows)
            rows = []
    return found


def numbers(text: str) -> Counter:
    """How often each number occurs in ``text``."""
    return Counter(NUMBER.findall(text))


def code_blocks(text: str):
    """Code blocks without their comments (a comment may be translated)."""
    out = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        lines = [ln.split("  #")[0].rstrip() for ln in block.splitlines() if not ln.lstrip().startswith("#")]
        out.append(lines)
    return out


def inline_code(text: str):
    """Inline code spans outside code blocks, whitespace normalised (a span may wrap across lines)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return {" ".join(span.split()) for span in re.findall(r"`([^`]+)`", text)}


EN = sections(_text(GUIDE))
ZH = sections(_text(GUIDE_ZH))
PAIRS = list(zip(EN, ZH))
IDS = [h_en.lstrip("# ") or "(top)" for (h_en, _), _ in PAIRS]


def test_the_same_sections_in_the_same_order():
    assert len(EN) > 5
    assert [h.split(" ")[0] for h, _ in ZH] == [h.split(" ")[0] for h, _ in EN], (
        "LECTURERS_GUIDE.zh-CN.md's ## / ### headings must follow LECTURERS_GUIDE.md's one for one:\n"
        + "\n".join(f"{e[0]!r:50} {z[0] if z else None!r}" for e, z in zip(EN, ZH + [None] * (len(EN) - len(ZH)))))
    for (h_en, _), (h_zh, body) in PAIRS[1:]:
        assert CJK.search(h_zh), f"{h_zh!r} (for {h_en!r}) is not in Chinese"
        assert re.findall(r"`[^`]+`", h_en) == re.findall(r"`[^`]+`", h_zh), (h_en, h_zh)
        assert len(CJK.findall(body)) >= 0.1 * len(body.split()), f"the section {h_zh!r} is not written in Chinese"


@pytest.mark.parametrize("index", range(len(PAIRS)), ids=IDS)
def test_the_same_tables(index):
    (h_en, b_en), (h_zh, b_zh) = PAIRS[index]
    t_en, t_zh = tables(b_en), tables(b_zh)
    assert [len(t) for t in t_zh] == [len(t) for t in t_en], f"{h_zh}: tables and their rows differ from {h_en}'s"
    for rows_en, rows_zh in zip(t_en, t_zh):
        assert [len(r) for r in rows_zh] == [len(r) for r in rows_en], f"{h_zh}: a row's columns differ"
        for r_en, r_zh in zip(rows_en[1:], rows_zh[1:]):
            missing = numbers(" | ".join(r_en)) - numbers(" | ".join(r_zh))
            assert not missing, f"{h_zh}: the row for {r_en[0]} lacks the English row's numbers {sorted(missing)}"


@pytest.mark.parametrize("index", range(len(PAIRS)), ids=IDS)
def test_every_number_of_a_section_is_in_its_translation(index):
    (h_en, b_en), (h_zh, b_zh) = PAIRS[index]
    missing = numbers(b_en) - numbers(b_zh)
    assert not missing, f"{h_zh} lacks these numbers of {h_en}: {sorted(missing)}"


def _section(pairs, english_heading):
    return next((en, zh) for en, zh in pairs if en[0] == english_heading)


def test_the_syllabus_states_the_english_study_times_and_links_the_chinese_notebooks():
    (_, b_en), (_, b_zh) = _section(PAIRS, "## Syllabus")
    en = dict(re.findall(r"^\| `(\d\d_\w+)` \| (\d+) min \|", b_en, flags=re.M))
    zh = re.findall(r"^\| \[`(\d\d_\w+)`\]\(([^)]+)\) \| (\d+) 分钟 \|", b_zh, flags=re.M)
    assert len(en) >= 14 and {stem: minutes for stem, _, minutes in zh} == en
    assert [stem for stem, _, _ in zh] == list(en)  # the same order
    for stem, target, _ in zh:
        assert target == f"zh-CN/{stem}.ipynb" and (NB_DIR / f"{stem}.ipynb").exists(), (stem, target)
    total = re.search(r"In total about (\d+) hours of study, about (\d+) of them for the (\d+) exercises", b_en)
    assert total, "the English guide's total sentence was not found"
    h, ex_h, n = total.groups()
    assert re.search(rf"合计约 {h} 小时学习时间，其中约 {ex_h} 小时用于 {n} 个练习", b_zh), (h, ex_h, n)
    plan = re.search(r"A course of \w+ (\d+)-minute lectures covers it as:(.*?)with 01-03", b_en, re.S)
    assert plan
    lectures = re.findall(r"(\d\d(?:\+\d\d)*) \(", " ".join(plan.group(2).split()))
    plan_zh = re.search(rf"每讲 {plan.group(1)} 分钟的课程这样安排：(.*?)01-03 的练习", b_zh, re.S)
    assert plan_zh and re.findall(r"(\d\d(?:\+\d\d)*)（", plan_zh.group(1)) == lectures, lectures


def test_the_exercise_table_is_the_english_one():
    (_, b_en), (_, b_zh) = _section(PAIRS, "## Exercises")
    rows_en, rows_zh = tables(b_en)[0], tables(b_zh)[0]
    assert len(rows_en) > 20 and rows_zh[1:] == rows_en[1:]
    # the predictions stated under the table, with their checkers and stars
    said = r"\(`(\w+)`, checked by `(\w+)`, (★+)\)"
    assert re.findall(said, b_en) and [m for m in re.findall(r"（`(\w+)`，由 `(\w+)` 检查，(★+)）", b_zh)] == \
        re.findall(said, b_en)


@pytest.mark.parametrize("index", range(len(PAIRS)), ids=IDS)
def test_the_same_code(index):
    (h_en, b_en), (h_zh, b_zh) = PAIRS[index]
    assert code_blocks(b_zh) == code_blocks(b_en), f"{h_zh}: code blocks differ from {h_en}'s"
    zh = inline_code(b_zh)
    chinese = (("notebooks/", "notebooks/zh-CN/"), ("lectures/", "lectures/zh-CN/"), ("images/", "images/zh-CN/"))
    missing = [c for c in inline_code(b_en) if c not in zh and all(c.replace(a, b) not in zh for a, b in chinese)]
    assert not missing, f"{h_zh} lacks the inline code {missing} of {h_en}"


def test_the_guides_link_each_other_at_their_top():
    en_top, zh_top = EN[0][1], ZH[0][1]
    assert "](LECTURERS_GUIDE.zh-CN.md)" in en_top, "LECTURERS_GUIDE.md links the Chinese guide before its first section"
    assert "](LECTURERS_GUIDE.md)" in "\n".join(zh_top.splitlines()[:4]), "the Chinese guide's top line links the English one"


def test_links_go_to_the_chinese_edition_and_resolve():
    text = _text(GUIDE_ZH)
    targets = LINK.findall(text)
    assert len(targets) > 15
    for target in targets:
        assert not target.startswith(("http:", "https:")), target
        path = target.split("#", 1)[0]
        if path.endswith(".ipynb"):
            # the Chinese edition's notebook, made from the English one of the same path
            assert path.startswith("zh-CN/"), f"{target}: a notebook link goes to the Chinese edition"
            assert (NB_DIR / path.removeprefix("zh-CN/")).exists(), f"{target}: no English notebook of that name"
        else:
            assert (NB_DIR / path).exists(), f"{target} does not resolve from notebooks/"
    for m in re.finditer(r"\]\((lectures/[^)]*)\)", text):
        # the Chinese run sheets (lectures/zh-CN/) first; a link to an English one says so
        assert m.group(1).startswith("lectures/zh-CN") or "英文" in text[max(0, m.start() - 40):m.end() + 6], \
            f"{m.group(1)}: link the Chinese lecture file, or say that the linked one is English"


def test_no_glossary_forbidden_form():
    assert forbidden_uses(_text(GUIDE_ZH)) == []
