"""Shared fixtures. The real model is loaded once per test session (about 10 s)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# ---- test lanes -----------------------------------------------------------------------------------------------
# Each test file carries the marker of the package layer it exercises (registered in pyproject.toml), so that a
# change to one layer runs its lane first: `pytest -m engine`, `pytest -m "core or engine"` (tests/README.md). The
# full suite stays the README's command. Keys are paths relative to tests/; tests/test_packaging.py fails when a
# test file is missing here or a name here is no test file.
LANES = {
    # minivllm/core: scheduler, KV cache manager, block pool (and the scheduler's side of the KV connector)
    "core": (
        "core/test_scheduler.py", "core/test_async_scheduler.py", "core/test_scheduler_seams.py",
        "test_prefix_caching.py", "test_chunked_prefill.py", "test_preemption.py", "test_reset_prefix_cache.py",
        "test_kv_connector_reports.py", "test_randomized.py", "test_soak.py",
    ),
    # minivllm/engine (and the executor it drives in one process): LLM, LLMEngine, EngineCore end to end, the KV
    # connector through the engine
    "engine": (
        "test_engine_core.py", "test_api.py", "test_streaming.py", "test_stop_conditions.py",
        "test_input_edge_cases.py", "test_reliability.py", "test_kv_connector.py", "test_executor.py",
    ),
    # tensor parallelism: minivllm/distributed/parallel_state.py, the multiprocess executor, worker processes
    # (spawned ranks: about 2.5 minutes on two cores, so not in the engine lane)
    "parallel": ("test_tensor_parallel.py",),
    # minivllm/worker, attention, custom_ops + csrc: model runners, block table, sampler, attention, kernels
    "worker": (
        "test_model_runners.py", "test_block_table.py", "test_sampler_edges.py", "test_v2_gumbel.py",
        "test_paged_attention.py", "test_triton_kernels.py", "test_triton_attn_backend.py", "test_custom_ops.py",
        "test_fp32_kernels.py", "test_sampling_features.py", "test_attention_backend_seam.py",
    ),
    # minivllm/model: the Llama model, its loaders, CustomOp dispatch; greedy tokens equal transformers'
    "model": ("test_real_model.py", "test_model_loader.py", "test_custom_op_dispatch.py"),
    # minivllm/entrypoints: the OpenAI-compatible server (and AsyncLLM behind it)
    "entrypoints": ("test_serving.py", "test_server_robustness.py", "test_server_adversarial.py",
                    "test_serving_sampling.py"),
    # minivllm/course and the course's files: exercises, viz, figures, diagrams, slides, notebooks, READMEs
    "course": (
        "test_exercises.py", "test_viz.py", "test_figures.py", "test_diagrams.py", "test_slides.py",
        "test_slides_browser.py", "test_study_time.py", "test_vllm_recordings_course.py", "test_browser.py",
        "test_chinese.py", "test_notebook_files.py", "test_faq_claims.py", "test_readme_commands.py",
        "test_lectures.py",
    ),
    # minivllm/bench: the benchmarks, the GPU check, the live vLLM check
    "bench": ("test_bench.py", "test_bench_serve.py", "test_gpu_check.py", "test_vllm_check.py"),
    # the package as a whole: the import graph between layers, the installed wheel, these lanes
    "package": ("test_import_graph.py", "test_packaging.py"),
}
LANE_OF = {f: lane for lane, files in LANES.items() for f in files}
TESTS_DIR = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        try:
            rel = item.path.resolve().relative_to(TESTS_DIR).as_posix()
        except ValueError:
            continue
        if rel in LANE_OF:
            item.add_marker(getattr(pytest.mark, LANE_OF[rel]))


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
