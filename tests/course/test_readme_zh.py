"""README.zh-CN.md is the whole README in Chinese (issue 30): the same sections in the same order, each with the
same commands and code as its English counterpart, so that a Chinese-first reader misses nothing and a command
changed in one README but not the other fails here.

Sections are matched by position (``##`` and ``###`` headings); the Chinese README may add sections of its own
only after a heading that says so (``## 中文用语`` and the like are listed in ``ZH_ONLY``).

Code blocks are compared line for line, except for ``#`` comments, which may be translated. The code blocks of
``## Layout`` (the source tree and the ``EngineCore`` flow) are not code: each line is a path and its notes, and the
notes are English prose that a Chinese-first reader must not have to read, so README.zh-CN.md translates them. For
those blocks the test compares what the reader looks up in the package instead of the words: the same number of
lines, on each line the same indentation and leading path (``core/sched/``, ``-> output_processor.py``), and the
same names in the same order (file names, directory names, code identifiers, ``->`` and ``|``), so that a file
added to, moved in or dropped from one tree but not the other fails here; a line that is English prose in README.md
(two English words or more besides the names) must hold Chinese, and no Layout line of README.zh-CN.md holds an
English function word (``the``, ``of``, ...).
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1].parent
README = ROOT / "README.md"
README_ZH = ROOT / "README.zh-CN.md"
CJK = re.compile(r"[\u4e00-\u9fff]")
# Sections only the Chinese README has: its notes on the Chinese terms and on the Chinese edition.
ZH_ONLY = ("中文用语", "中文版")
# The English section whose code blocks are a path tree with notes (see the module docstring).
LAYOUT = "## Layout"
# A Layout line's tokens: arrows, --flags, and runs of ASCII name characters (a Chinese character or a full-width
# bracket or comma ends a run, so ``block_hash.py（BlockHash，叶子模块）`` gives ``block_hash.py`` and ``BlockHash``).
TOKEN = re.compile(r"->|\||--[\w-]+|[\w./*]+", re.ASCII)
# English function words: a Layout line of README.zh-CN.md holding one has a note left (partly) in English.
PROSE = re.compile(r"\b(the|a|an|of|in|on|per|and|for|to|from|by|with|each|its|one|what|only)\b")


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


def _is_name(token):
    """A name a Layout line must keep: a file name, a directory (``core/sched/``), a ``--flag``, an arrow (``->``,
    ``|``), or a code identifier: snake_case (``model_runner``, ``__init__``, ``MINIVLLM_*``), dotted
    (``EngineCore.step``), or mixed-case (``KVCacheBlock``, ``Worker``, ``vLLM``). Lowercase words and all-capital
    acronyms (``KV``, ``CUDA``) are prose that a translation may reorder or drop."""
    return bool(token in ("->", "|") or token.startswith("--")
                or re.fullmatch(r"[\w./]*\w\.(py|cpp|md|ipynb)", token, re.ASCII)
                or (token.endswith("/") and len(token) > 1)
                or re.search(r"[A-Za-z0-9]_|_[A-Za-z]", token)
                or re.fullmatch(r"\w+(\.\w+)+", token, re.ASCII)
                or (re.search(r"[A-Z]", token) and re.search(r"[a-z]", token)))


def _layout_line(line):
    """``(indentation, leading name or None, [names in order])`` of one line of a Layout code block; the leading name
    is None when the line starts with a note (the rest of a note from the line above)."""
    tokens = [m.group(0).rstrip(".") if m.group(0) not in ("->", "|") else m.group(0)
              for m in TOKEN.finditer(line)]
    names = [tok for tok in tokens if tok and _is_name(tok)]
    body = line.lstrip(" ")
    first = TOKEN.match(body)
    lead = first.group(0).rstrip(".") if first and first.group(0) not in ("->", "|") else (first and first.group(0))
    return len(line) - len(body), (lead if lead and _is_name(lead) else None), names


def _prose_words(line):
    """The lowercase English words (three letters or more) of a Layout line that are not names, leaving out call
    arguments and an assignment's target (``executor = get_executor_class(config)(config)`` has none)."""
    line = re.sub(r"(?<=[\w)])\([^()]*\)", "", line)
    line = re.sub(r"\w+ = ", "", line)
    return [tok for tok in TOKEN.findall(line) if re.fullmatch(r"[a-z]{3,}", tok) and not _is_name(tok)]


def _layout_block_mismatches(en, zh):
    """The lines where the Chinese Layout block ``zh`` does not keep the English block ``en``'s paths and names, or
    leaves a note in English: ``[(line number, English line, Chinese line)]``; a difference in line count is one
    mismatch at the first missing line."""
    en_lines, zh_lines = en.splitlines(), zh.splitlines()
    out = [(i + 1, e, z) for i, (e, z) in enumerate(zip(en_lines, zh_lines))
           if _layout_line(e) != _layout_line(z)
           or PROSE.search(z)
           or (len(_prose_words(e)) >= 2 and not CJK.search(z))]
    if len(en_lines) != len(zh_lines):
        n = min(len(en_lines), len(zh_lines))
        out.append((n + 1, (en_lines + [None])[n], (zh_lines + [None])[n]))
    return out


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
        if h_en == LAYOUT:
            # The tree's notes are translated: compare paths and names line by line (module docstring).
            assert len(blocks_zh) == len(blocks_en), f"{h_en} / {h_zh}: {len(blocks_zh)} code blocks, not {len(blocks_en)}"
            for k, (en, zh) in enumerate(zip(blocks_en, blocks_zh)):
                bad = _layout_block_mismatches(en, zh)
                assert not bad, f"{h_zh} code block {k + 1} (line, README.md, README.zh-CN.md):\n" + "\n".join(
                    f"{i}: {e!r}\n   {z!r}\n   {_layout_line(e or '')} != {_layout_line(z or '')}" for i, e, z in bad)
        else:
            # Comments inside a code block may be translated: compare the code lines.
            strip = lambda b: [ln.split("  #")[0].rstrip() for ln in b.splitlines() if not ln.lstrip().startswith("#")]  # noqa: E731
            assert [strip(b) for b in blocks_zh] == [strip(b) for b in blocks_en], f"{h_en} / {h_zh}"
        assert _commands(b_zh) == _commands(b_en), f"{h_en} / {h_zh}"


def test_the_chinese_readme_sends_a_chinese_first_reader_to_the_chinese_edition():
    text = README_ZH.read_text(encoding="utf-8")
    assert "notebooks/zh-CN" in text and "README.md" in text
    assert "notebooks/zh-CN" in README.read_text(encoding="utf-8")
