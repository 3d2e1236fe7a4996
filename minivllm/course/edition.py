"""The Chinese edition of the course notebooks, made from the English ones and one gettext catalog per notebook.

The English notebooks (``notebooks/NN_*.ipynb``, ``notebooks/solutions/*.ipynb``) are the only source of code.
Each one's markdown is translated in ``notebooks/locale/zh_CN/<same path>.po`` (gettext's PO format, read and
written with Babel): one entry per markdown cell, ``msgctxt`` the cell's nbformat id, ``msgid`` the English text,
``msgstr`` the Chinese. ``build`` writes ``notebooks/zh-CN/<same path>.ipynb``: every code cell identical to the
English one (source, id, metadata), every markdown cell the catalog's Chinese, and one code cell after the title
that switches the package's own messages to Chinese (:func:`minivllm.i18n.set_language`).

Two kinds of English cell are not translated: the ``## 中文导读`` guide and ``## 中文小结`` summary, written in
Chinese for readers of the English edition, are left out of the Chinese one (its own text covers them).

Staleness is gettext's own: when an English cell changes, its (``msgctxt``, ``msgid``) pair is no longer in the
catalog. ``update`` then keeps the old Chinese as a *fuzzy* entry with the old English as ``#| msgid`` (so the
translator sees what changed), and ``check`` reports it until a translator revises it and removes the fuzzy flag;
``build`` refuses to write a notebook with an untranslated or fuzzy cell.

Commands (``python -m minivllm.course.edition ...``):

* ``update``  create/refresh the catalogs from the English notebooks (new cells empty, changed cells fuzzy,
  deleted cells dropped; an empty entry takes the translation of the same English text from another catalog);
* ``check``   list untranslated, fuzzy and out-of-date pieces (exit 1 if any);
* ``build``   write the Chinese notebooks (keeping the stored outputs of code cells whose source is unchanged);
* ``status``  per notebook: cells, translated, fuzzy, untranslated;
* ``export NB [--file F]`` / ``import NB [--file F]``  a plain-text work file for a translator (English, then
  the Chinese under a ``----- zh_CN -----`` line, per cell), and back into the catalog.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS_DIR = ROOT / "notebooks"
LOCALE = "zh_CN"
CATALOG_DIR = NOTEBOOKS_DIR / "locale" / LOCALE
EDITION_DIR = NOTEBOOKS_DIR / "zh-CN"
LANGUAGE_CELL_ID = "zh-cn-language"
# use_language_font() runs here, before any cell makes an axes: a notebook's own figures (plt.subplots in the cell,
# titles and labels through _()) are not drawn by a course function that would add the CJK font first, so their
# Chinese would otherwise draw as empty boxes.
LANGUAGE_CELL_SOURCE = (
    "# 中文版：本课程包自己的输出（检查器的判定与提示、动画、图表、表格）也用中文；\n"
    "# 图里的中文（也包括 notebook 自己画的标题、坐标轴和图例）用 Noto Sans CJK SC 显示。\n"
    "from minivllm.course import set_language\n"
    "\n"
    'set_language("zh_CN")'
)
# Cells of the English edition written in Chinese for its readers; the Chinese edition leaves them out.
LEFT_OUT = re.compile(r"^## (中文导读|中文小结)\s*\n")


def english_notebooks(root: Path = NOTEBOOKS_DIR) -> List[Path]:
    """The English notebooks that have a Chinese edition: the lessons and the solutions, sorted."""
    return sorted(root.glob("[0-9][0-9]_*.ipynb")) + sorted((root / "solutions").glob("*.ipynb"))


def relative(path: Path, root: Path = NOTEBOOKS_DIR) -> Path:
    return path.resolve().relative_to(root.resolve())


def catalog_path(english: Path, root: Path = NOTEBOOKS_DIR) -> Path:
    return root / "locale" / LOCALE / relative(english, root).with_suffix(".po")


def edition_path(english: Path, root: Path = NOTEBOOKS_DIR) -> Path:
    return root / "zh-CN" / relative(english, root)


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _lines(text: str) -> List[str]:
    return text.splitlines(keepends=True)


def translatable(cell: dict) -> bool:
    """A markdown cell that the Chinese edition translates (not a 中文导读/中文小结 cell)."""
    return cell["cell_type"] == "markdown" and not LEFT_OUT.match(_source(cell))


def left_out(cell: dict) -> bool:
    return cell["cell_type"] == "markdown" and bool(LEFT_OUT.match(_source(cell)))


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _dump(nb: dict) -> str:
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def _read_po(path: Path):
    """The catalog at ``path``, with each fuzzy entry's previous English (``#| msgid``) as ``previous_id``: Babel
    writes those lines but its reader skips them, and a second ``update`` must not lose them."""
    from babel.messages.pofile import read_po, unescape

    with open(path, "rb") as f:
        catalog = read_po(f, locale=LOCALE)
    previous = {}
    for block in path.read_text(encoding="utf-8").split("\n\n"):
        lines = [ln[3:] for ln in block.splitlines() if ln.startswith("#| ")]
        ctx = re.search(r'^msgctxt (".*")$', block, re.M)
        if lines and ctx and lines[0].startswith("msgid "):
            previous[unescape(ctx.group(1))] = "".join(unescape(ln.split(" ", 1)[1] if ln.startswith("msgid ")
                                                               else ln) for ln in lines)
    for m in catalog:
        if m.context in previous:
            m.previous_id = [previous[m.context]]
        # Babel's reader also keeps each "#|" line as a translator comment ("| msgid ..."), which the next write
        # would keep under the entry as "# |" lines for good, one more set at every change: they are not comments.
        m.user_comments = [c for c in m.user_comments if not c.startswith("|")]
    return catalog


def _write_po(path: Path, catalog) -> None:
    from babel.messages.pofile import write_po

    buf = io.BytesIO()
    # width=0: no re-wrapping, one PO line per line of markdown, so a diff shows the lines that changed.
    write_po(buf, catalog, width=0, include_previous=True, omit_header=False, no_location=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())


def _new_catalog(english: Path, root: Path, creation_date=None):
    from babel.messages.catalog import Catalog

    return Catalog(locale=LOCALE, project="minivllm course", version=None, creation_date=creation_date,
                   header_comment=f"# Chinese (zh_CN) translation of notebooks/{relative(english, root).as_posix()}\n"
                                  "# One entry per markdown cell: msgctxt is the cell's id, msgid its English text.\n"
                                  "# Built into notebooks/zh-CN/ by: python -m minivllm.course.edition build",
                   fuzzy=False)


@dataclass
class Problems:
    """What stops the Chinese edition from being complete and current, as ``(notebook, cell id, what)``."""

    untranslated: List[Tuple[str, str, str]] = field(default_factory=list)
    fuzzy: List[Tuple[str, str, str]] = field(default_factory=list)
    missing_catalogs: List[str] = field(default_factory=list)
    stale_notebooks: List[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.untranslated or self.fuzzy or self.missing_catalogs or self.stale_notebooks)

    def format(self) -> str:
        out = []
        for name in self.missing_catalogs:
            out.append(f"{name}: no catalog (run: python -m minivllm.course.edition update)")
        for nb, cid, first in self.untranslated:
            out.append(f"{nb} cell {cid}: untranslated ({first!r})")
        for nb, cid, first in self.fuzzy:
            out.append(f"{nb} cell {cid}: the English changed since it was translated ({first!r}); revise the "
                       "msgstr and remove the '#, fuzzy' flag")
        for name in self.stale_notebooks:
            out.append(f"{name}: differs from what the catalogs build (run: python -m minivllm.course.edition build)")
        return "\n".join(out)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0][:60] if text.strip() else ""


def translation_memory(root: Path = NOTEBOOKS_DIR) -> Dict[str, str]:
    """English text -> Chinese, from every finished (non-fuzzy, non-empty) entry of every catalog."""
    memory: Dict[str, str] = {}
    for po in sorted((root / "locale" / LOCALE).rglob("*.po")):
        for m in _read_po(po):
            if m.id and m.string and not m.fuzzy:
                memory.setdefault(m.id, m.string)
    return memory


def update(root: Path = NOTEBOOKS_DIR, notebooks: Optional[Iterable[Path]] = None) -> Dict[str, Tuple[int, int, int]]:
    """Create or refresh the catalogs of ``notebooks`` (default: all). Returns ``{notebook: (cells, new,
    changed)}``. Changed cells keep their old Chinese, flagged fuzzy, with the old English as ``previous_id``."""
    memory = translation_memory(root)
    report = {}
    for english in notebooks or english_notebooks(root):
        po_path = catalog_path(english, root)
        old = {}
        created = None
        if po_path.exists():
            previous = _read_po(po_path)
            created = previous.creation_date  # kept, so that an update with no change rewrites nothing
            for m in previous:
                if m.id:
                    old[m.context] = m
        catalog = _new_catalog(english, root, created)
        new = changed = 0
        cells = [c for c in _load(english)["cells"] if translatable(c)]
        for cell in cells:
            cid, text = cell["id"], _source(cell)
            prev = old.get(cid)
            if prev is not None and prev.id == text:
                catalog.add(text, prev.string or memory.get(text, ""), context=cid, flags=prev.flags,
                            previous_id=prev.previous_id,
                            auto_comments=prev.auto_comments, user_comments=prev.user_comments)
            elif prev is not None and prev.string:
                changed += 1
                catalog.add(text, prev.string, context=cid, flags={"fuzzy"}, previous_id=prev.id,
                            user_comments=prev.user_comments)
            else:
                new += 1
                catalog.add(text, memory.get(text, ""), context=cid)
        _write_po(po_path, catalog)
        report[relative(english, root).as_posix()] = (len(cells), new, changed)
    return report


def _translations(english: Path, root: Path) -> Dict[Tuple[str, str], object]:
    return {(m.context, m.id): m for m in _read_po(catalog_path(english, root)) if m.id}


_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.M)
# [text](target#anchor) and [text](#anchor), and <img src="target">.
_LINK_FULL = re.compile(r"(\]\(|src=\")(?!https?:|mailto:|data:)([^)\"\s#]*)(#[^)\"\s]*)?")


def anchor(heading: str) -> str:
    """JupyterLab's anchor of a markdown heading: its text with backticks dropped and spaces as ``-``."""
    return heading.replace("`", "").strip().replace(" ", "-")


