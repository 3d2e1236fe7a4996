"""The notebook files themselves, checked in milliseconds before nbval spends minutes running them.

nbval refuses a code cell that has stored outputs but no ``execution_count`` ("Unrun reference cell has
outputs"); a cell added or split by hand gets exactly that, and CI found it only after 26 minutes.
"""

import json
from pathlib import Path

import pytest

# notebooks/ and its subfolders (solutions/), as nbval collects them; never Jupyter's checkpoint copies
NOTEBOOKS = sorted(p for p in (Path(__file__).resolve().parent.parent / "notebooks").rglob("*.ipynb")
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
