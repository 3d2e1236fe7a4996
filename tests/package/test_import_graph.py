"""The package's import graph: layers import downwards only, the engine imports nothing of the course, no cycles.

Every ``import`` statement of every module under ``minivllm/`` counts, wherever it stands: module level, inside a
function (a lazy import), or under ``if TYPE_CHECKING:`` (a type-level import still ties the two modules together;
``request.py`` <-> ``core/kv_cache_utils.py`` was such a cycle until ``BlockHash`` got its leaf
``core/block_hash.py``).

``from pkg import name`` counts as an import of ``pkg.name`` when that is a module, else of ``pkg``. A package's
``__init__`` is not counted as imported by its submodules: ``minivllm/__init__.py`` loads its public names lazily
(the last test checks at run time that a low layer does not drag torch in).
"""

from __future__ import annotations

import ast
import re
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "minivllm"

# The layers, lowest first. A module belongs to the layer of the longest entry that equals its name or is a
# package above it ("minivllm.core" covers minivllm.core.sched.scheduler). A module may import its own layer and the
# layers below it. "minivllm.engine" alone is the engine package's __init__, a leaf of data types
# (EngineCoreOutput) as in vLLM's vllm/v1/engine/__init__.py; the engine's modules are "minivllm.engine.*".
LAYERS: List[Tuple[str, List[str]]] = [
    # minivllm.i18n (the language switch, standard library only) sits at the bottom: the engine marks the errors
    # the notebooks provoke on purpose with its _().
    ("utils", ["minivllm.utils", "minivllm.metrics", "minivllm.config", "minivllm.envs", "minivllm.i18n"]),
    ("data", ["minivllm.sampling_params", "minivllm.request", "minivllm.outputs", "minivllm.core.block_hash",
              "minivllm.kv_cache_interface", "=minivllm.engine"]),
    # The KV connectors sit beside core: the scheduler calls their scheduler side, and the worker their worker
    # side, so they import core types and nothing above core.
    ("core", ["minivllm.core", "minivllm.distributed"]),
    ("model", ["minivllm.model", "minivllm.attention", "minivllm.custom_ops"]),
    ("worker", ["minivllm.worker"]),
    # The executors (one device in process, worker processes, torchrun) start and drive the workers (vLLM's
    # vllm/v1/executor above vllm/v1/worker); the engine core talks only to an executor.
    ("executor", ["minivllm.executor"]),
    ("engine", ["minivllm.engine", "=minivllm"]),
    # The OpenAI-compatible server on AsyncLLM (vLLM's vllm/entrypoints/openai above vllm/v1/engine).
    ("entrypoints", ["minivllm.entrypoints"]),
    # Users of the engine: the course's tools, the benchmark and the command line.
    ("course", ["minivllm.course", "minivllm.bench", "minivllm.__main__"]),
]
LEVEL = {name: i for i, (name, _) in enumerate(LAYERS)}

# Engine -> course imports that are known and scheduled to go, each as (importing file, module). None left: the
# course's SchedulerTrace is a step observer that the course registers on the engine (issue 14).
ALLOWED_UPWARD: Set[Tuple[str, str]] = set()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> Dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


MODULES = _modules()


def _layer(module: str) -> Optional[str]:
    best, best_len = None, -1
    for name, prefixes in LAYERS:
        for p in prefixes:
            exact = p.startswith("=")
            p = p.lstrip("=")
            if (module == p or (not exact and module.startswith(p + "."))) and len(p) > best_len:
                best, best_len = name, len(p)
    return best


