"""minivllm/bench/OPTIMISATIONS.zh-CN.md is OPTIMISATIONS.md in Chinese (issue 30). The English file is the source;
notebook 09's Chinese edition shows the Chinese file's section from ``## 各步优化`` up to ``## 尚未完成的`` (the
English notebook cuts the English file at ``## The steps`` and ``## What remains``). So that a change to the English
file (a new step, a re-measured number, a renamed function) that is not carried into the Chinese one fails here:

* the same headings (``#`` to ``######``), same number, order and levels, each Chinese heading in Chinese and with
  the English heading's inline code; the two headings notebook 09 cuts at stand exactly once each, in the English
  file's places, in the right order, with the steps table between them;
* each section has every number of its English section at least as often (the Chinese may say more);
* each section has the same tables, each with the same rows and columns, and each Chinese row every number of its
  English row;
* each section has the same code blocks (a comment may be translated) and the same inline code spans (as a multiset,
  whitespace normalised: a span may wrap differently);
* each section is written in Chinese;
* the Chinese file's first lines under its title link the English file and say that it is the source; every
  relative link resolves;
* the glossary's forbidden forms (块 for a chunk, 令牌 for token, ...) do not occur.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from tests.course.test_chinese import forbidden_uses

BENCH = Path(__file__).resolve().parents[2] / "minivllm" / "bench"
EN_PATH = BENCH / "OPTIMISATIONS.md"
ZH_PATH = BENCH / "OPTIMISATIONS.zh-CN.md"
# The headings notebook 09 cuts the file at: (English, Chinese).
CUTS = [("## The steps", "## 各步优化"), ("## What remains", "## 尚未完成的")]
CJK = re.compile(r"[\u4e00-\u9fff]")
NUMBER = re.compile(r"\d+(?:\.\d+)?")
HEADING = re.compile(r"^(#{1,6}) \S")
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")


def sections(text: str) -> list[tuple[str, str]]:
    """``[(heading line, body)]``, code fences skipped when looking for headings; the first one's heading is
    ``""`` (the text before the title, normally empty)."""
    out: list[tuple[str, str]] = []
    body: list[str] = []
    head, fence = "", False
    for line in text.splitlines():
        if FENCE.match(line):
            fence = not fence
        if not fence and HEADING.match(line):
            out.append((head, "\n".join(body)))
            head, body = line, []
        else:
            body.append(line)
    out.append((head, "\n".join(body)))
    return out


def tables(body: str) -> list[list[list[str]]]:
    """The markdown tables of ``body`` (also indented ones, inside a list item): each a list of rows, a row the
    list of its stripped cells, the ``|---|`` line left out."""
    found: list[list[list[str]]] = []
    rows: list[list[str]] = []
    for line in body.splitlines() + [""]:
        line = line.strip()
        if line.startswith("|"):
            if not re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", line):
                rows.append([c.strip() for c in line.strip("|").split("|")])
        elif rows:
            found.append(rows)
            rows = []
    return found


def numbers(text: str) -> Counter:
    return Counter(NUMBER.findall(text))


def code_blocks(text: str) -> list[list[str]]:
    """Fenced code blocks without their comments (a comment may be translated)."""
    out: list[list[str]] = []
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, re.S):
        out.append([ln.split("  #")[0].rstrip() for ln in block.splitlines() if not ln.lstrip().startswith("#")])
    return out


def inline_code(text: str) -> Counter:
    """The inline code spans outside code blocks, whitespace normalised, with how often each occurs."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return Counter(" ".join(span.split()) for span in re.findall(r"`([^`]+)`", text))


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


EN_TEXT, ZH_TEXT = _read(EN_PATH), _read(ZH_PATH)
EN, ZH = sections(EN_TEXT), sections(ZH_TEXT)
PAIRS = list(zip(EN, ZH))
IDS = [h_en.lstrip("# ") or "(before the title)" for (h_en, _), _ in PAIRS]


def test_the_same_headings_in_the_same_order():
    assert len(EN) > 5
    levels = [h.split(" ")[0] for h, _ in EN]
    assert [h.split(" ")[0] for h, _ in ZH] == levels, (
        "OPTIMISATIONS.zh-CN.md's headings must follow OPTIMISATIONS.md's one for one (number, order, level):\n"
        + "\n".join(f"{e!r:60} {z!r}" for e, z in zip([h for h, _ in EN], [h for h, _ in ZH] + [None] * len(EN))))
    for (h_en, _), (h_zh, _) in PAIRS[1:]:
        assert CJK.search(h_zh), f"{h_zh!r} (for {h_en!r}) is not in Chinese"
        assert re.findall(r"`[^`]+`", h_zh) == re.findall(r"`[^`]+`", h_en), (h_en, h_zh)


def test_notebook_09_cuts_both_files_at_the_same_places():
    heads_en, heads_zh = [h for h, _ in EN], [h for h, _ in ZH]
    for en, zh in CUTS:
        assert heads_en.count(en) == 1, f"OPTIMISATIONS.md must have {en!r} exactly once (notebook 09 cuts there)"
        assert heads_zh.count(zh) == 1, f"OPTIMISATIONS.zh-CN.md must have {zh!r} exactly once (notebook 09 cuts there)"
        assert heads_zh.index(zh) == heads_en.index(en), f"{zh!r} is not in the place of {en!r}"
    # What the notebook shows: the text between the two cuts, the steps table in it, in both languages.
    (start_en, end_en), (start_zh, end_zh) = zip(*CUTS)
    shown_en = EN_TEXT[EN_TEXT.index(start_en):EN_TEXT.index(end_en)]
    shown_zh = ZH_TEXT[ZH_TEXT.index(start_zh):ZH_TEXT.index(end_zh)]
    assert tables(shown_en) and [len(t) for t in tables(shown_zh)] == [len(t) for t in tables(shown_en)]


@pytest.mark.parametrize("index", range(len(PAIRS)), ids=IDS)
def test_every_number_of_a_section_is_in_its_translation(index):
    (h_en, b_en), (h_zh, b_zh) = PAIRS[index]
    missing = numbers(b_en) - numbers(b_zh)
    assert not missing, f"{h_zh!r} lacks these numbers of {h_en!r} (number: times missing): {dict(missing)}"


@pytest.mark.parametrize("index", range(len(PAIRS)), ids=IDS)
def test_the_same_tables(index):
    (h_en, b_en), (h_zh, b_zh) = PAIRS[index]
    t_en, t_zh = tables(b_en), tables(b_zh)
    assert [len(t) for t in t_zh] == [len(t) for t in t_en], f"{h_zh!r}: tables or their rows differ from {h_en!r}'s"
    for rows_en, rows_zh in zip(t_en, t_zh):
        assert [len(r) for r in rows_zh] == [len(r) for r in rows_en], f"{h_zh!r}: a row's columns differ"
        for r_en, r_zh in zip(rows_en, rows_zh):
            missing = numbers(" | ".join(r_en)) - numbers(" | ".join(r_zh))
            assert not missing, f"{h_zh!r}: the row {r_zh} lacks the numbers {sorted(missing)} of {r_en}"


@pytest.mark.parametrize("index", range(len(PAIRS)), ids=IDS)
def test_the_same_code(index):
    (h_en, b_en), (h_zh, b_zh) = PAIRS[index]
    assert code_blocks(b_zh) == code_blocks(b_en), f"{h_zh!r}: code blocks differ from {h_en!r}'s"
    en, zh = inline_code(b_en), inline_code(b_zh)
    assert zh == en, f"{h_zh!r}: inline code differs from {h_en!r}'s: missing {dict(en - zh)}, extra {dict(zh - en)}"


@pytest.mark.parametrize("index", range(1, len(PAIRS)), ids=IDS[1:])
def test_each_section_is_written_in_chinese(index):
    (_, b_en), (h_zh, b_zh) = PAIRS[index]
    # A section left in English has a few CJK characters at most (a table header); Chinese prose has several per
    # English word of the source.
    assert len(CJK.findall(b_zh)) >= 0.5 * len(b_en.split()), f"{h_zh!r} is not written in Chinese"


def test_the_chinese_file_links_the_english_one_as_its_source():
    title, top = ZH[1][0], ZH[1][1].strip().splitlines()[:3]
    assert title.startswith("# ") and top, "OPTIMISATIONS.zh-CN.md starts with its title and a note under it"
    note = "\n".join(top)
    assert "](OPTIMISATIONS.md)" in note, "the note under the title links OPTIMISATIONS.md"
    assert "以英文版为准" in note, "the note says that the English file is right where the two differ"


def test_relative_links_resolve():
    targets = LINK.findall(ZH_TEXT)
    assert "OPTIMISATIONS.md" in targets
    assert Counter(t for t in targets if t != "OPTIMISATIONS.md") == Counter(LINK.findall(EN_TEXT)), \
        "the Chinese file links what the English one links (and the English file)"
    for target in targets:
        if target.startswith(("http:", "https:")):
            continue
        path = target.split("#", 1)[0]
        assert not path or (BENCH / path).exists(), f"{target} does not resolve from minivllm/bench/"


def test_no_glossary_forbidden_form():
    assert forbidden_uses(ZH_TEXT) == []
