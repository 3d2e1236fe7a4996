"""The grader: ``./course.sh grade [NN ...]`` or ``python -m minivllm.course.grade [NN ...]``.

Reads the learner's exercise cells from their saved notebooks (``cells.py``), runs every part's checker on them,
hidden workloads included, and prints a progress table per lesson. A failed part gets its first difference (step,
request, field; expected and yours side by side) and hints: the first by default, more with ``--hints 2`` or
``--hints 3`` (a nudge, the idea, the line to write). ``--solutions`` grades the notebooks of
``notebooks/solutions/`` instead. Exit status: 0 when every graded part passes, 1 otherwise (blank parts count
as not passed).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import textwrap
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from minivllm.i18n import ljust, text_width
from minivllm.course.learner import cells as _cells
from minivllm.course.learner.parts import Part, hints_now, load_all, run_check
from minivllm.i18n import N_, _, set_language

#: The status column's words (English; translated where printed).
STATUS_MARK = {"passed": N_("✓ passed"), "failed": N_("✗ failed"), "blank": N_("· blank"), "error": N_("✗ error")}


def learner_namespaces(folder: str, lessons: Sequence[str], solutions: bool) -> Dict[str, Tuple[Dict[str, Any], str]]:
    """part name -> (the namespace its exercise cell ran in, the notebook's file name)."""
    if solutions:
        paths = sorted(glob.glob(os.path.join(folder, "solutions", "*.ipynb")))
    else:
        paths = []
        for lesson in lessons:
            try:
                paths.append(_cells.lesson_notebook(lesson, folder))
            except FileNotFoundError:
                continue
    found: Dict[str, Tuple[Dict[str, Any], str]] = {}
    for path in paths:
        cells = _cells.exercise_cells(path)
        if not cells:
            continue
        ns = _cells.run_cells(cells, path)
        for c in cells:
            found[c.part] = (ns, os.path.basename(path))
    return found


def grade(lessons: Optional[Sequence[str]] = None, folder: Optional[str] = None, solutions: bool = False,
          hints: int = 1, out=None) -> List[Tuple[Part, str, str, float]]:
    """Grade ``lessons`` (default: every lesson with parts); print the table and the failures to ``out``.

    Returns ``(part, status, message, seconds)`` per part; status is ``passed``, ``failed``, ``blank`` or
    ``error`` (its cell did not run).
    """
    out = out or sys.stdout
    parts = load_all()
    wanted = sorted({p.lesson for p in parts.values()}) if not lessons else [f"{int(x):02d}" for x in lessons]
    folder = folder or _cells.notebooks_dir()
    spaces = learner_namespaces(folder, wanted, solutions)
    results = []
    for part in parts.values():
        if part.lesson not in wanted:
            continue
        t0 = time.perf_counter()
        if part.name not in spaces:
            status, msg = "blank", _("no cell starting '# Your turn: {name}' in the notebook").format(name=part.name)
        else:
            ns, _nb = spaces[part.name]
            err = ns["__errors__"].get(part.name)
            if err:
                status, msg = "error", err
            else:
                status, msg = run_check(part, ns.get(part.symbol), hidden=True)
        results.append((part, status, msg, time.perf_counter() - t0))
    _print_table(results, wanted, out, solutions)
    for part, status, msg, _secs in results:
        if status in ("failed", "error"):
            print(f"\n── {part.lesson} {part.name} ({part.symbol}) ──\n{msg}", file=out)
            for i, h in enumerate(hints_now(part)[:max(0, hints)]):
                print(_("  Hint {i}:").format(i=i + 1) + "\n" + textwrap.indent(h, "      "), file=out)
            if hints < 3:
                print(_("  (more hints: --hints {n})").format(n=hints + 1), file=out)
    return results


def _print_table(results, lessons, out, solutions) -> None:
    if solutions:
        print(_("Grading the solutions notebooks (hidden cases included)") + "\n", file=out)
    else:
        print(_("Grading your notebooks (hidden cases included)") + "\n", file=out)
    head_what, head_status, head_time = _("what you write"), _("status"), _("time")
    width = max([text_width(_(r[0].writes)) for r in results] + [14, text_width(head_what)]) + 2
    status_width = max([text_width(_(m)) for m in STATUS_MARK.values()] + [text_width(head_status)]) + 2
    status_width = max(status_width, 10)
    time_width = max(6, text_width(head_time))
    print(ljust(_("lesson"), 7) + ljust(_("part"), 22) + ljust(head_what, width) + ljust(head_status, status_width)
          + " " * (time_width - text_width(head_time)) + head_time, file=out)
    for lesson in lessons:
        rows = [r for r in results if r[0].lesson == lesson]
        for part, status, _msg, secs in rows:
            print(f"{lesson:<7}{part.name:<22}" + ljust(_(part.writes), width) + ljust(_(STATUS_MARK[status]),
                                                                                     status_width)
                  + f"{secs:>{time_width - 1}.1f}s", file=out)
        if rows:
            done = sum(1 for r in rows if r[1] == "passed")
            print(f"{'':<7}{'':<22}" + ljust(_("lesson {lesson}, parts passed: {done} of {total}").format(
                lesson=lesson, done=done, total=len(rows)), width), file=out)
    done = sum(1 for r in results if r[1] == "passed")
    print("\n" + _("In all: {done} of {total} parts passed.").format(done=done, total=len(results)), file=out)
    if any(r[1] == "blank" for r in results):
        print(_("{blank}: the part's '# Your turn: <part>' cell in its notebook is not written yet, or the notebook "
                "is not saved (the grader reads the saved file)").format(blank=_(STATUS_MARK["blank"])), file=out)


def _edition_language(folder: str) -> Optional[str]:
    """The language of the notebooks in ``folder``: ``"zh_CN"`` for the Chinese edition (its notebooks' metadata
    says so, written by ``minivllm.course.edition``), else ``None``."""
    for path in sorted(glob.glob(os.path.join(folder, "0[0-9]_*.ipynb")))[:1]:
        with open(path, encoding="utf-8") as f:
            return json.load(f).get("metadata", {}).get("minivllm", {}).get("edition")
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minivllm.course.grade", description=__doc__.split("\n\n")[0])
    ap.add_argument("lessons", nargs="*", help="lesson numbers (03 ... 08); default: all")
    ap.add_argument("--notebooks", default=None, help="the course's notebooks folder (default: ./notebooks)")
    ap.add_argument("--solutions", action="store_true", help="grade notebooks/solutions/ instead")
    ap.add_argument("--hints", type=int, default=1, choices=[0, 1, 2, 3], help="hints shown per failed part")
    args = ap.parse_args(argv)
    for x in args.lessons:
        if not x.isdigit():
            ap.error(f"lessons must be numbers such as 04, got {x!r}")
    folder = args.notebooks or _cells.notebooks_dir()
    if not os.environ.get("MINIVLLM_LANG") and _edition_language(folder):
        set_language(_edition_language(folder))  # the Chinese edition's learner reads the verdicts in Chinese
    results = grade(args.lessons, folder, args.solutions, args.hints)
    return 0 if results and all(r[1] == "passed" for r in results) else 1
