"""Checkers for notebook 05 (chunked prefill): predicted chunk sizes against the engine's, step by step."""

from __future__ import annotations

from typing import Callable, Dict, List

from minivllm.course.exercises._harness import call, checker, fail, not_written
from minivllm.course.exercises.scheduling import Workload


@checker("predict_chunks")
def check_predict_chunks(fn: Callable) -> int:
    """Check ``fn(prompt_len, budget, num_decoding)``: the chunk sizes of a prompt of ``prompt_len`` tokens that
    arrives while ``num_decoding`` requests decode (until it is done), at a token budget of ``budget``; ``[]`` if
    the decoders take the whole budget. Expected: the engine's chunk sizes (tiny model), on six cases.

    Raises:
        ExerciseFailed: naming the case, the expected and the returned chunks.
    """
    from minivllm import SamplingParams
    from minivllm.course.trace import TracedLLMEngine

    cases = [(160, 64, 0), (160, 64, 2), (100, 32, 3), (50, 64, 1), (64, 64, 1), (20, 4, 4)]
    for prompt_len, budget, num_decoding in cases:
        eng = TracedLLMEngine("tiny", max_num_batched_tokens=budget, enable_prefix_caching=False)
        for i in range(num_decoding):
            eng.add_request(f"d{i}", [7 + i], SamplingParams(temperature=0, max_tokens=1000))
        eng.step()  # the decoders' one-token prompts; from now on they decode
        eng.add_request("p", list(range(1, prompt_len + 1)), SamplingParams(temperature=0, max_tokens=1))
        for _ in range(prompt_len + 5):  # enough steps for a prompt that gets at least one token per step
            if "p" not in eng.scheduler.requests:
                break
            eng.step()
        expected = eng.trace.chunk_sizes("p")  # [] if the decoders left it nothing in all those steps
        desc = f"predict_chunks{(prompt_len, budget, num_decoding)}"
        got = call(fn, (prompt_len, budget, num_decoding), "predict_chunks", desc)
        if list(got) != expected:
            fail("predict_chunks", desc, f"returned {list(got)}, the engine scheduled {expected}",
                 "running requests are served first: every decoder takes 1 token of the budget in every step.")
    return len(cases)


# Four requests in 10 blocks of 4 at a budget of 6. Before step 11, A has finished, B decodes, C (preempted in
# step 5, after 3 output tokens) waits at the head of the queue, D has not started.
SHARED_BUDGET = Workload("05 shared budget", dict(block_size=4, num_gpu_blocks=10, max_num_batched_tokens=6,
                                                  enable_prefix_caching=False),
                         [("A", 11, 10), ("B", 10, 16), ("C", 5, 11), ("D", 8, 9)])
SHARED_BUDGET_FIRST_STEP = 11
SHARED_BUDGET_NUM_STEPS = 3


def shared_budget_engine():
    """The ``SHARED_BUDGET`` engine, stepped up to (not including) step ``SHARED_BUDGET_FIRST_STEP``."""
    eng = SHARED_BUDGET.engine()
    for _ in range(SHARED_BUDGET_FIRST_STEP):
        eng.step()
    return eng


def show_shared_budget() -> None:
    """Print the state the chunk prediction starts from: the budget and every request's counters, queue order."""
    eng = shared_budget_engine()
    waiting, running = eng.scheduler.queue_snapshot()
    print(f"token budget (max_num_batched_tokens): {eng.scheduler_config.max_num_batched_tokens}; "
          f"block_size {eng.cache_config.block_size}, free blocks {eng.kv_cache_manager.num_free_blocks}")
    print(f"before step {SHARED_BUDGET_FIRST_STEP}:")
    for queue, ids in (("running", running), ("waiting", waiting)):
        for pos, rid in enumerate(ids):
            r = eng.get_request(rid)
            status = r.status.name + (f" (preempted {r.num_preemptions}x)" if r.num_preemptions else "")
            print(f"  {queue}[{pos}] {rid}: {status:24s} prompt {r.num_prompt_tokens:2d}, generated "
                  f"{r.num_output_tokens:2d}, num_computed_tokens {r.num_computed_tokens:2d}, max_tokens "
                  f"{r.max_tokens}")


def shared_budget_chunks() -> List[Dict[str, int]]:
    """What the engine schedules in the ``SHARED_BUDGET_NUM_STEPS`` steps from ``SHARED_BUDGET_FIRST_STEP`` on."""
    eng = shared_budget_engine()
    for _ in range(SHARED_BUDGET_NUM_STEPS):
        eng.step()
    return [dict(s.num_scheduled_tokens) for s in eng.trace.steps[SHARED_BUDGET_FIRST_STEP:]]


@checker("chunk_prediction")
def check_chunk_prediction(predicted) -> int:
    """Check a prediction of the tokens each request computes in steps 11, 12 and 13 of ``SHARED_BUDGET``
    (``show_shared_budget()`` prints the state before step 11).

    ``predicted`` is a list of three dicts ``{request id: tokens}`` (a request that computes nothing in a step may
    be left out, or given 0). ``None`` means not done yet. Expected: the engine's ``num_scheduled_tokens``.

    Raises:
        ExerciseFailed: at the first step and request that differ.
    """
    not_written(predicted, "predicted")
    expected = shared_budget_chunks()
    ex = "chunk_prediction"
    if not isinstance(predicted, (list, tuple)) or len(predicted) != len(expected):
        fail(ex, "the prediction", f"expected a list of {len(expected)} dicts (one per step), got {predicted!r}")
    for k, (exp, got) in enumerate(zip(expected, predicted)):
        step = SHARED_BUDGET_FIRST_STEP + k
        if not isinstance(got, dict):
            fail(ex, f"step {step}", f"expected a dict request id -> tokens, got {got!r}")
        for rid in sorted(set(exp) | set(got)):
            if exp.get(rid, 0) != got.get(rid, 0):
                hint = ("running requests first, in order, each min(num_tokens - num_computed_tokens, budget left); "
                        "then the waiting queue in order, from its head. A resumed request computes its prompt "
                        "*and* its generated tokens again, chunked like any prefill.")
                fail(ex, f"step {step}, request {rid!r}", f"predicted {got.get(rid, 0)} tokens, the engine "
                     f"scheduled {exp.get(rid, 0)}", hint)
    return len(expected)


__all__ = ["SHARED_BUDGET", "check_chunk_prediction", "check_predict_chunks", "shared_budget_chunks",
           "show_shared_budget"]
