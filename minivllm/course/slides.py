"""Lecture slides from the notebooks: the slide-type rule, and the offline reveal.js export.

Every course notebook (``SLIDE_NOTEBOOKS``, 00-13, grouped as the guide's lectures in ``LECTURES``) carries
``metadata.slideshow.slide_type`` on every cell, as
JupyterLab's property inspector, RISE (``jupyterlab-rise``) and nbconvert's ``SlidesExporter`` read it. The
metadata is not written by hand: ``slide_types`` derives it from the cells, so it can be re-applied after anyone
edits a notebook (``python -m minivllm.course.slides apply``), and ``tests/course/test_slides.py`` checks that the
stored metadata is what the rule gives. The rule, in order, for each cell:

0. The Chinese sections (a heading that opens with ``中文``: 中文导读, 中文小结) go to the speaker notes, not on the
   screen: the decks are the English lecture, and a lecturer teaching in Chinese finds them in the speaker view
   (markdown cells ``notes``, code cells ``skip``).
1. A markdown cell opening with ``# `` or ``## `` opens a slide; one opening with ``### `` or deeper, a subslide.
   A heading inside a markdown cell (a paragraph, then ``## 5. ...``) does the same in the export, which cuts the
   cell there (``split_at_headings``); the stored metadata, one type per cell, is the type of the cell's first
   part (JupyterLab's RISE shows such a cell on one slide).
2. Skipped (they stay in the notebook, not on the screen): the first code cell (imports and set-up), code cells
   without outputs longer than ``MAX_SILENT_CODE_LINES`` (helper definitions), code cells whose text output is
   longer than ``MAX_OUTPUT_LINES``, and worked solutions (a code cell opening with ``# Solution``, a markdown cell
   opening with ``A solution``): a lecture leaves them to the learners.
3. A markdown cell opening with ``**Under other configurations.**`` (in the Chinese edition ``**不同配置下。**``; the
   FAQ's per-configuration details) goes to
   the speaker notes (``notes``).
4. Any other cell continues the current slide, unless its estimated height (``cell_height``) would take the slide
   past the deck's line limit: then it opens a subslide. The limit is one screen (``SCREEN_LINES``) where the deck
   fits its share of its lecture's ``SLIDES_PER_LECTURE`` slides (``slide_budget``); otherwise the smallest of
   ``SCREEN_STEPS`` screens that makes it fit (headings alone, when none does), and a slide taller than the screen
   scrolls (the export's template). A 90-minute lecture is then 20-25 slides, not one per screenful of notebook.

The export (``export``) runs nbconvert's ``SlidesExporter`` with the template in ``slides_template/``, which
differs from nbconvert's ``reveal`` template only in loading nothing from the network: reveal.js, RequireJS and
the Jupyter widget manager (``@jupyter-widgets/html-manager``, which renders the saved widget state, so the queue
animator plays without a kernel) are copied from ``node_modules/`` (``npm ci``, versions pinned in
``package.json`` and ``package-lock.json``) into ``lib/`` next to the HTML and referenced by relative path. The
notebooks have no LaTeX and no Mermaid, so MathJax and Mermaid, which nbconvert would load from a CDN, are left
out (``check_offline`` fails on any ``http(s)`` script or style sheet).
"""

from __future__ import annotations

import argparse
import html
import re
import shutil
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

from minivllm.i18n import _, get_language, set_language

# The repository root. The notebooks, images/ and node_modules/ are files of the repository, not of the package:
# they are there in a source checkout (an editable install included), not beside an installed wheel
# (``source_checkout_dir`` says so).
ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS_DIR = ROOT / "notebooks"
TEMPLATE_DIR = Path(__file__).resolve().parent / "slides_template"
TEMPLATE_NAME = "minivllm_reveal"
DEFAULT_OUT = ROOT / "build" / "slides"

#: The guide's seven 90-minute lectures (notebooks/LECTURERS_GUIDE.md, "A course of seven 90-minute lectures"),
#: each the notebooks it shows; ``tests/course/test_slides.py`` checks this against the guide.
LECTURES = (
    ("00_tour", "01_llama_forward_and_generation"),
    ("02_kv_cache", "03_paged_kv_blocks"),
    ("04_continuous_batching", "05_chunked_prefill"),
    ("06_preemption", "07_prefix_caching"),
    ("08_kv_connector", "13_your_engine"),
    ("09_performance", "10_faq"),
    ("11_serving", "12_tensor_parallel"),
)
#: Every notebook is a deck.
SLIDE_NOTEBOOKS = tuple(name for lecture in LECTURES for name in lecture)
SLIDE_TYPES = ("slide", "subslide", "fragment", "-", "skip", "notes")