def _headings(text: str) -> List[str]:
    return [anchor(h) for h in _HEADING.findall(re.sub(r"```.*?```", "", text, flags=re.S))]


def anchor_map(english: Path, root: Path = NOTEBOOKS_DIR) -> Dict[str, str]:
    """English anchor -> Chinese anchor for the headings of ``english``, cell by cell (a translated cell keeps the
    English cell's headings in order, so the i-th heading of one is the i-th of the other)."""
    po = catalog_path(english, root)
    if not po.exists():
        return {}
    found = _translations(english, root)
    out: Dict[str, str] = {}
    for cell in _load(english)["cells"]:
        if not translatable(cell):
            continue
        m = found.get((cell["id"], _source(cell)))
        if m is None or not m.string or m.fuzzy:
            continue
        en, zh = _headings(_source(cell)), _headings(m.string)
        if len(en) == len(zh):
            out.update(zip(en, zh))
    return out


def localized_asset(src: Path, root: Path = NOTEBOOKS_DIR) -> Path:
    """The Chinese version of a picture, ``<folder>/zh-CN/<name>``, where one exists; else ``src``."""
    zh = src.parent / "zh-CN" / src.name
    return zh if zh.exists() else src


def _rewrite_links(text: str, english: Path, target: Path, root: Path,
                   anchors: Optional[Dict[Path, Dict[str, str]]] = None) -> str:
    """Relative links of ``english``'s markdown made to work from ``target``: a notebook that has a Chinese
    edition links to that edition, at the anchor of the Chinese heading that translates the English one; a picture
    with a Chinese version (``images/zh-CN/<name>``) is replaced by it; any other file (the glossary) is reached
    from the new folder."""
    anchors = {} if anchors is None else anchors
    editions = {p.resolve() for p in english_notebooks(root)}

    def fix(m: re.Match) -> str:
        prefix, link, frag = m.group(1), m.group(2), m.group(3) or ""
        src = (english.parent / link).resolve() if link else english.resolve()
        if not src.exists():
            return m.group(0)
        if src.suffix == ".ipynb" and src in editions:
            if src not in anchors:
                anchors[src] = anchor_map(src, root)
            if frag:
                frag = "#" + anchors[src].get(frag[1:], frag[1:])
            if not link:
                return prefix + frag
            dest = edition_path(src, root)
        else:
            dest = localized_asset(src, root)
        return prefix + os.path.relpath(dest, target.parent.resolve()).replace(os.sep, "/") + frag

    return _LINK_FULL.sub(fix, text)


