"""The Chinese edition of the notebooks (issue 30): built from the English notebooks and one gettext catalog per
notebook (minivllm/course/edition.py), so that its code cannot drift and a changed English cell shows up.

The mechanism is tested on a copy of two notebooks in a temporary folder (a changed English cell becomes fuzzy,
the build refuses it, links and anchors are rewritten); the committed edition is tested as it is: every cell
translated and current, every code cell identical to the English one, every link resolving.
"""

import json
import re
import shutil
from pathlib import Path

import pytest

from minivllm.course import edition

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
CJK = re.compile(r"[\u4e00-\u9fff]")


def _cells(path):
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def _src(cell):
    return "".join(cell["source"])


_HEADINGS = 0


def _fake_chinese(english: str) -> str:
    """A stand-in translation that keeps the English cell's headings (as a real one must) and its links."""
    out = []
    global _HEADINGS
    for line in english.splitlines():
        m = re.match(r"^(#{1,6}\s+)(\d+[a-z]?\.\s*)?(.*)$", line)
        if m:
            _HEADINGS += 1
            out.append(f"{m.group(1)}{m.group(2) or ''}中文标题 {_HEADINGS}")
    links = re.findall(r"\]\([^)\s]+\)", english)
    return "\n".join(out + ["中文正文：" + " ".join(f"[链接{t}" for t in links)])


@pytest.fixture
def tree(tmp_path):
    """notebooks/05 and notebooks/10 (which links into 05 by anchor) copied into a temporary course folder."""
    nb = tmp_path / "notebooks"
    nb.mkdir()
    for name in ("05_chunked_prefill.ipynb", "10_faq.ipynb", "GLOSSARY.md"):
        shutil.copy(NOTEBOOKS / name, nb / name)
    (tmp_path / "images").mkdir()
    return nb


def _filled(work: str) -> str:
    """A work file with every cell's Chinese written (``_fake_chinese``)."""
    blocks = re.split(r"^(===== cell \S+ =====\n)", work, flags=re.M)
    filled = [blocks[0]]
    for head, body in zip(blocks[1::2], blocks[2::2]):
        en = body.split("\n" + edition.WORK_ZH + "\n")[0]
        filled.append(head + en + "\n" + edition.WORK_ZH + "\n" + _fake_chinese(en) + "\n\n")
    return "".join(filled)


def _translate_all(nb):
    for english in edition.english_notebooks(nb):
        assert edition.import_work_file(english, _filled(edition.export_work_file(english, root=nb)), root=nb) > 10


def test_a_changed_english_cell_becomes_fuzzy_and_blocks_the_build(tree):
    edition.update(tree)
    assert edition.check(tree).untranslated  # fresh catalogs: nothing translated yet
    _translate_all(tree)
    edition.build(tree)
    assert not edition.check(tree), edition.check(tree).format()

    # An author edits one English markdown cell.
    path = tree / "05_chunked_prefill.ipynb"
    nb = json.loads(path.read_text(encoding="utf-8"))
    cell = next(c for c in nb["cells"] if edition.translatable(c) and "token budget" in _src(c))
    cell["source"] = _src(cell).replace("token budget", "per-step token budget", 1)
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")

    problems = edition.check(tree)
    assert [(n, cid) for n, cid, _ in problems.fuzzy] == [("05_chunked_prefill.ipynb", cell["id"])]
    with pytest.raises(KeyError, match=cell["id"]):
        edition.build(tree)
    # update keeps the old Chinese, flagged fuzzy, with the old English beside it for the translator.
    edition.update(tree)
    po = edition.catalog_path(path, tree)
    entry = next(m for m in edition._read_po(po) if m.context == cell["id"])
    assert entry.fuzzy and CJK.search(entry.string) and "per-step token budget" in entry.id
    assert "token budget" in entry.previous_id[0] and "per-step" not in entry.previous_id[0]
    assert "#, fuzzy" in po.read_text(encoding="utf-8") and "#| msgid" in po.read_text(encoding="utf-8")
    assert [cid for _, cid, _ in edition.check(tree).fuzzy] == [cell["id"]]

    # The translator revises it: the flag and the old English go, and no trace of them stays in the catalog through
    # later updates (Babel's reader also keeps "#|" lines as translator comments, which were written back as "# |").
    assert edition.import_work_file(path, _filled(edition.export_work_file(path, root=tree)), root=tree) == 1
    edition.update(tree)
    text = po.read_text(encoding="utf-8")
    assert "#, fuzzy" not in text and "#|" not in text and "# |" not in text
    edition.build(tree)
    assert not edition.check(tree), edition.check(tree).format()


def test_build_keeps_code_and_rewrites_links_and_anchors(tree):
    edition.update(tree)
    _translate_all(tree)
    edition.build(tree)
    en = _cells(tree / "10_faq.ipynb")
    zh = _cells(tree / "zh-CN" / "10_faq.ipynb")
    assert zh[1]["id"] == edition.LANGUAGE_CELL_ID and 'set_language("zh_CN")' in _src(zh[1])
    code = lambda cells: [(c["id"], c["source"], c["outputs"]) for c in cells if c["cell_type"] == "code"]  # noqa: E731
    assert code(en) == code(zh[2:])
    assert not any(edition.left_out(c) for c in zh)
    text = "\n".join(_src(c) for c in zh if c["cell_type"] == "markdown")
    heads05 = {edition.anchor(h) for c in _cells(tree / "zh-CN" / "05_chunked_prefill.ipynb")
               for h in re.findall(r"^#+\s+(.*)$", _src(c), re.M)}
    links = re.findall(r"\]\((05_chunked_prefill\.ipynb)#([^)\s]+)\)", text)
    assert links and all(a in heads05 for _, a in links), links
    assert "[术语表](../GLOSSARY.md)" in text and "[`10_faq.ipynb`](../10_faq.ipynb)" in text
    assert len(set(heads05)) > 15  # distinct headings, so the anchor check above means something