SLIDES_PER_LECTURE = 24     # the 20-25 slides for a 90-minute lecture, shared by the lecture's decks
SCREEN_LINES = 26           # estimated lines that fit on one 1280x800 slide at the export's font size
SCREEN_STEPS = (1, 1.5, 2, 3, 4, 6)  # line limits tried, in screens, before a deck is cut at its headings only
MAX_SLIDE_LINES = SCREEN_LINES  # the limit of ``slide_types`` without a budget
MAX_SILENT_CODE_LINES = 25  # longer code cells without outputs are helper definitions: skipped
MAX_OUTPUT_LINES = 60       # longer text outputs cannot be read on a slide: skipped
IMAGE_LINES = 16            # an image, a widget or an HTML table counts as this many lines
WRAP_CHARS = 100            # a markdown line is wrapped at about this many characters on a slide

# Files copied from node_modules into <out>/lib (source relative to node_modules, destination relative to lib).
ASSETS = (
    ("reveal.js/dist", "reveal.js/dist"),
    ("reveal.js/plugin/notes", "reveal.js/plugin/notes"),
    ("requirejs/require.js", "require.js"),
    # the widget manager's bundle finds its fonts by its npm path relative to the page (as on a CDN):
    # it keeps that path, beside the HTML rather than in lib/
    ("@jupyter-widgets/html-manager/dist", "../@jupyter-widgets/html-manager/dist"),
)


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _output_text_lines(cell: dict) -> int:
    n = 0
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            text = out.get("text", "")
            n += len(("".join(text) if isinstance(text, list) else text).splitlines())
        elif "data" in out:
            data = out["data"]
            if any(k.startswith("image/") or k.startswith("application/vnd.jupyter.widget") for k in data):
                continue
            if "text/html" in data:
                continue
            text = data.get("text/plain", "")
            n += len(("".join(text) if isinstance(text, list) else text).splitlines())
    return n


