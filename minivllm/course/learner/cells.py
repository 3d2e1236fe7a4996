"""Read a learner's exercise cells out of their saved notebooks, and run them outside Jupyter.

An exercise cell starts with the line ``# Your turn: <part name>`` and is self-contained: it imports what it
uses and defines the part's symbol (a class or a function), nothing else runs in it. The grader reads the
notebook file as saved (``nbformat``), runs the exercise cells of one notebook in order in one fresh namespace,
and takes each part's symbol from there.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import nbformat

from minivllm.i18n import _

MARKER = re.compile(r"^#\s*Your turn:\s*([A-Za-z_][A-Za-z0-9_]*)\s*$")


@dataclass
class ExerciseCell:
    """One exercise cell: its part name, its index in the notebook, its source."""

    part: str
    index: int
    source: str


def exercise_cells(path: str) -> List[ExerciseCell]:
    """The exercise cells of the notebook at ``path``, in order. Raises ``FileNotFoundError``."""
    nb = nbformat.read(path, as_version=4)
    out = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or not cell.source:
            continue
        m = MARKER.match(cell.source.splitlines()[0])
        if m:
            out.append(ExerciseCell(m.group(1), i, cell.source))
    return out


def run_cells(cells: List[ExerciseCell], path: str) -> Dict[str, Any]:
    """Run ``cells`` in order in one fresh namespace; return it. A cell that raises is reported in the namespace
    under ``"__errors__"`` (part -> message) and the next cells still run."""
    ns: Dict[str, Any] = {"__name__": "__learner__", "__errors__": {}}
    for c in cells:
        try:
            exec(compile(c.source, f"{os.path.basename(path)} cell {c.index}", "exec"), ns)  # noqa: S102
        except Exception as e:  # noqa: BLE001 - a broken cell is reported by the grader, not raised
            ns["__errors__"][c.part] = _("running its cell raised {error}: {message}").format(
                error=type(e).__name__, message=e)
    return ns


def notebooks_dir(start: Optional[str] = None) -> str:
    """The course's ``notebooks/`` folder: under ``start`` (default: the working directory) or next to the
    package. Raises ``FileNotFoundError`` naming both places."""
    here = os.path.abspath(start or os.getcwd())
    candidates = [os.path.join(here, "notebooks"), here,
                  os.path.join(os.path.dirname(__file__), "..", "..", "..", "notebooks")]
    for c in candidates:
        if glob.glob(os.path.join(c, "0[0-9]_*.ipynb")):
            return os.path.abspath(c)
    raise FileNotFoundError(f"no course notebooks found in {candidates[0]} or {os.path.abspath(candidates[2])}")


def lesson_notebook(lesson: str, folder: str) -> str:
    """The notebook of ``lesson`` (``"04"``) in ``folder``. Raises ``FileNotFoundError``."""
    found = sorted(glob.glob(os.path.join(folder, f"{lesson}_*.ipynb")))
    if not found:
        raise FileNotFoundError(f"no notebook {lesson}_*.ipynb in {folder}")
    return found[0]
