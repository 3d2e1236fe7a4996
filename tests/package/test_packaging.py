"""The package as ``pip install .`` gives it, not as the source checkout does (issue 24).

A wheel is built from this checkout (``pip wheel --no-deps --no-build-isolation``: offline, with the project
venv's setuptools) and installed with ``--no-deps`` into a fresh ``python -m venv``; a ``.pth`` file puts the project
venv's site-packages after the fresh venv's own (its ``.pth`` files are not run, so the project's editable install
of minivllm is not seen), which gives the dependencies without a network or a second multi-GB torch. From a temporary
directory (no source tree on ``sys.path``), that interpreter imports every module and name the notebooks import from
minivllm, reads the vLLM recordings and scenarios the course shows (``minivllm.course.vllm_recordings``), and checks
that the modules reading repository files (the notebooks) say they need a source checkout. Every tracked non-``.py``
file under ``minivllm/`` must be in the wheel (``[tool.setuptools.package-data]`` in ``pyproject.toml``).

About 15 s on two busy cores, most of it importing torch, transformers and matplotlib.

``test_every_test_file_has_one_lane`` checks the test lanes (``tests/conftest.py``, tests/README.md): the suite's
markers by package layer, one per folder of tests/, which ``pytest -m "core or engine"`` and the like select.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").rglob("*.ipynb"))


def notebook_imports() -> dict:
    """``{module: sorted names}``: what the notebooks' code cells import from minivllm (``import minivllm.x`` gives
    the module with no names)."""
    found: dict = {}
    for path in NOTEBOOKS:
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            if cell["cell_type"] != "code":
                continue
            src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            # IPython lines (%magic, !shell) are not Python
            src = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in src.splitlines())
            for node in ast.walk(ast.parse(src, filename=path.name)):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] == "minivllm":
                    found.setdefault(node.module, set()).update(a.name for a in node.names)
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        if a.name.split(".")[0] == "minivllm":
                            found.setdefault(a.name, set())
    return {m: sorted(names) for m, names in sorted(found.items())}


# Runs in the fresh venv, cwd a temporary directory; prints one JSON line.
PROBE = r"""
import importlib, json, sys
imports = json.loads(sys.argv[1])
problems = []
import minivllm
for mod, names in imports.items():
    try:
        m = importlib.import_module(mod)
    except Exception as e:
        problems.append(f"import {mod}: {type(e).__name__}: {e}")
        continue
    for name in names:
        if not hasattr(m, name):
            try:
                importlib.import_module(f"{mod}.{name}")
            except Exception as e:
                problems.append(f"from {mod} import {name}: {type(e).__name__}: {e}")
try:
    from minivllm.bench.vllm_check import load_scenarios
    from minivllm.course import vllm_recordings as vr
    names = [s["name"] for s in load_scenarios()["scenarios"]]
    for mode in vr.recordings()["modes"]:
        for name in vr.recordings()["modes"][mode]["scenarios"]:
            vr.scenario(name)
            vr.step_rows(vr.run(name, mode)["steps"], block_id_offset=1)
    recorded = sorted(vr.recordings()["modes"])
except Exception as e:
    problems.append(f"vllm_recordings: {type(e).__name__}: {e}")
    names, recorded = [], []
checkout_errors = {}
from minivllm.course import slides, study_time
for what, call in (("study_time.notebooks", study_time.notebooks), ("slides.notebook_paths", slides.notebook_paths)):
    try:
        call()
        checkout_errors[what] = None
    except FileNotFoundError as e:
        checkout_errors[what] = str(e)
print(json.dumps({"file": minivllm.__file__, "problems": problems, "scenarios": names, "modes": recorded,
                  "checkout_errors": checkout_errors,
                  "template": (slides.TEMPLATE_DIR / slides.TEMPLATE_NAME / "index.html.j2").is_file()}))
