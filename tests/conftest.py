"""Shared fixtures. The real model is loaded once per test session (about 10 s)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# float32 on the exact reference (PyTorch's operators), chosen here as ./course.sh chooses it for the course: the
# tests and the notebooks under nbval compare float32 results bit for bit, on every CPU class. The tests of the
# fast path (tests/worker/test_fp32_kernels.py) set it to 1 themselves.
os.environ.setdefault("MINIVLLM_CPU_KERNELS_FP32", "0")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# ---- test lanes -----------------------------------------------------------------------------------------------
# Test files sit in folders that mirror the package (tests/core, tests/engine, tests/worker, ...: tests/README.md),
# and a file's folder is its lane: the marker, registered in pyproject.toml, that this hook adds to each of its tests,
# so that a change to one layer runs its lane first: `pytest -m engine`, `pytest -m "core or engine"`. The full suite
# stays the README's command. The lane is read from the path, so a file is in exactly one lane and cannot drift from
# it; tests/package/test_packaging.py fails on a test file outside a lane folder or a folder that is no marker.
# Each lane folder is a package (__init__.py): pytest imports its files as `engine.test_api` and so on, with tests/
# itself on sys.path, which keeps the shared helpers here (kv_invariants.py, step_logits.py,
# triton_child.py) importable by name.
TESTS_DIR = Path(__file__).resolve().parent


def lane_of(path) -> str | None:
    """The lane of the test file at ``path``: the folder right under tests/ that holds it; None for a file outside
    tests/ (the notebooks under nbval) or at its top level."""
    try:
        parts = Path(path).resolve().relative_to(TESTS_DIR).parts
    except ValueError:
        return None
    return parts[0] if len(parts) > 1 else None


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        lane = lane_of(item.path)
        if lane is not None:
            item.add_marker(getattr(pytest.mark, lane))


@pytest.fixture(scope="session")
def real_llm():
    """SmolLM2-135M-Instruct through minivllm, fp32, CPU."""
    from minivllm import LLM

    return LLM(dtype="float32")


@pytest.fixture(scope="session")
def hf_model():
    """The same GGUF loaded by Hugging Face transformers (fp32): the numerical reference."""
    import warnings

    import torch
    from transformers import AutoModelForCausalLM

    from minivllm.model.loader import default_model_path

    path = default_model_path()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
        )
    return model.eval()


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module: the tiny model gains nothing from a second thread, and loses a lot when the
    other core is busy."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def count_kernel_calls(monkeypatch):
    """``count(names)`` wraps each ``minivllm.custom_ops.<name>`` (for this test only) and returns a dict
    ``{name: calls so far}`` that the wrappers keep up to date: which C++ kernels a step really ran."""
    from minivllm import custom_ops

    def count(names):
        calls = {name: 0 for name in names}
        for name in names:
            kernel = getattr(custom_ops, name)

            def counted(*a, _name=name, _kernel=kernel):
                calls[_name] += 1
                return _kernel(*a)

            monkeypatch.setattr(custom_ops, name, counted)
        return calls

    return count


def make_tiny_engine(traced=False, **kw):
    """A tiny random-weight engine (fp32); keyword arguments override the defaults below.

    ``traced=True`` (or ``record_inputs=True``) gives the course's ``TracedLLMEngine``, which records ``.trace``.
    """
    from minivllm import LLMEngine
    from minivllm.course.trace import TracedLLMEngine

    kw.setdefault("enable_prefix_caching", False)
    return (TracedLLMEngine if traced or kw.get("record_inputs") else LLMEngine)("tiny", **kw)


def run_all(engine, max_steps=100000):
    """Step until empty; returns ``{request_id: final RequestOutput}``."""
    return engine.run_to_completion(max_steps=max_steps)
