"""The notebook files themselves, checked in milliseconds before nbval spends minutes running them.

nbval refuses a code cell that has stored outputs but no ``execution_count`` ("Unrun reference cell has
outputs"); a cell added or split by hand gets exactly that, and CI found it only after 26 minutes.
"""

import json
import re
from pathlib import Path

import pytest

# notebooks/ and its subfolders (solutions/), as nbval collects them; never Jupyter's checkpoint copies
NOTEBOOKS = sorted(p for p in (Path(__file__).resolve().parents[2] / "notebooks").rglob("*.ipynb")
                   if ".ipynb_checkpoints" not in p.parts)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_code_cell_with_outputs_was_run(path):
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    unrun = [i for i, c in enumerate(cells)
             if c["cell_type"] == "code" and c.get("outputs") and c.get("execution_count") is None]
    assert unrun == [], f"{path.name}: code cells {unrun} have outputs but no execution_count"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_execution_counts_run_in_order(path):
    """A notebook checked by nbval was run top to bottom once: its counts strictly increase."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    counts = [c["execution_count"] for c in cells if c["cell_type"] == "code" and c.get("execution_count")]
    assert counts == sorted(set(counts)), f"{path.name}: execution counts out of order: {counts}"


def _src(cell):
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def _stdout(cell):
    return "".join("".join(o.get("text", "")) for o in cell.get("outputs", []))


def _checked_output(cells, i):
    """What checked cell ``i``: its own output, or, for an exercise cell of issue 26 (``# Your turn: <part>``,
    which only defines the part), the output of the next code cell, the one that calls ``check``."""
    if not _src(cells[i]).startswith("# Your turn:"):
        return _stdout(cells[i])
    nxt = next((c for c in cells[i + 1:] if c["cell_type"] == "code"), None)
    return _stdout(nxt) if nxt is not None else ""


COURSE = [p for p in NOTEBOOKS if "solutions" not in p.parts]
SOLUTIONS = [p for p in NOTEBOOKS if "solutions" in p.parts]


@pytest.mark.parametrize("path", COURSE, ids=lambda p: p.name)
def test_exercises_are_stubs_and_solutions_are_elsewhere(path):
    """The course notebooks keep the learner's stubs, run unfilled (the checker says "not written yet" or "not
    done yet", never ✓); every exercise's worked solution is in a solutions notebook, and passed there."""
    from minivllm.course.study_time import exercise_names, is_exercise

    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    assert not [i for i, c in enumerate(cells) if c["cell_type"] == "code" and _src(c).lstrip().startswith(
        "# Solution")], f"{path.name}: a '# Solution' cell; move it to notebooks/solutions/"
    for i, c in enumerate(cells):
        if c["cell_type"] == "code":
            assert "✓" not in _stdout(c), f"{path.name}: cell {i} prints ✓: a solution ran in the notebook"
        if is_exercise(c):
            out = _checked_output(cells, i)
            # the Chinese edition's checkers say the same in Chinese (minivllm/locale)
            assert any(s in out for s in ("not written yet", "not done yet", "还没有写", "还没有完成")), \
                f"{path.name}: exercise cell {i} says {out!r}"
    solved = {}
    for p in SOLUTIONS:
        sol_cells = json.loads(p.read_text(encoding="utf-8"))["cells"]
        for i, c in enumerate(sol_cells):
            for name in re.findall(r"^(?:def|class) (\w+)", _src(c), flags=re.M):
                solved[name] = _checked_output(sol_cells, i)
    for name in exercise_names(cells):
        assert name in solved, f"{path.name}: no worked solution of {name} in notebooks/solutions/"
        assert solved[name].startswith("✓ "), f"{path.name}: the solution of {name} does not pass: {solved[name]!r}"
