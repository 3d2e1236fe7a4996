"""Shared fixtures. The real model is loaded once per test session (about 10 s)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


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
