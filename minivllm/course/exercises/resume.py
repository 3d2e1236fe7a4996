"""Checker for the cost of a resume after preemption with prefix caching on (notebook 07), against every resume in
engine runs. (Notebook 06 asks for the cost with prefix caching off as a prediction, issue 26.)"""

from __future__ import annotations

from typing import Callable, List, Tuple

from minivllm.course.exercises._harness import call, checker, fail
from minivllm.course.exercises.scheduling import Workload, _on_every_schedule
from minivllm.request import RequestStatus


# Notebook 06's workloads of sections 1 and 5 with prefix caching on, and two more with several victims each.
RESUME_COST_WORKLOADS = [
    Workload("06 section 1, caching on", dict(block_size=4, num_gpu_blocks=9), [("A", 8, 20), ("B", 8, 20),
                                                                                 ("C", 8, 20)]),
    Workload("06 thrashing, caching on", dict(block_size=4, num_gpu_blocks=12),
             [("A", 4, 30), ("B", 4, 8), ("C", 4, 12), ("D", 4, 16), ("E", 4, 20)]),
    Workload("four requests of 12 tokens", dict(block_size=4, num_gpu_blocks=10),
             [("r0", 12, 12), ("r1", 12, 12), ("r2", 12, 12), ("r3", 12, 12)]),
    Workload("many victims", dict(block_size=4, num_gpu_blocks=11),
             [("A", 6, 25), ("B", 3, 18), ("C", 9, 14), ("D", 2, 22), ("E", 5, 9), ("F", 7, 11)]),
]


def cached_block_flags(scheduler, request) -> List[bool]:
    """For each full block of ``request``'s tokens, in order: is its hash in the prefix cache right now?"""
    cached = scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
    return [h in cached for h in request.block_hashes]


def resume_cases(workloads=RESUME_COST_WORKLOADS) -> List[Tuple[str, str, int, dict, int]]:
    """Every resume in the workloads: ``(workload, request id, step, inputs, tokens the engine computed)``.

    ``inputs`` holds ``num_prompt_tokens``, ``num_output_tokens``, ``block_size`` and ``cached`` (for each full
    block of the request's tokens: was its hash cached just before the step that resumed it).
    """
    cases = []
    for w in workloads:
        eng = w.engine()
        bs = eng.cache_config.block_size

        def before(sched):
            return {r.request_id: dict(num_prompt_tokens=r.num_prompt_tokens, num_output_tokens=r.num_output_tokens,
                                       block_size=bs, cached=cached_block_flags(sched, r))
                    for r in sched.waiting if r.status == RequestStatus.PREEMPTED}

        def after(state, out, w=w):
            for rid in sorted(out.scheduled_cached_reqs.resumed_req_ids):
                cases.append((w.name, rid, len(eng.trace), state[rid], out.num_scheduled_tokens[rid]))

        _on_every_schedule(eng, before, after)
        eng.run_to_completion(max_steps=500)
    return cases


@checker("resume_cost_cached")
def check_resume_cost_cached(fn: Callable) -> int:
    """Check ``fn(num_prompt_tokens, num_output_tokens, block_size, cached)``: the tokens a preempted request
    computes in the step that resumes it, with prefix caching on.

    ``cached`` has one bool per full block of the request's tokens (prompt and generated), in order: whether that
    block's hash was in the prefix cache when the request was resumed. The budget is large enough for the whole
    resume to be one prefill. Expected: the engine's ``num_scheduled_tokens`` of every resume in the
    ``RESUME_COST_WORKLOADS`` runs (vLLM 0.32: ``KVCacheManager.get_computed_blocks``, which stops at the first
    miss, as a block's hash chains those of all blocks before it).

    Raises:
        ExerciseFailed: naming the run, the request, its inputs, expected and returned cost.
    """
    cases = resume_cases()
    for name, rid, step, inputs, expected in cases:
        args = (inputs["num_prompt_tokens"], inputs["num_output_tokens"], inputs["block_size"], inputs["cached"])
        desc = f"resume_cost{args} (request {rid!r} resumed in step {step} of {name!r})"
        got = call(fn, (*args[:3], list(args[3])), "resume_cost_cached", desc)
        if got != expected:
            n = args[0] + args[1]
            hint = None
            if got == n:
                hint = "with prefix caching on, the cached blocks are not computed again."
            elif got == n - args[2] * sum(args[3]):
                hint = ("only the cached blocks *before the first miss* count: a block's hash includes the hashes "
                        "of all blocks before it (notebook 07, section 1), so the lookup stops at the first miss.")
            fail("resume_cost_cached", desc, f"returned {got!r}, the engine computed {expected} tokens", hint)
    return len(cases)


__all__ = ["RESUME_COST_WORKLOADS", "cached_block_flags", "check_resume_cost_cached", "resume_cases"]
