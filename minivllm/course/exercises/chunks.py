"""Checkers for notebook 05 (chunked prefill): predicted chunk sizes against the engine's, step by step."""

from __future__ import annotations

from typing import Callable, Dict, List

from minivllm.course.exercises._harness import call, checker, fail, not_written
from minivllm.i18n import ljust
from minivllm.course.exercises.scheduling import Workload
from minivllm.i18n import _


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
        for _step in range(prompt_len + 5):  # enough steps for a prompt that gets at least one token per step
            if "p" not in eng.scheduler.requests:
                break
            eng.step()
        expected = eng.trace.chunk_sizes("p")  # [] if the decoders left it nothing in all those steps
        desc = f"predict_chunks{(prompt_len, budget, num_decoding)}"
        got = call(fn, (prompt_len, budget, num_decoding), "predict_chunks", desc)
        if list(got) != expected:
            fail("predict_chunks", desc, _("returned {got}, the engine scheduled {expected}").format(
                got=list(got), expected=expected),
                 _("running requests are served first: every decoder takes 1 token of the budget in every step."))
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
    for _step in range(SHARED_BUDGET_FIRST_STEP):
        eng.step()
    return eng


def show_shared_budget() -> None:
    """Print the state the chunk prediction starts from: the budget and every request's counters, queue order."""
    eng = shared_budget_engine()
    waiting, running = eng.scheduler.queue_snapshot()
    print(_("token budget (max_num_batched_tokens): {budget}; block_size {block_size}, free blocks {free}").format(
        budget=eng.scheduler_config.max_num_batched_tokens, block_size=eng.cache_config.block_size,
        free=eng.kv_cache_manager.num_free_blocks))
    print(_("before step {step}:").format(step=SHARED_BUDGET_FIRST_STEP))
    for queue, ids in (("running", running), ("waiting", waiting)):
        for pos, rid in enumerate(ids):
            r = eng.get_request(rid)
            status = r.status.name + (_(" (preempted {n}x)").format(n=r.num_preemptions) if r.num_preemptions else "")
            print(_("  {queue}[{pos}] {rid}: {status} prompt {prompt:2d}, generated {generated:2d}, "
                    "num_computed_tokens {computed:2d}, max_tokens {max_tokens}").format(
                queue=queue, pos=pos, rid=rid, status=ljust(status, 24), prompt=r.num_prompt_tokens,
                generated=r.num_output_tokens, computed=r.num_computed_tokens, max_tokens=r.max_tokens))


def shared_budget_chunks() -> List[Dict[str, int]]:
    """What the engine schedules in the ``SHARED_BUDGET_NUM_STEPS`` steps from ``SHARED_BUDGET_FIRST_STEP`` on."""
    eng = shared_budget_engine()
    for _step in range(SHARED_BUDGET_NUM_STEPS):
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
        fail(ex, _("the prediction"), _("expected a list of {n} dicts (one per step), got {value}").format(
            n=len(expected), value=repr(predicted)))
    for k, (exp, got) in enumerate(zip(expected, predicted)):
        step = SHARED_BUDGET_FIRST_STEP + k
        if not isinstance(got, dict):
            fail(ex, _("step {step}").format(step=step), _("expected a dict request id -> tokens, got {value}").format(
                value=repr(got)))
        for rid in sorted(set(exp) | set(got)):
            if exp.get(rid, 0) != got.get(rid, 0):
                hint = _("running requests first, in order, each min(num_tokens - num_computed_tokens, budget left); "
                        "then the waiting queue in order, from its head. A resumed request computes its prompt "
                        "*and* its generated tokens again, chunked like any prefill.")
                fail(ex, _("step {step}, request {rid}").format(step=step, rid=repr(rid)),
                     _("predicted {predicted} tokens, the engine scheduled {expected}").format(
                         predicted=got.get(rid, 0), expected=exp.get(rid, 0)), hint)
    return len(expected)


__all__ = ["SHARED_BUDGET", "check_chunk_prediction", "check_predict_chunks", "shared_budget_chunks",
           "show_shared_budget"]
