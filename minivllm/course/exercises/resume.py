"""Checker for the cost of a resume after preemption (notebook 06, prefix caching off), against every resume in
engine runs. (Notebook 07's cached variant of it became the prefix-cache lookup part of issue 26:
``minivllm.course.learner.lesson07``.)"""

from __future__ import annotations

from typing import Callable, List, Tuple

from minivllm.course.exercises._harness import call, checker, fail
from minivllm.course.exercises.scheduling import RUNNING_LOOP_WORKLOADS, Workload, _on_every_schedule
from minivllm.request import RequestStatus


def resume_cases(workloads: List[Workload]) -> List[Tuple[str, str, int, dict, int]]:
    """Every resume in the workloads: ``(workload, request id, step, inputs, tokens the engine computed)``.

    ``inputs`` holds ``num_prompt_tokens`` and ``num_output_tokens`` just before the step that resumed it.
    """
    cases = []
    for w in workloads:
        eng = w.engine()

        def before(sched):
            return {r.request_id: dict(num_prompt_tokens=r.num_prompt_tokens, num_output_tokens=r.num_output_tokens)
                    for r in sched.waiting if r.status == RequestStatus.PREEMPTED}

        def after(state, out, w=w):
            for rid in sorted(out.scheduled_cached_reqs.resumed_req_ids):
                cases.append((w.name, rid, len(eng.trace), state[rid], out.num_scheduled_tokens[rid]))

        _on_every_schedule(eng, before, after)
        eng.run_to_completion(max_steps=500)
    return cases


@checker("resume_cost")
def check_resume_cost(fn: Callable) -> int:
    """Check ``fn(num_prompt_tokens, num_output_tokens)``: the tokens a preempted request computes in the step
    that resumes it, with prefix caching off and a budget large enough for one prefill. Expected: the engine's
    ``num_scheduled_tokens`` of every resume in notebook 06's workloads of sections 1 and 5.

    Raises:
        ExerciseFailed: naming the run, the request, its inputs, expected and returned cost.
    """
    cases = resume_cases(RUNNING_LOOP_WORKLOADS[:2])
    for name, rid, step, inputs, expected in cases:
        args = (inputs["num_prompt_tokens"], inputs["num_output_tokens"])
        desc = f"resume_cost{args} (request {rid!r} resumed in step {step} of {name!r})"
        got = call(fn, args, "resume_cost", desc)
        if got != expected:
            hint = ("the generated tokens are kept and their KV is gone too: they are computed again with the "
                    "prompt.") if got == args[0] else None
            fail("resume_cost", desc, f"returned {got!r}, the engine computed {expected} tokens", hint)
    return len(cases)


__all__ = ["check_resume_cost", "resume_cases"]