def _edition_note(english: Path, target: Path, root: Path) -> str:
    """The line the build adds under each Chinese notebook's title: the English original and the glossary (the
    English edition links the glossary from its 中文导读 cell, which this edition leaves out)."""
    up = os.path.relpath(english.resolve(), target.parent.resolve()).replace(os.sep, "/")
    glossary = os.path.relpath((root / "GLOSSARY.md").resolve(), target.parent.resolve()).replace(os.sep, "/")
    return (f"> 中文版，由英文版 [`{english.name}`]({up}) 的翻译生成，代码与英文版完全相同；"
            f"译名以[术语表]({glossary})为准。")


def build_notebook(english: Path, root: Path = NOTEBOOKS_DIR, keep_outputs: Optional[dict] = None,
                   allow_missing: bool = False, widgets: Optional[dict] = None) -> dict:
    """The Chinese edition of ``english`` as an nbformat dict. Raises ``KeyError`` naming the first cell without
    a finished translation unless ``allow_missing`` (then that cell stays English)."""
    nb = _load(english)
    target = edition_path(english, root)
    found = _translations(english, root)
    kept = keep_outputs or {}
    cells = []
    for i, cell in enumerate(nb["cells"]):
        if left_out(cell):
            continue
        cell = copy.deepcopy(cell)
        if translatable(cell):
            m = found.get((cell["id"], _source(cell)))
            if m is None or not m.string or m.fuzzy:
                if not allow_missing:
                    raise KeyError(f"{relative(english, root)} cell {cell['id']} ({_first_line(_source(cell))!r}) has "
                                   "no finished translation")
            else:
                cell["source"] = _lines(_rewrite_links(m.string, english, target, root))
        elif cell["cell_type"] == "code" and cell["id"] in kept and kept[cell["id"]][0] == _source(cell):
            cell["outputs"], cell["execution_count"] = kept[cell["id"]][1]
        if i == 0:
            cell["source"] = _lines(_source(cell).rstrip("\n") + "\n\n" + _edition_note(english, target, root))
        cells.append(cell)
        if i == 0:
            lang = {"cell_type": "code", "execution_count": None, "id": LANGUAGE_CELL_ID,
                    "metadata": {"slideshow": {"slide_type": "skip"}}, "outputs": [],
                    "source": _lines(LANGUAGE_CELL_SOURCE)}
            if LANGUAGE_CELL_ID in kept and kept[LANGUAGE_CELL_ID][0] == LANGUAGE_CELL_SOURCE:
                lang["outputs"], lang["execution_count"] = kept[LANGUAGE_CELL_ID][1]
            cells.append(lang)
    _slide_types(cells, english.stem)
    nb["cells"] = cells
    # The widgets' state belongs to the run whose outputs the notebook stores: the Chinese edition's own run (its
    # labels are Chinese, its model ids are the ones its outputs reference), never the English notebook's.
    nb.setdefault("metadata", {}).pop("widgets", None)
    if widgets:
        nb["metadata"]["widgets"] = widgets
    nb["metadata"]["minivllm"] = {
        "edition": LOCALE, "english": os.path.relpath(english.resolve(), target.parent.resolve()).replace(os.sep, "/")}
    return nb


