"""Your engine (issue 26): every part of the solutions notebooks in one engine schedules as vLLM 0.32 recorded, and
the committed (blank) notebooks give an engine of reference parts that says so."""

import pytest

from minivllm.core.sched.scheduler import Scheduler
from minivllm.course.learner import parts
from minivllm.course.learner.your_engine import assemble, check_against_vllm, engine_kwargs, scheduler_cls


@pytest.fixture(scope="module")
def solutions():
    return assemble("solutions", verbose=False)


def test_every_part_of_the_solutions_is_used(solutions):
    assert set(solutions.objs) == set(parts.load_all())
    assert all(solutions.yours.values()), solutions.table()


def test_the_solutions_scheduler_is_one_class_of_every_lessons_part(solutions):
    cls = scheduler_cls(solutions)
    owners = {name: next(c for c in cls.__mro__ if name in vars(c)).__module__
              for name in ("_schedule_waiting", "_schedule_running", "_preempt_request", "_prefix_cache_lookup",
                           "_num_new_tokens_waiting", "_admission_gate_open")}
    assert set(owners.values()) == {"__learner__"}, owners
    kw = engine_kwargs(solutions)
    assert kw["attention_backend"].get_name() == "LEARNER"
    assert type(kw["kv_connector"]).__module__ == "__learner__"


def test_the_solutions_schedule_every_course_scenario_as_vllm_did(solutions):
    results = check_against_vllm(solutions)
    assert len(results) == 8
    assert [name for name, ok, _ in results if not ok] == [], [r for _, ok, r in results if not ok]


def test_the_blank_notebooks_run_the_reference_and_say_so(capsys):
    chosen = assemble("notebooks")
    out = capsys.readouterr().out
    assert not any(chosen.yours.values())
    n = len(parts.load_all())
    assert f"0 of {n} parts are yours" in out and out.count("not written yet") == n
    cls = scheduler_cls(chosen)  # the references override nothing: every method is the engine's Scheduler's
    for name in ("_schedule_waiting", "_schedule_running", "_preempt_request", "_prefix_cache_lookup",
                 "_num_new_tokens_waiting", "_admission_gate_open", "_allocate_slots_or_preempt"):
        assert next(c for c in cls.__mro__ if name in vars(c)) is Scheduler, name


def test_a_wrong_part_is_replaced_by_the_reference(solutions):
    class NoGate(Scheduler):
        def _schedule_running(self, step):
            super()._schedule_running(step)

        def _admission_gate_open(self, step):
            return True

    objs = {name: obj for name, obj in solutions.objs.items()}
    objs["running_loop"] = NoGate
    chosen = assemble(objs, verbose=False)
    assert chosen.yours["running_loop"] is False
    assert chosen.objs["running_loop"] is parts.get("running_loop").reference
    assert "does not pass its checker yet" in chosen.why["running_loop"]


def test_smollm2_through_the_solutions_engine_equals_transformers(solutions):
    """The issue's "your engine" run: SmolLM2 (float32, greedy) with every part of the solutions (their attention
    backend, scheduler and connector) gives transformers' tokens (transformers reads the same GGUF itself)."""
    from minivllm.course.learner.your_engine import check_against_transformers

    for with_connector in (False, True):  # without one, 04's loop runs (with one it hands steps to the reference)
        [(yours, ref)] = check_against_transformers(solutions, ["What is the capital of France?"], max_tokens=8,
                                                    with_connector=with_connector)
        assert len(yours) == 8 and yours == ref, with_connector


def test_the_flattened_batch_and_the_attention_backend_run_in_the_built_engine(solutions):
    from minivllm.course.learner.your_engine import build_llm

    llm = build_llm(solutions, with_connector=False, model="tiny")
    runner = llm.llm_engine.model_runner
    assert getattr(runner._prepare_inputs, "keywords", {}).get("flatten") is solutions.objs["flattened_batch"]
    assert llm.llm_engine.scheduler.__class__.__name__ == "YourScheduler"