"""


def _run(cmd, **kw):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, **kw)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the checkout's package (so no ``build/`` or ``*.egg-info`` is written into the
    checkout, and none left there from an earlier build gets in)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    shutil.copy2(ROOT / "pyproject.toml", src / "pyproject.toml")
    shutil.copytree(ROOT / "minivllm", src / "minivllm",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", tmp / "dist", src], cwd=tmp)
    (whl,) = (tmp / "dist").glob("minivllm-*.whl")
    return whl


@pytest.fixture(scope="module")
def venv_python(wheel, tmp_path_factory) -> Path:
    """A fresh venv's python with the wheel installed; the dependencies come from this venv's site-packages."""
    venv = tmp_path_factory.mktemp("venv") / "v"
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    py = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    purelib = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    Path(purelib, "_project_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n", encoding="utf-8")
    _run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", "-q", wheel])
    return py


def test_the_wheel_holds_every_tracked_data_file(wheel):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to list the tracked files")
    tracked = subprocess.run(["git", "ls-files", "minivllm"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    data = {f for f in tracked if not f.endswith(".py") and (ROOT / f).is_file()}
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(data - in_wheel)
    assert not missing, (f"tracked files of the package missing from the wheel: {missing}; add them to "
                         f"[tool.setuptools.package-data] in pyproject.toml")


def test_the_installed_package_runs_what_the_notebooks_import(venv_python, tmp_path):
    imports = notebook_imports()
    assert "minivllm.course" in imports and "minivllm" in imports, imports  # the scan found the notebooks' imports
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONNOUSERSITE="1", OMP_NUM_THREADS="1",
               MPLBACKEND="Agg")
    r = _run([venv_python, "-c", PROBE, json.dumps(imports)], cwd=tmp_path, env=env)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert Path(out["file"]).resolve().is_relative_to(venv_python.parent.parent.resolve()), \
        f"minivllm came from {out['file']}, not from the installed wheel"
    assert out["problems"] == [], "\n".join(out["problems"])
    assert out["scenarios"] and out["modes"], out
    assert out["template"], "the slides template is not in the installed package"
    for what, message in out["checkout_errors"].items():
        assert message is not None and "source checkout" in message, \
            f"{what}() in an installed package should fail saying it needs a source checkout, gave: {message!r}"


def test_every_test_file_has_one_lane(pytestconfig, request):
    """Each ``test_*.py`` under tests/ sits in a lane folder, ``tests/<lane>/``: conftest.py marks its tests with the
    folder's name, so a file is in exactly one lane (one at the top of tests/ would be in none, and ``pytest -m ...``
    would skip it silently). Every lane folder is a package and a marker registered in pyproject.toml (``pytest
    --markers`` lists the lanes), and the marker reaches the tests: this one carries ``package`` and no other."""
    from tests import conftest

    files = sorted(p.relative_to(ROOT / "tests") for pattern in ("test_*.py", "*_test.py")
                   for p in (ROOT / "tests").rglob(pattern) if "__pycache__" not in p.parts)
    assert [f.as_posix() for f in files if len(f.parts) == 1] == [], \
        "test files in no lane: move them into the tests/ folder of the layer they exercise (tests/README.md)"
    lanes = {f.parts[0] for f in files}
    assert {conftest.lane_of(ROOT / "tests" / f) for f in files} == lanes
    # A package, as pytest's default import mode needs to tell two files of one name in two folders apart; it also
    # keeps tests/ on sys.path (the shared helpers there import by name).
    assert sorted(lane for lane in lanes if not (ROOT / "tests" / lane / "__init__.py").is_file()) == [], \
        "lane folders without __init__.py"
    registered = {m.split(":")[0].strip() for m in pytestconfig.getini("markers")}
    assert lanes <= registered, f"lane folders that are no marker in pyproject.toml: {sorted(lanes - registered)}"
    assert request.node.get_closest_marker("package") is not None
    assert [lane for lane in lanes if lane != "package" and request.node.get_closest_marker(lane)] == []
