"""README.zh-CN.md is the whole README in Chinese (issue 30): the same sections in the same order, each with the
same commands and code as its English counterpart, so that a Chinese-first reader misses nothing and a command
changed in one README but not the other fails here.

Sections are matched by position (``##`` and ``###`` headings); the Chinese README may add sections of its own
only after a heading that says so (``## 中文用语`` and the like are listed in ``ZH_ONLY``).
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1].parent
README = ROOT / "README.md"
README_ZH = ROOT / "README.zh-CN.md"
CJK = re.compile(r"[\u4e00-\u9fff]")
# Sections only the Chinese README has: its notes on the Chinese terms and on the Chinese edition.
ZH_ONLY = ("中文用语", "中文版")


def _sections(text):
    """[(heading line, body)] of the ``##``/``###`` sections (code fences skipped when looking for headings)."""
    out, head, body, fence = [], None, [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        if not fence and re.match(r"^#{2,3} ", line):
            if head is not None:
                out.append((head, "\n".join(body)))
            head, body = line, []
        elif head is not None:
            body.append(line)
    if head is not None:
        out.append((head, "\n".join(body)))
    return out


def _code_blocks(text):
    return [b.strip() for b in re.findall(r"```[a-z]*\n(.*?)```", text, re.S)]


def _commands(text):
    """The ``./course.sh ...`` and ``python -m ...`` commands named inline or in code blocks. Whitespace is collapsed
    first, so that a command wrapped inside a code span (``python -m minivllm.course.edition`` / ``build``) is read
    whole, as Markdown renders it; module names may hold digits (``i18n_catalog``)."""
    text = re.sub(r"\s+", " ", text)
    return sorted(set(re.findall(r"(\./course\.sh [a-z-]+|python -m minivllm(?:\.[a-z0-9_.]+)?(?: [a-z-]+)?)", text)))


def _zh_sections():
    return [(h, b) for h, b in _sections(README_ZH.read_text(encoding="utf-8"))
            if not any(k in h for k in ZH_ONLY)]


def test_the_chinese_readme_has_every_section_of_the_english_one_in_order():
    en = _sections(README.read_text(encoding="utf-8"))
    zh = _zh_sections()
    assert [h.split(" ")[0] for h, _ in zh] == [h.split(" ")[0] for h, _ in en], (
        "README.zh-CN.md's ## / ### headings must follow README.md's one for one:\n"
        + "\n".join(f"{e[0]!r:60} {z[0] if z else None!r}" for e, z in
                    zip(en, zh + [None] * (len(en) - len(zh)))))
    for (h_en, _), (h_zh, body) in zip(en, zh):
        assert CJK.search(h_zh), f"{h_zh!r} (for {h_en!r}) is not in Chinese"
        # Code names in a heading stay as they are (`bench serve`, `vllm serve`).
        assert re.findall(r"`[^`]+`", h_en) == re.findall(r"`[^`]+`", h_zh), (h_en, h_zh)
        assert len(CJK.findall(body)) >= 0.1 * len(body.split()) or not body.strip(), \
            f"the section {h_zh!r} is not written in Chinese"


def test_each_section_has_the_same_code_and_commands_as_its_english_counterpart():
    en = _sections(README.read_text(encoding="utf-8"))
    zh = _zh_sections()
    for (h_en, b_en), (h_zh, b_zh) in zip(en, zh):
        blocks_en = _code_blocks(b_en)
        blocks_zh = _code_blocks(b_zh)
        # Comments inside a code block may be translated: compare the code lines.
        strip = lambda b: [ln.split("  #")[0].rstrip() for ln in b.splitlines() if not ln.lstrip().startswith("#")]  # noqa: E731
        assert [strip(b) for b in blocks_zh] == [strip(b) for b in blocks_en], f"{h_en} / {h_zh}"
        assert _commands(b_zh) == _commands(b_en), f"{h_en} / {h_zh}"


def test_the_chinese_readme_sends_a_chinese_first_reader_to_the_chinese_edition():
    text = README_ZH.read_text(encoding="utf-8")
    assert "notebooks/zh-CN" in text and "README.md" in text
    assert "notebooks/zh-CN" in README.read_text(encoding="utf-8")