def _imports(path: Path, module: str) -> List[Tuple[int, str]]:
    """``(line, imported minivllm module)`` for every import statement in the file, at any depth."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "minivllm"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                parts = module.split(".")
                parts = parts if is_pkg else parts[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            if base.split(".")[0] != "minivllm":
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((node.lineno, sub if sub in MODULES else base))
    return out


def _graph() -> Dict[str, List[Tuple[int, str]]]:
    return {m: _imports(p, m) for m, p in MODULES.items()}


GRAPH = _graph()


def _where(module: str, line: int) -> str:
    return f"{MODULES[module].relative_to(ROOT)}:{line}"


def test_every_module_has_a_layer():
    missing = [str(p.relative_to(ROOT)) for m, p in MODULES.items() if _layer(m) is None]
    assert not missing, f"modules without a layer (add them to LAYERS in tests/package/test_import_graph.py): " \
        f"{missing}"


def test_the_engine_imports_nothing_of_the_course():
    bad = []
    for m, imports in GRAPH.items():
        if _layer(m) == "course":
            continue
        for line, target in imports:
            if target.startswith("minivllm.course"):
                if (str(MODULES[m].relative_to(ROOT)), target) not in ALLOWED_UPWARD:
                    bad.append(f"{_where(m, line)} imports {target}")
    assert not bad, "the engine must not import course code:\n" + "\n".join(bad)


def test_layers_import_downwards_only():
    bad = []
    for m, imports in GRAPH.items():
        lm = _layer(m)
        for line, target in imports:
            lt = _layer(target)
            if lm is None or lt is None or LEVEL[lt] <= LEVEL[lm]:
                continue
            if (str(MODULES[m].relative_to(ROOT)), target) in ALLOWED_UPWARD:
                continue
            bad.append(f"{_where(m, line)} ({lm}) imports {target} ({lt})")
    assert not bad, "upward imports (lower layer importing a higher one):\n" + "\n".join(bad)


def _find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    color: Dict[str, int] = {}  # 1: on the stack, 2: done
    stack: List[str] = []

    def visit(m: str) -> Optional[List[str]]:
        color[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if color.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in color:
                found = visit(t)
                if found:
                    return found
        stack.pop()
        color[m] = 2
        return None

    for m in sorted(graph):
        if m not in color:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_cycle():
    graph = {m: {t for _, t in imps if t in MODULES and t != m} for m, imps in GRAPH.items()}
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    # The checks above must be able to fail: a two-module cycle and an upward import are found.
    assert _find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None
    assert LEVEL[_layer("minivllm.core.sched.scheduler")] < LEVEL[_layer("minivllm.engine.llm_engine")]
    assert _layer("minivllm.engine") == "data" and _layer("minivllm.course.viz.frame") == "course"


@pytest.mark.parametrize("module", ["minivllm.core.block_pool", "minivllm.core.sched.scheduler"])
def test_low_layers_do_not_load_torch_or_tqdm(module):
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'tqdm') if m in sys.modules))"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", f"importing {module} loads {out.stdout.strip()}"


def _minivllm_env_names(path: Path) -> Set[str]:
    """Every string constant of the file that is a ``MINIVLLM_*`` variable name (docstrings are whole sentences
    and do not match)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return {n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and re.fullmatch(r"MINIVLLM_[A-Z0-9_]+", n.value)}


def test_envs_registers_every_minivllm_variable_the_package_names():
    """``minivllm/envs.py`` says it lists every variable minivllm reads (issue 24: ``MINIVLLM_VLLM_CHECK_MODEL`` and
    the executor's ``MINIVLLM_WORKER_ERROR_FILE`` were read but not listed)."""
    from minivllm import envs

    named = {name: str(p.relative_to(ROOT)) for m, p in MODULES.items() if m != "minivllm.envs"
             for name in _minivllm_env_names(p)}
    assert "MINIVLLM_CPU_KERNELS" in named  # the scan finds names (bench/gpu_check.py sets this one)
    missing = {n: f for n, f in named.items() if n not in envs.environment_variables}
    assert not missing, f"MINIVLLM_* variables named in the package but not registered in envs.py: {missing}"
    doc = envs.__doc__ or ""
    assert all(f"``{n}``" in doc for n in envs.environment_variables), "envs.py's docstring must describe each"


def test_model_runner_v1_does_not_import_v2():
    """Model Runner V2 sits beside V1 (issue 24): V2 may use what the runners share (``model_runner_base``,
    ``sampler``, ``input_batch``), V1's modules import nothing of ``worker/v2``; only the ``Worker``, which chooses
    the runner once, imports both."""
    bad = [f"{_where(m, line)} imports {t}" for m, imps in GRAPH.items()
           if m.startswith("minivllm.worker.") and not m.startswith("minivllm.worker.v2") and m != "minivllm.worker.worker"
           for line, t in imps if t.startswith("minivllm.worker.v2")]
    assert not bad, "V1 must not import V2:\n" + "\n".join(bad)
    assert any(t == "minivllm.worker.v2.model_runner" for _, t in GRAPH["minivllm.worker.worker"])
