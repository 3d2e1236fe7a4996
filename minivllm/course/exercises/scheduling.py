"""Checker for notebook 06's running loop: the learner's decisions against the engine's, step by step.

The engine is the reference. Each checker runs a ``TracedLLMEngine`` (the tiny random model: only the mechanics
matter) and, before every ``schedule()``, gives the learner's function a copy of the scheduler's state as it is
at that moment. So every step is checked from the true state, and the first difference is reported with its
step, its request, the expected and the actual decision.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

from minivllm.course.exercises._harness import call, checker, fail


@dataclass
class Workload:
    """One engine run for a checker: settings and requests (``(request id, prompt length, max_tokens)``)."""

    name: str
    engine_kwargs: Dict[str, Any]
    requests: List[Tuple[str, int, int]]

    def describe(self) -> str:
        reqs = ", ".join(f"{rid}: {n}+{m}" for rid, n, m in self.requests)
        kw = ", ".join(f"{k}={v}" for k, v in self.engine_kwargs.items())
        return f"workload {self.name!r} ({kw}; prompt+output tokens {reqs})"

    def engine(self):
        from minivllm import SamplingParams
        from minivllm.course.trace import TracedLLMEngine

        eng = TracedLLMEngine("tiny", **self.engine_kwargs)
        for i, (rid, n, m) in enumerate(self.requests):
            prompt = [10 + 7 * i + j for j in range(n)]  # distinct per request: no two share a block
            eng.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
        return eng


# The workloads of notebook 06 (sections 1 and 5) and two more: chunks next to preemptions, and no memory pressure
# at all (every step admits). Between them they preempt 17 times, self-preemptions included.
RUNNING_LOOP_WORKLOADS = [
    Workload("06 section 1", dict(block_size=4, num_gpu_blocks=9, enable_prefix_caching=False),
             [("A", 8, 20), ("B", 8, 20), ("C", 8, 20)]),
    Workload("06 thrashing", dict(block_size=4, num_gpu_blocks=12, enable_prefix_caching=False),
             [("A", 4, 30), ("B", 4, 8), ("C", 4, 12), ("D", 4, 16), ("E", 4, 20)]),
    Workload("chunks and preemption", dict(block_size=4, num_gpu_blocks=10, max_num_batched_tokens=6,
                                           enable_prefix_caching=False),
             [("A", 10, 9), ("B", 7, 12), ("C", 13, 6), ("D", 5, 10)]),
    Workload("plenty of blocks", dict(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=16, max_num_seqs=3,
                                      enable_prefix_caching=False),
             [("A", 20, 4), ("B", 5, 8), ("C", 12, 3), ("D", 30, 2), ("E", 3, 5)]),
]


def _on_every_schedule(engine, before: Callable, after: Callable) -> None:
    """Call ``before(scheduler)`` before and ``after(state, scheduler_output)`` after every ``schedule()``."""
    sched = engine.scheduler
    real = sched.schedule

    def schedule():
        state = before(sched)
        out = real()
        after(state, out)
        return out

    sched.schedule = schedule


def _ids(xs) -> List[str]:
    return [r if isinstance(r, str) else r.request_id for r in xs]


# -------------------------------------------------------------------------------------------------------------
# 06: the running loop with preemption, and the no-admission gate


def _learner_step(fn: Callable, shadow, case: str, step: int) -> dict:
    """Run ``fn`` on ``shadow`` (a deep copy of the scheduler before ``schedule()``); return what it decided."""
    __tracebackhide__ = True
    ex = "schedule_step"
    running = shadow.running
    before_ids = _ids(running)
    decided = {"preempted": [], "waiting_calls": []}
    where = f"{case}, step {step}"

    def allocate_slots(request, num_new_tokens):
        if request not in running:
            fail(ex, where, f"allocate_slots was called for request {getattr(request, 'request_id', request)!r}, "
                 "which is not in `running` (preempted already?)")
        if not isinstance(num_new_tokens, int) or num_new_tokens <= 0:
            fail(ex, where, f"allocate_slots({request.request_id!r}, {num_new_tokens!r}): the number of tokens "
                 "must be a positive int")
        return shadow.kv_cache_manager.allocate_slots(request, num_new_tokens) is not None

    def preempt(request):
        if request not in running:
            fail(ex, where, f"preempt was called for {getattr(request, 'request_id', request)!r}, which is not "
                 "in `running`")
        running.remove(request)
        shadow._preempt_request(request)
        decided["preempted"].append(request.request_id)

    def schedule_waiting(token_budget):
        decided["waiting_calls"].append((token_budget, list(decided["preempted"])))

    got = call(fn, (running, shadow.config.max_num_batched_tokens, allocate_slots, preempt, schedule_waiting),
               ex, where)
    if not isinstance(got, dict):
        fail(ex, where, f"schedule_step returned {type(got).__name__}, expected a dict request_id -> tokens")
    decided["scheduled"] = got
    decided["running_before"] = before_ids
    return decided


def _compare_step(decided: dict, out, budget: int, case: str, step: int) -> None:
    __tracebackhide__ = True
    ex = "schedule_step"
    where = f"{case}, step {step}"
    cached = out.scheduled_cached_reqs
    admitted = {r.req_id: out.num_scheduled_tokens[r.req_id] for r in out.scheduled_new_reqs}
    admitted.update({rid: out.num_scheduled_tokens[rid] for rid in cached.resumed_req_ids})
    exp_running = {rid: n for rid, n in out.num_scheduled_tokens.items() if rid not in admitted}
    exp_preempted = sorted(out.preempted_req_ids)
    got_preempted = decided["preempted"]
    if sorted(got_preempted) != exp_preempted:
        missing = [r for r in exp_preempted if r not in got_preempted]
        extra = [r for r in got_preempted if r not in exp_preempted]
        what = (f"request {missing[0]!r} should have been preempted, it was not" if missing
                else f"request {extra[0]!r} was preempted, the engine did not preempt it")
        fail(ex, where, f"{what} (preempted: expected {exp_preempted}, got {got_preempted}; running before the "
             f"step: {decided['running_before']})",
             "when allocate_slots fails, preempt the *last* running request (FCFS: running[-1]) and try again, "
             "until the allocation succeeds or the request has preempted itself; a request that fits preempts "
             "nobody.")
    got = decided["scheduled"]
    for rid in decided["running_before"]:
        e, g = exp_running.get(rid, 0), got.get(rid, 0)
        if e != g:
            fail(ex, where, f"request {rid!r}: expected {e} tokens, got {g} (expected {exp_running}, got {got})",
                 "a running request gets min(num_tokens - num_computed_tokens, remaining token_budget) tokens; "
                 "subtract them from the budget; stop when the budget is 0 or a request preempted itself.")
    extra = [rid for rid in got if rid not in decided["running_before"]]
    if extra:
        fail(ex, where, f"the result schedules {extra}, which were not running at the start of the step "
             f"(running: {decided['running_before']}); waiting requests are admitted by schedule_waiting only")
    calls_ = decided["waiting_calls"]
    if len(calls_) > 1:
        fail(ex, where, f"schedule_waiting was called {len(calls_)} times; call it at most once, after the "
             "running loop")
    if exp_preempted:
        if calls_:
            fail(ex, where, f"the waiting queue was served (schedule_waiting was called) in a step that preempted "
                 f"{exp_preempted}; expected no admissions in this step (the engine admitted nothing; its "
                 f"waiting queue starts with the victim)",
                 "the no-admission gate: a step that preempted anyone admits nobody (vLLM 0.32: "
                 "`if not preempted_reqs:` before the waiting loop).")
        return
    remaining = budget - sum(exp_running.values())
    if not calls_:
        if admitted:
            fail(ex, where, f"expected admitted {admitted}, got none: schedule_waiting was not called",
                 "when nobody was preempted, serve the waiting queue: call schedule_waiting(remaining budget).")
        return
    given, preempted_then = calls_[0]
    if preempted_then:
        fail(ex, where, "schedule_waiting was called before the running loop had finished",
             "serve the waiting queue after the running loop, with what is left of the budget.")
    if given != remaining:
        fail(ex, where, f"schedule_waiting was given a budget of {given!r}, expected {remaining} (the budget "
             f"{budget} minus the {sum(exp_running.values())} tokens of the running requests)",
             "pass what is left of the token budget after the running loop.")


@checker("schedule_step")
def check_schedule_step(fn: Callable) -> int:
    """Check ``fn(running, token_budget, allocate_slots, preempt, schedule_waiting)``: one step of the scheduler.

    ``running`` is the running queue (``Request`` objects in admission order: ``request_id``, ``num_tokens``,
    ``num_computed_tokens``); ``token_budget`` is ``max_num_batched_tokens``; ``allocate_slots(request, n)``
    returns ``True`` if blocks for ``n`` more tokens were allocated, ``False`` (nothing changed) if too few are
    free; ``preempt(request)`` removes it from ``running``, frees its blocks, resets its ``num_computed_tokens`` and
    puts it in front of the waiting queue; ``schedule_waiting(budget)`` stands for the engine's waiting loop (its
    admission rules are notebook 04's, not this exercise: the checker records whether and with which budget it is
    called, and a correct call admits exactly what the engine admits). ``fn`` returns ``{request_id: tokens}`` for
    the running requests it scheduled.

    Expected: vLLM 0.32's ``Scheduler.schedule`` (FCFS), which is minivllm's. Before every step of the
    ``RUNNING_LOOP_WORKLOADS`` runs ``fn`` is given a copy of the scheduler's state; its preemptions, token counts
    and whether it served the waiting queue (and with what budget) are compared with the engine's step.

    Raises:
        ExerciseFailed: at the first difference: workload, step, request, expected and actual decision.
    """
    steps = 0
    for w in RUNNING_LOOP_WORKLOADS:
        eng = w.engine()
        budget = eng.scheduler_config.max_num_batched_tokens
        case = w.describe()

        def before(sched, case=case):
            return _learner_step(fn, copy.deepcopy(sched), case, len(eng.trace))

        def after(decided, out, case=case, budget=budget):
            _compare_step(decided, out, budget, case, len(eng.trace))

        _on_every_schedule(eng, before, after)
        eng.run_to_completion(max_steps=500)
        steps += len(eng.trace)
    return steps


__all__ = ["RUNNING_LOOP_WORKLOADS", "Workload", "check_schedule_step"]
