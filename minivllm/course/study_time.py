"""How long a learner needs for a notebook, estimated from what is in it (not measured).

The estimate counts what a learner reads, runs and writes, at stated rates:

* prose: the words of the markdown cells at ``WORDS_PER_MIN`` words a minute (English technical text; below the
  238 words a minute that Brysbaert's meta-analysis (2019, "How many words do we read per minute?") gives for
  silent reading of non-fiction, because every paragraph here is checked against code), and Chinese characters
  at ``CJK_CHARS_PER_MIN`` characters a minute;
* code: the non-empty lines of the code cells at ``CODE_LINES_PER_MIN`` lines a minute;
* running: ``SECONDS_PER_CELL`` seconds for each code cell (run it, read its output);
* exercises: ``MINUTES_PER_EXERCISE`` minutes for each "Your turn" cell (a code cell that still holds
  ``raise NotImplementedError`` for the learner to replace).

All five rates are assumptions of this course, chosen once and stated here; nothing was timed. The total is
rounded to ``ROUND_TO`` minutes. Each notebook's first cell states it in a line ``**Study time:** about N
minutes ...`` (``header_line``); ``python -m minivllm.course.study_time update`` rewrites those lines,
``python -m minivllm.course.study_time table`` prints the lecturer's guide's syllabus column, and
``tests/test_study_time.py`` accepts a stated value within ``TOLERANCE_MIN`` of the estimate, so small edits
do not break it.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

WORDS_PER_MIN = 180
CJK_CHARS_PER_MIN = 250
CODE_LINES_PER_MIN = 10
SECONDS_PER_CELL = 20
MINUTES_PER_EXERCISE = 10
ROUND_TO = 5
TOLERANCE_MIN = 5

# The course notebooks are files of the repository, not of the package: this folder exists in a source checkout
# (an editable install included), not beside an installed wheel.
NOTEBOOKS_DIR = Path(__file__).resolve().parents[2] / "notebooks"
HEADER_RE = re.compile(r"\*\*Study time:\*\* about (\d+) minutes[^\n]*")
_CJK = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")
_WORD = re.compile(r"[A-Za-z0-9_`'’.-]+")


@dataclass(frozen=True)
class StudyTime:
    """The counts of one notebook and its estimate.

    Attributes:
        words: English (non-CJK) words in markdown cells.
        cjk_chars: Chinese characters in markdown cells.
        code_lines: non-empty lines in code cells.
        code_cells: code cells.
        exercises: "Your turn" cells (code cells with ``raise NotImplementedError``, not solutions).
        minutes: the unrounded estimate, in minutes.
    """

    words: int
    cjk_chars: int
    code_lines: int
    code_cells: int
    exercises: int
    minutes: float

    @property
    def rounded(self) -> int:
        """``minutes`` rounded to the nearest ``ROUND_TO`` minutes (at least ``ROUND_TO``)."""
        return max(ROUND_TO, ROUND_TO * math.floor(self.minutes / ROUND_TO + 0.5))


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def is_exercise(cell: dict) -> bool:
    """A "Your turn" cell: code that still raises ``NotImplementedError`` for the learner, not a solution."""
    src = _source(cell)
    return (cell["cell_type"] == "code" and "raise NotImplementedError" in src
            and not src.lstrip().startswith("# Solution"))


def exercise_names(cells: Sequence[dict]) -> List[str]:
    """The names the learner defines in each exercise cell (the first ``def``/``class`` not named ``check_*``)."""
    names = []
    for c in cells:
        if is_exercise(c):
            defs = [n for n in re.findall(r"^(?:def|class) (\w+)", _source(c), flags=re.M)
                    if not n.startswith("check_")]
            names.append(defs[0] if defs else "?")
    return names


def estimate(cells: Sequence[dict]) -> StudyTime:
    """The study time of a notebook's cells (nbformat 4 dicts), by the rates of this module."""
    words = cjk = lines = code_cells = exercises = 0
    for c in cells:
        src = _source(c)
        if c["cell_type"] == "markdown":
            src = _strip_markup(src)
            cjk += len(_CJK.findall(src))
            words += len(_WORD.findall(_CJK.sub(" ", src)))
        elif c["cell_type"] == "code":
            code_cells += 1
            lines += sum(1 for line in src.splitlines() if line.strip())
            exercises += is_exercise(c)
    minutes = (words / WORDS_PER_MIN + cjk / CJK_CHARS_PER_MIN + lines / CODE_LINES_PER_MIN
               + code_cells * SECONDS_PER_CELL / 60 + exercises * MINUTES_PER_EXERCISE)
    return StudyTime(words, cjk, lines, code_cells, exercises, minutes)


