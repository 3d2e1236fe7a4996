"""How long a learner needs for a notebook, estimated from what is in it (not measured).

The estimate counts what a learner reads, runs and writes, at stated rates:

* prose: the words of the markdown cells at ``WORDS_PER_MIN`` words a minute (English technical text; below the
  238 words a minute that Brysbaert's meta-analysis (2019, "How many words do we read per minute?") gives for
  silent reading of non-fiction, because every paragraph here is checked against code), and Chinese characters
  at ``CJK_CHARS_PER_MIN`` characters a minute;
* code: the non-empty lines of the code cells at ``CODE_LINES_PER_MIN`` lines a minute;
* running: ``SECONDS_PER_CELL`` seconds for each code cell (run it, read its output);
* exercises: each "Your turn" cell (a code cell that still holds ``raise NotImplementedError`` for the learner
  to replace) and each prediction cell (``name = None  # your prediction``, checked by a ``check_*`` call) by its
  difficulty (``EXERCISE_STARS``, the lecturer's guide's ★ column) at ``MINUTES_PER_STARS`` minutes: ★ one
  formula or loop, 10 minutes (write it, run the checker, fix one thing); ★★ several pieces or an edge case, 20;
  ★★★ combines earlier pieces, 40 (re-reading them and debugging against a step-by-step checker). A flat 10
  minutes an exercise, as before, gave 13.5 hours for a course whose ★★★ exercises take an hour for many learners.

All rates are assumptions of this course, chosen once and stated here; nothing was timed. The total is rounded
to ``ROUND_TO`` minutes. Each notebook states it in its one time line, ``**Time:** about N minutes of study
(...)``, in its first cell (``header_line``), followed by how long its cells take to run where the notebook says
so; ``python -m minivllm.course.study_time update`` rewrites the study part of those lines,
``python -m minivllm.course.study_time table`` prints the lecturer's guide's syllabus column, and
``tests/course/test_study_time.py`` accepts a stated value within ``TOLERANCE_MIN`` of the estimate, so small edits
do not break it.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

WORDS_PER_MIN = 180
CJK_CHARS_PER_MIN = 250
CODE_LINES_PER_MIN = 10
SECONDS_PER_CELL = 20
MINUTES_PER_STARS = {1: 10, 2: 20, 3: 40}
#: The difficulty of every exercise, ``(notebook number, name) -> stars``, as the lecturer's guide's exercise
#: table states it (``tests/course/test_study_time.py`` checks the two agree and that every exercise has one).
EXERCISE_STARS = {
    ("01", "rms_norm"): 1, ("01", "rope"): 2, ("01", "gqa_attention"): 2, ("01", "swiglu"): 1,
    ("01", "decoder_layer"): 3, ("01", "greedy_generate"): 2,
    ("02", "KVCache"): 2, ("02", "cached_attention"): 2,
    ("03", "slot_mapping"): 1, ("03", "write_kv"): 1, ("03", "gather_kv"): 2, ("03", "paged_attention"): 3,
    ("04", "WaitingLoop"): 3, ("04", "predicted"): 1, ("04", "static_batching"): 2,
    ("05", "predict_chunks"): 2, ("05", "predicted"): 2, ("05", "ChunkSizing"): 2, ("05", "flatten_batch"): 2,
    ("05", "predicted_returns"): 1, ("05", "predicted_threshold"): 1, ("05", "predicted_batch"): 1,
    ("06", "predicted_victim"): 1, ("06", "predicted_resume"): 1, ("06", "predicted_gate"): 1,
    ("06", "RunningLoop"): 2, ("06", "Preemption"): 3,
    ("07", "PrefixCacheLookup"): 2, ("07", "predicted_hit"): 1, ("07", "predicted_same_preemptions"): 1,
    ("08", "FixedConnector"): 3, ("08", "predicted_loads"): 1,
}
ROUND_TO = 5
TOLERANCE_MIN = 5

# The course notebooks are files of the repository, not of the package: this folder exists in a source checkout
# (an editable install included), not beside an installed wheel.
NOTEBOOKS_DIR = Path(__file__).resolve().parents[2] / "notebooks"
HEADER_RE = re.compile(r"\*\*Time:\*\* about (\d+) minutes of study \([^()\n]*\)")
#: A line that states a time in bold (``**Time:**``, ``**Run time:**``, ``**Study time:**``, ``**Time.**``): a
#: notebook has exactly one, its ``HEADER_RE`` line.
TIME_LABEL_RE = re.compile(r"\*\*(?:[A-Za-z]+ )?[Tt]ime[:.]\*\*")
_PREDICTION = re.compile(r"^(\w+) = None  # your prediction", re.M)
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
        exercises: "Your turn" and prediction cells (``exercise_names``, ``prediction_names``).
        exercise_minutes: their minutes, by difficulty (``MINUTES_PER_STARS``).
        minutes: the unrounded estimate, in minutes.
        predictions: how many of ``exercises`` are prediction cells.
    """

    words: int
    cjk_chars: int
    code_lines: int
    code_cells: int
    exercises: int
    minutes: float
    exercise_minutes: int = 0
    predictions: int = 0

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


def prediction_names(cells: Sequence[dict]) -> List[str]:
    """The names of the prediction cells (``predicted = None  # your prediction ...``): the learner fills in a
    value, a ``check_*`` call judges it."""
    return [m.group(1) for c in cells if c["cell_type"] == "code" for m in _PREDICTION.finditer(_source(c))]