def _slide_types(cells: List[dict], stem: str) -> None:
    """The slide rule of :mod:`minivllm.course.slides` applied to the Chinese cells (their heights differ from
    the English ones), with the English deck's budget; the language cell is skipped like a set-up cell."""
    from minivllm.course import slides

    if stem not in slides.SLIDE_NOTEBOOKS:
        return
    rest = [c for c in cells if c["id"] != LANGUAGE_CELL_ID]
    for cell, t in zip(rest, slides.slide_types(rest, slides.slide_budget(stem))):
        cell.setdefault("metadata", {})["slideshow"] = {"slide_type": t}


def _stored_run(path: Path) -> Tuple[dict, Optional[dict]]:
    """What the Chinese notebook at ``path`` keeps from its last run: ``{code cell id: (source, (outputs,
    execution_count))}`` and its saved widget state (``({}, None)`` before the first build)."""
    if not path.exists():
        return {}, None
    nb = _load(path)
    outputs = {c["id"]: (_source(c), (c.get("outputs", []), c.get("execution_count")))
               for c in nb["cells"] if c["cell_type"] == "code"}
    return outputs, nb.get("metadata", {}).get("widgets")


def _without_outputs(nb: dict) -> dict:
    nb = copy.deepcopy(nb)
    nb.get("metadata", {}).pop("widgets", None)
    for c in nb["cells"]:
        if c["cell_type"] == "code":
            c["outputs"], c["execution_count"] = [], None
    return nb