def test_update_rewrites_nothing_when_nothing_changed(tree):
    edition.update(tree)
    before = {p: p.read_bytes() for p in (tree / "locale").rglob("*.po")}
    edition.update(tree)
    assert {p: p.read_bytes() for p in (tree / "locale").rglob("*.po")} == before


# ---------------------------------------------------------------------------------------------------- the edition


def test_the_chinese_edition_is_complete_and_current():
    problems = edition.check(NOTEBOOKS)
    assert not problems, "\n" + problems.format()


@pytest.mark.parametrize("english", edition.english_notebooks(), ids=lambda p: edition.relative(p).as_posix())
def test_every_code_cell_is_the_english_one_and_every_markdown_cell_is_chinese(english):
    zh_path = edition.edition_path(english)
    assert zh_path.exists(), f"{zh_path} missing: python -m minivllm.course.edition build"
    en = [c for c in _cells(english) if not edition.left_out(c)]
    zh = _cells(zh_path)
    assert zh[1]["id"] == edition.LANGUAGE_CELL_ID
    zh = zh[:1] + zh[2:]
    assert [c["id"] for c in zh] == [c["id"] for c in en]
    for e, z in zip(en, zh):
        assert z["cell_type"] == e["cell_type"]
        if e["cell_type"] == "code":
            assert z["source"] == e["source"], f"cell {e['id']}"
        else:
            assert len(CJK.findall(_src(z))) >= 1, f"cell {e['id']} has no Chinese: {_src(z)[:60]!r}"


def test_links_of_the_chinese_edition_resolve():
    zh_dir = NOTEBOOKS / "zh-CN"
    paths = sorted(zh_dir.rglob("*.ipynb"))
    assert paths
    heads = {}
    for p in paths:
        heads[p.resolve()] = {edition.anchor(h) for c in _cells(p) if c["cell_type"] == "markdown"
                              for h in re.findall(r"^#+\s+(.*)$", _src(c), re.M)}
    bad = []
    for p in paths:
        for c in _cells(p):
            if c["cell_type"] != "markdown":
                continue
            for target, frag in re.findall(r"\]\((?!https?:|mailto:)([^)\s#]*)(?:#([^)\s]+))?\)", _src(c)):
                dest = (p.parent / target).resolve() if target else p.resolve()
                if not dest.exists():
                    bad.append((p.name, target))
                elif frag and dest.suffix == ".ipynb" and frag not in heads.get(dest, set()) \
                        and not frag.startswith("["):
                    bad.append((p.name, f"{target}#{frag}"))
    assert bad == []


def test_grading_the_chinese_edition_answers_in_chinese(capsys, monkeypatch):
    from minivllm import i18n
    from minivllm.course.learner import grade

    monkeypatch.delenv("MINIVLLM_LANG", raising=False)
    try:
        assert grade.main(["04", "--notebooks", str(NOTEBOOKS / "zh-CN")]) == 1  # the committed exercise is blank
        out = capsys.readouterr().out
        assert "未写" in out and "waiting_loop" in out, out
        i18n.set_language("en")
        assert grade.main(["04", "--notebooks", str(NOTEBOOKS)]) == 1
        assert "blank" in capsys.readouterr().out
    finally:
        i18n.set_language("en")


@pytest.mark.parametrize("english", edition.english_notebooks(), ids=lambda p: edition.relative(p).as_posix())
def test_the_chinese_widgets_are_the_chinese_runs_own(english):
    """Every widget view a Chinese notebook's outputs show has its model in that notebook's saved widget state (the
    state of its own, Chinese, run: the English notebook's state has other model ids and English labels)."""
    zh = json.loads(edition.edition_path(english).read_text(encoding="utf-8"))
    state = zh.get("metadata", {}).get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get(
        "state", {})
    views = [o["data"]["application/vnd.jupyter.widget-view+json"]["model_id"] for c in zh["cells"]
             if c["cell_type"] == "code" for o in c.get("outputs", [])
             if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert [v for v in views if v not in state] == []
    if views:
        labels = json.dumps(state, ensure_ascii=False)
        assert CJK.search(labels), "the saved widget state has no Chinese"


PERMALINK = re.compile(r"https://github\.com/vllm-project/vllm/(?:blob|tree)/v0\.3[23]\.0/[^)\s\"'>]+")


@pytest.mark.parametrize("english", edition.english_notebooks(), ids=lambda p: edition.relative(p).as_posix())
def test_the_chinese_cells_link_the_vllm_lines_their_english_cells_link(english):
    """The permalink check (tests/course/test_vllm_recordings_course.py) reads the English notebooks; a Chinese cell
    may only link vLLM lines that its English cell links, so the check covers it too."""
    en = {c["id"]: set(PERMALINK.findall(_src(c))) for c in _cells(english)}
    for c in _cells(edition.edition_path(english)):
        extra = set(PERMALINK.findall(_src(c))) - en.get(c["id"], set())
        assert not extra, f"cell {c['id']} links vLLM lines its English cell does not: {sorted(extra)}"