def cell_height(cell: dict) -> int:
    """Estimated height of a cell on a slide, in text lines: markdown wrapped at ``WRAP_CHARS`` characters (a
    markdown image: ``IMAGE_LINES``); code
    lines plus text-output lines; ``IMAGE_LINES`` for each image, widget or HTML output (an HTML table: its rows,
    at most ``IMAGE_LINES``)."""
    src = _source(cell)
    if cell["cell_type"] == "markdown":  # a line with an image (``![...](...)``) counts as an image
        return sum(IMAGE_LINES if "![" in line else max(1, -(-len(line) // WRAP_CHARS)) for line in src.splitlines())
    n = len(src.splitlines()) + _output_text_lines(cell)
    for out in cell.get("outputs", []):
        data = out.get("data", {})
        if any(k.startswith("image/") or k.startswith("application/vnd.jupyter.widget") for k in data):
            n += IMAGE_LINES
        elif "text/html" in data:
            rows = "".join(data["text/html"]).count("<tr")
            n += min(IMAGE_LINES, rows + 1)
    return n


def _skipped(cell: dict, first_code: bool) -> bool:
    src = _source(cell).lstrip()
    if cell["cell_type"] == "markdown":
        return src.startswith("A solution")
    if first_code or src.startswith("# Solution"):
        return True
    if not cell.get("outputs") and len(src.splitlines()) > MAX_SILENT_CODE_LINES:
        return True
    return _output_text_lines(cell) > MAX_OUTPUT_LINES


def _chinese_section(src: str) -> Optional[bool]:
    """For a markdown cell: True if it opens a Chinese section (``## 中文导读``), False if it opens another section,
    None if it opens none."""
    m = re.match(r"#{1,6} (.*)", src)
    if not m:
        return None
    return m.group(1).startswith("中文")


def split_at_headings(cells: Sequence[dict]) -> List[tuple]:
    """The cells cut at every heading that does not open its markdown cell (a paragraph, then ``## 5. ...`` in the
    same cell; a ``#`` inside a fenced code block is not a heading, and a heading right below another stays with
    it): ``[(index of the original cell, part)]``, a
    part being a copy of the cell with that piece of its source. Cells without such a heading are one part."""
    parts: List[tuple] = []
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "markdown":
            parts.append((i, cell))
            continue
        pieces: List[List[str]] = [[]]
        fenced = False
        for line in _source(cell).splitlines(keepends=True):
            if line.lstrip().startswith("```"):
                fenced = not fenced
            # a heading right below another (``## 8. Your turn`` then ``### 8a. ...``) stays with it
            if not fenced and re.match(r"#{1,6} ", line) and any(
                    x.strip() and not re.match(r"#{1,6} ", x) for x in pieces[-1]):
                pieces.append([])
            pieces[-1].append(line)
        if len(pieces) == 1:
            parts.append((i, cell))
        else:
            parts += [(i, dict(cell, source="".join(piece).strip("\n"))) for piece in pieces]
    return parts


def _types_with_limit(cells: Sequence[dict], limit: Optional[int]) -> List[str]:
    types: List[str] = []
    used = 0  # estimated lines on the current (sub)slide
    seen_code = False
    chinese = False
    for cell in cells:
        kind = cell["cell_type"]
        src = _source(cell).lstrip()
        first_code = kind == "code" and not seen_code
        seen_code = seen_code or kind == "code"
        if kind == "markdown" and _chinese_section(src) is not None:
            chinese = bool(_chinese_section(src))
        if chinese:
            t = "notes" if kind == "markdown" else "skip"
        elif kind == "markdown" and re.match(r"#{1,2} ", src):
            t, used = "slide", cell_height(cell)
        elif kind == "markdown" and re.match(r"#{3,6} ", src):
            t, used = "subslide", cell_height(cell)
        elif kind == "raw" or _skipped(cell, first_code):
            t = "skip"
        elif kind == "markdown" and src.startswith(("**Under other configurations.**", "**不同配置下。**")):
            t = "notes"
        else:
            h = cell_height(cell)
            if limit is not None and used and used + h > limit:
                t, used = "subslide", h
            else:
                t, used = "-", used + h
        types.append(t)
    return types


def count_slides(types: Sequence[Optional[str]]) -> int:
    """The slides and subslides among ``types`` (what reveal.js's slide number counts, for the parts of
    ``part_slide_types``; a notebook's stored metadata misses the slides its cells open inside themselves)."""
    return sum(t in ("slide", "subslide") for t in types)


def slide_budget(name: str) -> int:
    """The most slides the deck of notebook ``name`` (a stem in ``SLIDE_NOTEBOOKS``) should have: its share of its
    lecture's ``SLIDES_PER_LECTURE``, but no more than the lecture's other decks leave once each has its sections
    (a section is never cut, so a deck with many leaves its neighbour less: lecture 5's 08 has 18, so 13 gets 6).
    KeyError for a notebook of no lecture."""
    for lecture in LECTURES:
        if name in lecture:
            share = SLIDES_PER_LECTURE // len(lecture)
            others = sum(_sections(other) for other in lecture if other != name)
            return min(share, max(_sections(name), SLIDES_PER_LECTURE - others))
    raise KeyError(f"notebook {name!r} is in no lecture of LECTURES")


def _sections(name: str) -> int:
    """The slides of notebook ``name``'s deck cut at its headings only (the fewest it can have)."""
    import json

    cells = json.loads((NOTEBOOKS_DIR / f"{name}.ipynb").read_text(encoding="utf-8"))["cells"]
    return count_slides(_types_with_limit([p for _i, p in split_at_headings(cells)], None))


def line_limit(cells: Sequence[dict], max_slides: int) -> Optional[int]:
    """The overflow limit, in estimated lines, that cuts ``cells`` into at most ``max_slides`` slides (counted on
    ``split_at_headings``'s parts, as exported): the first of ``SCREEN_STEPS`` screens that does, or None (cut at
    the headings only) when none does."""
    parts = [part for _i, part in split_at_headings(cells)]
    for screens in SCREEN_STEPS:
        limit = int(screens * SCREEN_LINES)
        if count_slides(_types_with_limit(parts, limit)) <= max_slides:
            return limit
    return None


def part_slide_types(cells: Sequence[dict], max_slides: Optional[int] = None) -> List[tuple]:
    """``[(index of the original cell, part, slide type)]`` for ``split_at_headings(cells)``: what the export shows.
    A heading inside a cell opens a slide (``##``) or subslide (``###``) there; the cell's stored metadata
    (``slide_types``) is its first part's type, as JupyterLab's RISE, which cannot split a cell, reads it."""
    parts = split_at_headings(cells)
    limit = MAX_SLIDE_LINES if max_slides is None else line_limit(cells, max_slides)
    if max_slides is not None and max_slides < 1:
        raise ValueError(f"max_slides must be >= 1, got {max_slides}")
    types = _types_with_limit([part for _i, part in parts], limit)
    return [(i, part, t) for (i, part), t in zip(parts, types)]


def slide_types(cells: Sequence[dict], max_slides: Optional[int] = None) -> List[str]:
    """The slide type of every cell of a notebook, by the rule in this module's docstring.

    Args:
        cells: the notebook's cells (nbformat 4 dicts: ``cell_type``, ``source``, ``outputs``).
        max_slides: the deck's budget (``slide_budget``); None: overflow at one screen, ``MAX_SLIDE_LINES``.

    Returns:
        One of ``"slide"``, ``"subslide"``, ``"-"``, ``"skip"``, ``"notes"`` per cell, in order.

    Raises:
        ValueError: ``max_slides`` below 1.
    """
    first: Dict[int, str] = {}
    for i, _part, t in part_slide_types(cells, max_slides):
        first.setdefault(i, t)
    return [first[i] for i in range(len(cells))]


def notebook_slide_types(name: str, cells: Sequence[dict]) -> List[str]:
    """``slide_types`` of notebook ``name`` within its lecture's budget (``slide_budget``)."""
    return slide_types(cells, slide_budget(name))


def source_checkout_dir(path: Path, what: str) -> Path:
    """``path``, a folder of the source checkout that holds ``what``, after checking it is there.

    Raises:
        FileNotFoundError: naming the folder and saying that it needs a source checkout (the installed package has
            no notebooks, images or node_modules).
    """
    if not Path(path).is_dir():
        raise FileNotFoundError(
            f"slides: {what} not found at {path}: they are files of the minivllm repository, not of the installed "
            f"package; run this from a source checkout (`pip install -e .` there)")
    return Path(path)


def notebook_paths(names: Iterable[str] = SLIDE_NOTEBOOKS, folder: Path = NOTEBOOKS_DIR) -> List[Path]:
    """The ``.ipynb`` files of ``names`` (notebook stems) in ``folder`` (``notebooks/``); FileNotFoundError names a
    missing one, or the missing folder (``source_checkout_dir``)."""
    source_checkout_dir(folder, f"the course notebooks ({folder})")
    paths = []
    for name in names:
        p = Path(folder) / f"{name}.ipynb"
        if not p.is_file():
            raise FileNotFoundError(f"slide notebook {name!r} not found at {p}")
        paths.append(p)
    return paths


def stored_slide_types(cells: Sequence[dict]) -> List[Optional[str]]:
    """The ``slideshow.slide_type`` stored in each cell's metadata (``None`` where there is none)."""
    return [c.get("metadata", {}).get("slideshow", {}).get("slide_type") for c in cells]


def apply(path: Path, max_slides: Optional[int] = None) -> bool:
    """Write the rule's slide types (``slide_types`` with the budget ``max_slides``; the command passes each
    notebook's ``slide_budget``) into the notebook at ``path``; touches nothing else. Returns whether the file
    changed."""
    import nbformat

    text = path.read_text(encoding="utf-8")
    nb = nbformat.reads(text, as_version=4)
    for cell, t in zip(nb.cells, slide_types(nb.cells, max_slides)):
        cell.metadata["slideshow"] = {"slide_type": t}
    new = nbformat.writes(nb) + "\n"
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


# ---- speaker notes from the run sheets --------------------------------------------------------------------------
LECTURES_DIR = NOTEBOOKS_DIR / "lectures"
_CITE = re.compile(r"«(\d\d) · ([^»]+)»")
_SEGMENT_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|([^|\n]*)\|([^\n]*)\|\s*$", re.M)
_SEGMENT_HEAD = re.compile(r"^## (\d+)\. (.*)$", re.M)
_MD_HEADING = re.compile(r"^#{1,6} (.+)$", re.M)
_FAQ_TAG = re.compile(r"^# (\[Q\d-[a-z]\])", re.M)


def _norm(text: str) -> str:
    return " ".join(text.split())


def run_sheet_segments(text: str) -> List[dict]:
    """The segments of a run sheet (``notebooks/lectures/lecture_NN.md``): for each row of its ``## Segments``
    table, ``{"number", "minutes", "start" (minutes since the lecture began), "title", "cited" [(notebook number,
    heading)] (the on-screen column's «NN · heading» citations, in order), "body" (the markdown of the segment's
    ``## N. ...`` section, heading line included)}``.

    Raises:
        ValueError: no segment table, or a table row without its ``## N.`` section.
    """
    if "## Segments" not in text:
        raise ValueError("run sheet: no '## Segments' table")
    table = text.split("## Segments", 1)[1].split("\n## ", 1)[0]
    heads = list(_SEGMENT_HEAD.finditer(text))
    bodies = {}
    for i, m in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        # the section's own "## N. title" line becomes bold text: a heading inside the notes would read, to a
        # browser and to a test, as a heading of the slide
        body = text[m.start():end].strip()
        bodies[int(m.group(1))] = "**" + body.split("\n", 1)[0][3:].strip() + "**" + body[len(body.split("\n", 1)[0]):]
    segments, start = [], 0
    for m in _SEGMENT_ROW.finditer(table):
        number, minutes = int(m.group(1)), int(m.group(2))
        if number not in bodies:
            raise ValueError(f"run sheet: segment {number} of the table has no '## {number}.' section")
        cited = [(nb, _norm(h)) for nb, h in _CITE.findall(m.group(4))]
        segments.append({"number": number, "minutes": minutes, "start": start, "title": m.group(3).strip(),
                         "cited": cited, "body": bodies[number]})
        start += minutes
    return segments


def _preamble(text: str) -> str:
    """The run sheet's text before ``## Segments`` from its ``**Goal.**`` on (goal, before class, what to cut when
    time runs short); the lines above it (title, notebooks, length, decks) say what the deck already shows."""
    head = text.split("## Segments", 1)[0]
    for label in ("**Goal.**", "**目标。**"):  # the Chinese run sheets (lectures/zh-CN) say 目标
        if label in head:
            return label + " " + head.split(label, 1)[1].strip()
    return "\n".join(line for line in head.splitlines() if not line.startswith("# ")).strip()


def _clock(minutes: int) -> str:
    return f"{minutes // 60}:{minutes % 60:02d}"


class SegmentNotes(str):
    """The markdown of a run-sheet segment's speaker notes (``lecture_notes``): a ``str`` that says it is one, so
    that ``add_notes`` carries it over to the segment's later screens in either language (the Chinese run sheets'
    label is 第 k 个环节, not Segment k). Any string operation on it gives a plain ``str``."""


def lecture_notes(lectures_dir: Path = LECTURES_DIR) -> Dict[str, List[tuple]]:
    """Speaker notes for the decks, from the lectures' run sheets: ``notebook stem -> [(anchor, markdown)]``.

    An anchor is a heading of the notebook (the text after the ``#``s) or a FAQ tag (``[Q3-a]``), or ``None`` for
    the title slide. Each segment's section (minutes, screen, board, demo and fallback, questions with expected
    answers, misconceptions) goes under the first heading its table row cites in one of the lecture's own
    notebooks, headed with its place in the lecture (segment k of n, minutes, clock time); the row's other cited
    headings get it again, marked as continued. The title slide of each of the lecture's decks gets the run
    sheet's preamble (goal, before class) and the segment table, and the first deck's title also the segments that
    cite none of the lecture's notebooks (a recap of an earlier lecture, a title-slide opening). A segment's
    markdown is a ``SegmentNotes``; the overview a plain ``str``. The labels are in the current language
    (``minivllm.i18n``).

    Raises:
        FileNotFoundError: a lecture's run sheet is missing.
    """
    notes: Dict[str, List[tuple]] = {name: [] for lecture in LECTURES for name in lecture}
    for i, lecture in enumerate(LECTURES, start=1):
        path = Path(lectures_dir) / f"lecture_{i:02d}.md"
        if not path.is_file():
            raise FileNotFoundError(f"run sheet of lecture {i} not found at {path}")
        text = path.read_text(encoding="utf-8")
        title = text.splitlines()[0].lstrip("# ").strip()
        segments = run_sheet_segments(text)
        own = {name[:2]: name for name in lecture}
        overview = "\n".join(
            [_("**Run sheet: {title}** ({file})").format(title=title, file=path.name), "", _preamble(text), "",
             _("| # | min | at | segment |"),
             "|---|---|---|---|"]
            + [f"| {g['number']} | {g['minutes']} | {_clock(g['start'])} | {g['title']} |" for g in segments])
        for name in lecture:
            notes[name].append((None, overview))
        for g in segments:
            where = _("**Segment {k} of {n} · {minutes} min · {start}-{end}** ({title})").format(
                k=g["number"], n=len(segments), minutes=g["minutes"], start=_clock(g["start"]),
                end=_clock(g["start"] + g["minutes"]), title=title)
            mine = [(nb, h) for nb, h in g["cited"] if nb in own]
            if not mine:
                notes[lecture[0]].append((None, SegmentNotes(f"{where}\n\n{g['body']}")))
                continue
            first = mine[0]
            notes[own[first[0]]].append((first[1], SegmentNotes(f"{where}\n\n{g['body']}")))
            for nb, h in dict.fromkeys(mine[1:]):
                if (nb, h) != first:
                    continued = _("{where}, continued").format(where=where) + f"\n\n{g['body']}"
                    notes[own[nb]].append((h, SegmentNotes(continued)))
    return notes


def _anchor_index(cells: Sequence[dict], anchor: str) -> Optional[int]:
    for i, cell in enumerate(cells):
        src = _source(cell)
        if cell["cell_type"] == "markdown" and any(_norm(h) == anchor for h in _MD_HEADING.findall(src)):
            return i
        if cell["cell_type"] == "code" and anchor in _FAQ_TAG.findall(src):
            return i
    return None


def add_notes(nb, notes: Sequence[tuple], name: str = "notebook") -> None:
    """Insert each ``(anchor, markdown)`` of ``notes`` (``lecture_notes``) into the notebook node ``nb`` (in memory;
    the file is not touched) as a markdown cell of slide type ``notes`` right after the cell that holds the anchor
    (``None``: after the title cell), so that nbconvert puts it in that slide's ``<aside class="notes">``. A screen
    with no run-sheet notes of its own after the first segment's (a subslide, an uncited section) gets the notes
    of the segment before it, marked as continued: the speaker view shows notes for the current screen only, and
    the lecturer on the demo's third screen still needs its questions. A segment's notes are the
    ``SegmentNotes`` of ``notes`` (whatever the language of their text); the "continued" label is in the current
    language (``minivllm.i18n``).

    Raises:
        KeyError: an anchor that no cell of the notebook holds (a run sheet citing a heading that was renamed).
    """
    import nbformat

    inserts: Dict[int, List[str]] = {}
    for anchor, text in notes:
        i = 0 if anchor is None else _anchor_index(nb.cells, anchor)
        if i is None:
            raise KeyError(f"{name}: the run sheet cites {anchor!r}, which no cell of the notebook holds")
        inserts.setdefault(i, []).append(text)

    def notes_cell(text: str, segment: bool):
        cell = nbformat.v4.new_markdown_cell(text)
        cell.metadata["slideshow"] = {"slide_type": "notes"}
        cell.metadata["minivllm_segment_notes"] = segment
        return cell

    for i in sorted(inserts, reverse=True):
        texts = inserts[i]
        nb.cells.insert(i + 1, notes_cell("\n\n---\n\n".join(texts), any(isinstance(t, SegmentNotes) for t in texts)))
    # screens: runs of cells from a slide/subslide cell to the next
    starts = [i for i, c in enumerate(nb.cells)
              if c.metadata.get("slideshow", {}).get("slide_type") in ("slide", "subslide")]
    carry: Optional[str] = None
    filled = []
    for k, start in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(nb.cells)
        own = [c for c in nb.cells[start:end] if c.metadata.get("minivllm_segment_notes")]
        if own:
            carry = own[-1].source.split("\n\n---\n\n")[-1]
        elif carry is not None:
            filled.append(start)
    continued = _("*(continued from an earlier slide)*")
    for start in reversed(filled):
        # the carry of the screen at ``start``: the last segment notes before it
        before = [c for c in nb.cells[:start] if c.metadata.get("minivllm_segment_notes")]
        text = before[-1].source.split("\n\n---\n\n")[-1]
        nb.cells.insert(start + 1, notes_cell(f"{continued} {text}", False))


def cut_deck(nb, name: str) -> None:
    """Replace the cells of the notebook node ``nb`` (in memory) by the parts the export shows, each with its slide
    type in its metadata (``part_slide_types``, with the budget of the deck ``name`` when it is one of
    ``SLIDE_NOTEBOOKS``): a heading inside a cell opens its own slide in the export."""
    import nbformat

    shown: list = []
    seen: set = set()
    for i, part, t in part_slide_types(nb.cells, slide_budget(name) if name in SLIDE_NOTEBOOKS else None):
        part = nbformat.from_dict(dict(part, metadata=dict(part.get("metadata", {}), slideshow={"slide_type": t})))
        if i in seen and "id" in part:
            part["id"] = f"{part['id']}-{len(shown)}"  # cell ids stay unique
        seen.add(i)
        shown.append(part)
    nb.cells = shown


# ---- export ---------------------------------------------------------------------------------------------------
_REMOTE = re.compile(r"""<(?:script|link)\b[^>]*\b(?:src|href)\s*=\s*["']?(?:https?:)?//""", re.I)
_REMOTE_IMPORT = re.compile(r"""\bimport\b[^;'"]*["'](?:https?:)?//""")


def check_offline(html_text: str) -> List[str]:
    """The remote (``http(s)://`` or protocol-relative) script and style-sheet references in ``html_text``:
    ``<script src>``, ``<link href>`` and ES-module ``import`` URLs. Empty for an offline page."""
    found = [m.group(0) for m in _REMOTE.finditer(html_text)]
    found += [m.group(0) for m in _REMOTE_IMPORT.finditer(html_text)]
    return found


def copy_assets(node_modules: Path, lib: Path) -> None:
    """Copy reveal.js, RequireJS and the widget manager from ``node_modules`` into ``lib``.

    Raises:
        FileNotFoundError: when a package is missing (run ``npm ci`` in the repository root first).
    """
    for src, dst in ASSETS:
        s, d = node_modules / src, lib / dst
        if not s.exists():
            raise FileNotFoundError(f"{s} not found: run `npm ci` in {ROOT} (./course.sh slides does)")
        if d.exists():
            shutil.rmtree(d) if d.is_dir() else d.unlink()
        d.parent.mkdir(parents=True, exist_ok=True)
        if s.is_dir():
            shutil.copytree(s, d, ignore=shutil.ignore_patterns("*.map", "embed.js"))  # embed.js: the non-AMD build, unused
        else:
            shutil.copy2(s, d)
    # The widget controls module inside the bundle resolves its Font Awesome files (the Play button's icons)
    # against its own AMD module path, @jupyter-widgets/, one folder above dist/: they go there too.
    dist = lib.parent / "@jupyter-widgets" / "html-manager" / "dist"
    for font in dist.iterdir():
        if font.suffix in (".woff2", ".woff", ".ttf", ".eot", ".svg"):
            shutil.copy2(font, dist.parent.parent / font.name)


def export(out: Path = DEFAULT_OUT, names: Iterable[str] = SLIDE_NOTEBOOKS,
           node_modules: Path = ROOT / "node_modules", folder: Optional[Path] = None) -> Dict[str, Path]:
    """Export the notebooks ``names`` as reveal.js slides into ``out`` (``<name>.slides.html`` each, an
    ``index.html`` linking them, the assets in ``out/lib`` and ``out/@jupyter-widgets``, the course figures the
    notebooks show in ``out/images``), from their stored outputs: nothing is executed. The folder is
    self-contained: copy it to the lecture machine and open ``index.html``. ``folder``: where the notebooks are
    (default ``notebooks/``; ``notebooks/zh-CN`` gives the Chinese edition's decks, with the speaker notes of the
    Chinese run sheets in ``notebooks/lectures/zh-CN/``).

    Returns:
        ``notebook stem -> HTML file``.

    Raises:
        FileNotFoundError: a notebook or an npm package is missing.
        RuntimeError: an exported page references a remote script or style sheet.
    """
    import nbformat
    from nbconvert import SlidesExporter
    from traitlets.config import Config

    from minivllm.course.viz.frame import FRAME_CSS_SLIDES

    paths = notebook_paths(names, folder or NOTEBOOKS_DIR)
    chinese = folder is not None and Path(folder).resolve() != NOTEBOOKS_DIR.resolve()
    images = source_checkout_dir(ROOT / "images", "the course figures (images/)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    copy_assets(Path(node_modules), out / "lib")
    shutil.copytree(images, out / "images", dirs_exist_ok=True)
    c = Config()
    c.SlidesExporter.extra_template_basedirs = [str(TEMPLATE_DIR)]
    c.SlidesExporter.template_name = TEMPLATE_NAME
    c.SlidesExporter.reveal_url_prefix = "lib/reveal.js"
    c.SlidesExporter.require_js_url = "lib/require.js"
    c.SlidesExporter.widget_renderer_url = "@jupyter-widgets/html-manager/dist/embed-amd.js"
    c.SlidesExporter.reveal_scroll = True
    c.SlidesExporter.reveal_theme = "white"  # its fonts are local; "simple" (the default) loads Google Fonts
    c.SlidesExporter.reveal_width = "1280"
    c.SlidesExporter.reveal_height = "800"
    exporter = SlidesExporter(config=c)
    # The Chinese decks take their speaker notes from the Chinese run sheets (lectures/zh-CN/), which cite the
    # Chinese headings; their labels ("Segment k of n", "continued from an earlier slide") and the index page are
    # in Chinese too: the language is Chinese while they are made.
    before = get_language()
    if chinese:
        set_language("zh_CN")
    try:
        notes = lecture_notes(LECTURES_DIR / "zh-CN" if chinese else LECTURES_DIR)
        written: Dict[str, Path] = {}
        for p in paths:
            nb = nbformat.read(p, as_version=4)
            cut_deck(nb, p.stem)
            add_notes(nb, notes.get(p.stem, []), p.stem)
            body, _resources = exporter.from_notebook_node(nb, resources={"metadata": {"name": p.stem}})
            # the notebooks show the course figures as ../images/NAME.png: the export carries them in <out>/images
            body = re.sub(r'src="(\.\./)+images/', 'src="images/', body)
            # the queue animator's slides layout (larger text, blocks and controls), after nbconvert's own styles
            body = body.replace("</head>", f"<style>{FRAME_CSS_SLIDES}</style>\n</head>", 1)
            remote = check_offline(body)
            if remote:
                raise RuntimeError(f"{p.name}: the exported slides load from the network: {remote[:3]}")
            f = out / f"{p.stem}.slides.html"
            f.write_text(body, encoding="utf-8")
            written[p.stem] = f
        write_index(out, written, "zh-CN" if chinese else "en")
    finally:
        set_language(before)
    return written


def write_index(out: Path, written: Dict[str, Path], lang: str = "en") -> Path:
    """Write ``out/index.html``, a page linking the decks ``written`` (``notebook stem -> HTML file``, in that
    order), its text in the current language (``minivllm.i18n``), ``lang`` its ``<html lang>``. Returns its
    path."""
    links = "\n".join(f'<li><a href="{f.name}">{html.escape(stem)}</a></li>' for stem, f in written.items())
    title = html.escape(_("minivllm: lecture slides"))
    keys = _("Arrow keys move between slides, {s} opens the speaker notes, {esc} the overview.").format(
        s="<kbd>s</kbd>", esc="<kbd>Esc</kbd>")
    page = Path(out) / "index.html"
    page.write_text(
        f"<!DOCTYPE html>\n<html lang=\"{html.escape(lang)}\"><head><meta charset=\"utf-8\"><title>{title}</title>"
        f"</head>\n<body><h1>{title}</h1>\n<ul>\n{links}\n</ul>\n<p>{keys}</p></body></html>\n", encoding="utf-8")
    return page


def main(argv: Optional[List[str]] = None) -> int:
    """``apply`` writes the slide metadata, ``check`` reports notebooks whose metadata differs from the rule
    (exit 1), ``export [--out DIR]`` writes the slides."""
    p = argparse.ArgumentParser(prog="python -m minivllm.course.slides", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("apply", help="write the rule's slide types into the slide notebooks")
    sub.add_parser("check", help="exit 1 if a slide notebook's metadata differs from the rule")
    e = sub.add_parser("export", help="export the slide notebooks as offline reveal.js slides")
    e.add_argument("--out", default=None, help="output folder (default: build/slides, build/slides/zh-CN)")
    e.add_argument("--edition", choices=["en", "zh-CN"], default="en",
                   help="the English decks (default) or the Chinese edition's (notebooks/zh-CN)")
    a = p.parse_args(argv)
    if a.cmd == "apply":
        for path in notebook_paths():
            changed = apply(path, slide_budget(path.stem))
            print(f"[slides] {path.name}: {'updated' if changed else 'unchanged'}")
        return 0
    if a.cmd == "check":
        import json

        bad = []
        for path in notebook_paths():
            cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
            if stored_slide_types(cells) != notebook_slide_types(path.stem, cells):
                bad.append(path.name)
        for name in bad:
            print(f"[slides] {name}: slide metadata differs from the rule; run python -m minivllm.course.slides apply")
        return 1 if bad else 0
    zh = a.edition == "zh-CN"
    out = Path(a.out) if a.out else (DEFAULT_OUT / "zh-CN" if zh else DEFAULT_OUT)
    written = export(out, folder=NOTEBOOKS_DIR / "zh-CN" if zh else None)
    a.out = str(out)
    for stem, f in written.items():
        print(f"[slides] {f}")
    print(f"[slides] open {Path(a.out) / 'index.html'} in a browser (no network needed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