def build(root: Path = NOTEBOOKS_DIR, notebooks: Optional[Iterable[Path]] = None,
          allow_missing: bool = False) -> List[str]:
    """Write the Chinese edition of ``notebooks`` (default: all); returns the paths written (changed only)."""
    written = []
    for english in notebooks or english_notebooks(root):
        target = edition_path(english, root)
        outputs, widgets = _stored_run(target)
        nb = build_notebook(english, root, outputs, allow_missing, widgets)
        text = _dump(nb)
        if not target.exists() or target.read_text(encoding="utf-8") != text:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
            written.append(relative(target, root).as_posix())
    return written


def check(root: Path = NOTEBOOKS_DIR) -> Problems:
    """Everything that keeps the Chinese edition from matching the English one now."""
    problems = Problems()
    for english in english_notebooks(root):
        name = relative(english, root).as_posix()
        if not catalog_path(english, root).exists():
            problems.missing_catalogs.append(name)
            continue
        found = _translations(english, root)
        by_cell = {ctx: m for (ctx, _id), m in found.items()}
        for cell in _load(english)["cells"]:
            if not translatable(cell):
                continue
            m = found.get((cell["id"], _source(cell)))
            first = _first_line(_source(cell))
            if m is not None and m.string and not m.fuzzy:
                continue
            old = by_cell.get(cell["id"])
            if (m is not None and m.fuzzy) or (old is not None and old.string and old.id != _source(cell)):
                problems.fuzzy.append((name, cell["id"], first))
            else:
                problems.untranslated.append((name, cell["id"], first))
        target = edition_path(english, root)
        if not (problems.untranslated or problems.fuzzy):
            want = _without_outputs(build_notebook(english, root, _stored_run(target)[0]))
            have = _without_outputs(_load(target)) if target.exists() else None
            if have != want:
                problems.stale_notebooks.append(relative(target, root).as_posix())
    return problems


def status(root: Path = NOTEBOOKS_DIR) -> List[Tuple[str, int, int, int, int]]:
    rows = []
    for english in english_notebooks(root):
        cells = [c for c in _load(english)["cells"] if translatable(c)]
        po = catalog_path(english, root)
        found = _translations(english, root) if po.exists() else {}
        done = fuzzy = 0
        for c in cells:
            m = found.get((c["id"], _source(c)))
            if m is not None and m.string:
                fuzzy += bool(m.fuzzy)
                done += not m.fuzzy
        rows.append((relative(english, root).as_posix(), len(cells), done, fuzzy, len(cells) - done - fuzzy))
    return rows


WORK_CELL = "===== cell {id} ====="
WORK_ZH = "----- zh_CN -----"
_WORK_SPLIT = re.compile(r"^===== cell (\S+) =====\n", re.M)


def export_work_file(english: Path, only_todo: bool = True, root: Path = NOTEBOOKS_DIR) -> str:
    """A plain-text work file for a translator: per cell, the English text, then a ``----- zh_CN -----`` line,
    then the Chinese (the current translation, or empty). Easier to edit than PO's quoted lines; ``import``
    puts it back. ``only_todo``: only untranslated and fuzzy cells."""
    found = {m.context: m for m in _read_po(catalog_path(english, root)) if m.id}
    parts = [f"# work file for {relative(english, root).as_posix()}: write the Chinese markdown under each "
             f"'{WORK_ZH}' line; keep the cell lines\n"]
    for cell in _load(english)["cells"]:
        if not translatable(cell):
            continue
        m = found.get(cell["id"])
        done = m is not None and m.id == _source(cell) and m.string and not m.fuzzy
        if only_todo and done:
            continue
        zh = m.string if m is not None else ""
        parts.append(f"{WORK_CELL.format(id=cell['id'])}\n{_source(cell).rstrip()}\n{WORK_ZH}\n{zh.rstrip()}\n")
    return "\n".join(parts)