def _strip_markup(md: str) -> str:
    md = re.sub(r"!\[[^\]]*\]\([^)]*\)", " ", md)          # images
    md = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", md)       # links: keep the text
    md = re.sub(r"<[^>]+>", " ", md)                       # HTML tags (<details>, <summary>)
    return md


def notebook_estimate(path: Path) -> StudyTime:
    import json

    return estimate(json.loads(Path(path).read_text(encoding="utf-8"))["cells"])


def header_line(t: StudyTime) -> str:
    """The line a notebook's first cell carries for its study time."""
    return (f"**Study time:** about {t.rounded} minutes (estimated from its words, code, cells and exercises at "
            f"the rates stated in `minivllm/course/study_time.py`, not measured; see `LECTURERS_GUIDE.md`).")


def stated_minutes(cells: Sequence[dict]) -> Optional[int]:
    """The minutes stated by the first cell's ``**Study time:**`` line, or None."""
    m = HEADER_RE.search(_source(cells[0])) if cells else None
    return int(m.group(1)) if m else None


def update(path: Path) -> bool:
    """Write (or rewrite) the study-time line at the end of the notebook's first cell. Returns whether the file
    changed."""
    import nbformat

    text = path.read_text(encoding="utf-8")
    nb = nbformat.reads(text, as_version=4)
    line = header_line(estimate(nb.cells))
    head = nb.cells[0]
    if HEADER_RE.search(head.source):
        head.source = HEADER_RE.sub(lambda _: line, head.source, count=1)
    else:
        head.source = head.source.rstrip("\n") + "\n\n" + line
    new = nbformat.writes(nb) + "\n"
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def notebooks(notebooks_dir: Optional[Path] = None) -> List[Path]:
    """The course notebooks (``NN_*.ipynb`` in ``notebooks_dir``, default ``NOTEBOOKS_DIR``, the source checkout's
    ``notebooks/``; the solutions notebooks in ``notebooks/solutions/`` are not among them).

    Raises:
        FileNotFoundError: the folder does not exist: the notebooks are not installed with the package (a wheel
            install), so the default needs a source checkout.
    """
    folder = NOTEBOOKS_DIR if notebooks_dir is None else Path(notebooks_dir)
    if not folder.is_dir():
        where = ("the course notebooks are files of the repository, not of the installed package: run this from a "
                 "source checkout of minivllm (`pip install -e .` there), or pass the folder "
                 "(`notebooks(notebooks_dir)`, `--notebooks DIR`)" if notebooks_dir is None
                 else "pass the folder that holds the course's NN_*.ipynb notebooks")
        raise FileNotFoundError(f"study_time: no notebooks folder {folder}; {where}")
    return sorted(folder.glob("[0-9][0-9]_*.ipynb"))


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minivllm.course.study_time", description=__doc__.split("\n")[0])
    p.add_argument("cmd", choices=["table", "update"], help="table: print the estimates; update: rewrite headers")
    p.add_argument("--notebooks", default=None, metavar="DIR",
                   help="the folder of the course notebooks (default: notebooks/ of the source checkout)")
    a = p.parse_args(argv)
    try:
        paths = notebooks(a.notebooks)
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 2
    for path in paths:
        if a.cmd == "update":
            print(f"[study time] {path.name}: {'updated' if update(path) else 'unchanged'}")
        else:
            t = notebook_estimate(path)
            print(f"| `{path.stem}` | {t.rounded} | {t.words} | {t.cjk_chars} | {t.code_lines} | {t.code_cells} | "
                  f"{t.exercises} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