def exercise_stars(notebook: str, cells: Sequence[dict]) -> Dict[str, int]:
    """``name -> stars`` of every exercise and prediction of notebook ``notebook`` (its number, ``"05"``).

    Raises:
        KeyError: an exercise without a difficulty in ``EXERCISE_STARS`` (add it there and to the guide's table).
    """
    out = {}
    for name in exercise_names(cells) + prediction_names(cells):
        if (notebook, name) not in EXERCISE_STARS:
            raise KeyError(f"exercise {name!r} of notebook {notebook} has no difficulty in "
                           f"minivllm/course/study_time.py EXERCISE_STARS (and the guide's exercise table)")
        out[name] = EXERCISE_STARS[(notebook, name)]
    return out


def estimate(cells: Sequence[dict], stars: Optional[Dict[str, int]] = None) -> StudyTime:
    """The study time of a notebook's cells (nbformat 4 dicts), by the rates of this module.

    Args:
        cells: the notebook's cells.
        stars: ``exercise name -> difficulty`` (1-3 stars) for its exercises and predictions (``exercise_stars``).

    Raises:
        ValueError: an exercise or prediction without a difficulty in ``stars``, or a difficulty outside 1-3.
    """
    stars = {} if stars is None else stars
    names = exercise_names(cells) + prediction_names(cells)
    missing = [n for n in names if n not in stars]
    if missing:
        raise ValueError(f"stars: no difficulty for the exercise(s) {missing}; pass exercise_stars(notebook, cells)")
    bad = {n: stars[n] for n in names if stars[n] not in MINUTES_PER_STARS}
    if bad:
        raise ValueError(f"stars: a difficulty is 1, 2 or 3 stars, got {bad}")
    exercise_minutes = sum(MINUTES_PER_STARS[stars[n]] for n in names)
    words = cjk = lines = code_cells = 0
    for c in cells:
        src = _source(c)
        if c["cell_type"] == "markdown":
            src = _strip_markup(src)
            cjk += len(_CJK.findall(src))
            words += len(_WORD.findall(_CJK.sub(" ", src)))
        elif c["cell_type"] == "code":
            code_cells += 1
            lines += sum(1 for line in src.splitlines() if line.strip())
    minutes = (words / WORDS_PER_MIN + cjk / CJK_CHARS_PER_MIN + lines / CODE_LINES_PER_MIN
               + code_cells * SECONDS_PER_CELL / 60 + exercise_minutes)
    return StudyTime(words, cjk, lines, code_cells, len(names), minutes, exercise_minutes,
                     len(prediction_names(cells)))


def _strip_markup(md: str) -> str:
    md = re.sub(r"!\[[^\]]*\]\([^)]*\)", " ", md)          # images
    md = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", md)       # links: keep the text
    md = re.sub(r"<[^>]+>", " ", md)                       # HTML tags (<details>, <summary>)
    return md


def notebook_estimate(path: Path) -> StudyTime:
    import json

    cells = json.loads(Path(path).read_text(encoding="utf-8"))["cells"]
    return estimate(cells, exercise_stars(Path(path).stem[:2], cells))


def header_line(t: StudyTime) -> str:
    """The study part of a notebook's time line (the notebook may follow it with how long its cells run)."""
    if t.exercises:
        k, m = t.exercises - t.predictions, t.predictions
        if k and m:
            which = f"its {k} exercise{'s' * (k != 1)} and {m} prediction{'s' * (m != 1)}"
        elif k:
            which = "its exercise" if k == 1 else f"its {k} exercises"
        else:
            which = "its prediction" if m == 1 else f"its {m} predictions"
        ex = f"{t.exercise_minutes} of them for {which} by difficulty; "
    else:
        ex = ""
    return (f"**Time:** about {t.rounded} minutes of study ({ex}estimated at the rates stated in "
            f"`minivllm/course/study_time.py`, not measured; see `LECTURERS_GUIDE.md`)")


def stated_minutes(cells: Sequence[dict]) -> Optional[int]:
    """The minutes stated by the first cell's ``**Time:** about N minutes of study`` line, or None."""
    m = HEADER_RE.search(_source(cells[0])) if cells else None
    return int(m.group(1)) if m else None


def time_lines(cells: Sequence[dict]) -> List[str]:
    """Every line of the markdown cells that states a time under a bold label (``TIME_LABEL_RE``)."""
    return [line for c in cells if c["cell_type"] == "markdown" for line in _source(c).splitlines()
            if TIME_LABEL_RE.search(line)]


def update(path: Path) -> bool:
    """Write (or rewrite) the study part of the time line in the notebook's first cell (a new line at its end when
    it has none), keeping what follows it. Returns whether the file changed."""
    import nbformat

    text = path.read_text(encoding="utf-8")
    nb = nbformat.reads(text, as_version=4)
    line = header_line(estimate(nb.cells, exercise_stars(path.stem[:2], nb.cells)))
    head = nb.cells[0]
    if HEADER_RE.search(head.source):
        head.source = HEADER_RE.sub(lambda _: line, head.source, count=1)
    else:
        head.source = head.source.rstrip("\n") + "\n\n" + line + "."
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
                  f"{t.exercises} | {t.exercise_minutes} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