def import_work_file(english: Path, text: str, root: Path = NOTEBOOKS_DIR) -> int:
    """Put the Chinese of a work file into ``english``'s catalog (finished: not fuzzy). Returns the number of
    cells set. Raises ``ValueError`` for a cell id that the notebook lacks, a block without the zh_CN line, or an
    English text that no longer matches the notebook (re-export)."""
    po_path = catalog_path(english, root)
    catalog = _read_po(po_path)
    cells = {c["id"]: _source(c) for c in _load(english)["cells"] if translatable(c)}
    blocks = _WORK_SPLIT.split(text)[1:]
    updates = {}
    for cid, body in zip(blocks[0::2], blocks[1::2]):
        if cid not in cells:
            raise ValueError(f"work file: cell {cid} is not a translatable cell of {english.name}")
        if f"\n{WORK_ZH}\n" not in "\n" + body:
            raise ValueError(f"work file: cell {cid} has no '{WORK_ZH}' line")
        en, zh = ("\n" + body).split(f"\n{WORK_ZH}\n", 1)
        if en.strip() != cells[cid].strip():
            raise ValueError(f"work file: the English of cell {cid} differs from the notebook's now; export again")
        if zh.strip():
            updates[cid] = zh.strip("\n")
    n = 0
    for m in catalog:
        if m.id and m.context in updates:
            m.string = updates[m.context]
            m.flags.discard("fuzzy")
            m.previous_id = []
            n += 1
    _write_po(po_path, catalog)
    return n


def _english_arg(name: str, root: Path = NOTEBOOKS_DIR) -> Path:
    """A notebook named by path, file name or stem (``05``, ``05_chunked_prefill``, ``solutions/05_...``)."""
    for p in english_notebooks(root):
        rel = relative(p, root).as_posix()
        if name in (str(p), rel, p.name, p.stem) or (len(name) == 2 and rel.startswith(name + "_")):
            return p
    raise ValueError(f"no English notebook named {name!r}")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minivllm.course.edition", description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["update", "check", "build", "status", "export", "import"])
    ap.add_argument("notebooks", nargs="*", help="English notebooks (default: all)")
    ap.add_argument("--all", action="store_true", help="export: every cell, not only the unfinished ones")
    ap.add_argument("--file", help="export/import: the work file (default: stdout/stdin)")
    ap.add_argument("--allow-missing", action="store_true", help="build: leave untranslated cells in English")
    args = ap.parse_args(argv)
    if args.command in ("export", "import"):
        if len(args.notebooks) != 1:
            ap.error(f"{args.command} takes exactly one notebook")
        english = _english_arg(args.notebooks[0])
        if args.command == "export":
            text = export_work_file(english, only_todo=not args.all)
            if args.file:
                Path(args.file).write_text(text, encoding="utf-8")
            else:
                sys.stdout.write(text)
            return 0
        text = Path(args.file).read_text(encoding="utf-8") if args.file else sys.stdin.read()
        print(f"{import_work_file(english, text)} cells translated in {catalog_path(english).name}")
        return 0
    paths = [_english_arg(p) for p in args.notebooks] or None
    if args.command == "update":
        for name, (cells, new, changed) in update(notebooks=paths).items():
            print(f"{name}: {cells} cells, {new} new, {changed} changed (fuzzy)")
        return 0
    if args.command == "build":
        try:
            for name in build(notebooks=paths, allow_missing=args.allow_missing):
                print("wrote", name)
        except KeyError as e:
            print("error:", e.args[0], file=sys.stderr)
            return 1
        return 0
    if args.command == "status":
        print(f"{'notebook':55} cells  done  fuzzy  todo")
        for name, n, done, fuzzy, todo in status():
            print(f"{name:55} {n:5} {done:5} {fuzzy:6} {todo:5}")
        return 0
    problems = check()
    if problems:
        print(problems.format())
        return 1
    print("the Chinese edition is complete and current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
