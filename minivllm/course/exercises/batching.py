"""Checker for notebook 04's static batching driver (the client holds requests back until a batch has finished)."""

from __future__ import annotations

from typing import Callable, List

from minivllm.course.exercises._harness import call, checker, fail
from minivllm.i18n import _


def _engine(max_num_seqs: int):
    from minivllm.course.trace import TracedLLMEngine

    return TracedLLMEngine("tiny", max_num_seqs=max_num_seqs, max_num_batched_tokens=256,
                     num_gpu_blocks=64, enable_prefix_caching=False)


def _batches_of(trace) -> List[frozenset]:
    """The set of request ids in the engine at each step."""
    return [frozenset(s.running) | frozenset(s.waiting) for s in trace]


@checker("static_batching")
def check_static_batching(fn: Callable) -> int:
    """Check ``fn(engine, prompts, params, batch_size)``: static batching on top of ``LLMEngine``.

    ``fn`` must add ``prompts[i]`` with ``params[i]`` through ``engine.add_request(None, prompt, params)`` in
    batches of ``batch_size`` (the last batch may be smaller), step the engine until every request of the batch
    has finished, and only then add the next batch. The expected run is ``minivllm.course.batching.run_static`` on a
    fresh engine with the same settings: same number of steps, same requests in the engine at every step.

    Raises:
        ExerciseFailed: naming the failing input, what differs, and a hint for known mistakes.
    """
    from minivllm.course.batching import mixed_requests, run_static

    # (requests, batch size, seed); the second ends with a short batch. Short outputs keep the check fast.
    cases = [(8, 4, 7), (7, 3, 1)]
    for n, bs, seed in cases:
        prompts, params = mixed_requests(n, seed=seed, output_lens=(2, 3, 9))
        desc = _("{n} requests of mixed_requests({n}, seed={seed}, output_lens=(2, 3, 9)), batch_size={bs}").format(
            n=n, seed=seed, bs=bs)
        eng = _engine(bs)
        call(fn, (eng, prompts, params, bs), "static_batching", desc)
        got = eng.trace
        ref = run_static(_engine(bs), prompts, params, bs).trace
        if eng.has_unfinished_requests():
            fail("static_batching", desc, _("{n} requests were still unfinished when the function returned").format(
                 n=eng.get_num_unfinished_requests()), _("keep calling engine.step() while engine.has_unfinished_requests()."))
        added = len({r for s in got for r in s.waiting + s.running})  # every request passes through a queue
        if added != n:
            fail("static_batching", desc, _("{added} requests were added to the engine, expected {n}").format(added=added, n=n),
                 _("add every prompt exactly once, with engine.add_request(None, prompt, params)."))
        got_b, ref_b = _batches_of(got), _batches_of(ref)
        if len(got_b) < len(ref_b) or any(len(b) > bs for b in got_b):
            biggest = max(len(b) for b in got_b)
            fail("static_batching", desc,
                 _("the run took {steps} steps with up to {biggest} requests in the engine at once; static "
                   "batching takes {expected} steps with at most {bs}").format(steps=len(got_b), biggest=biggest,
                                                                              expected=len(ref_b), bs=bs),
                 _("add the next batch only after *every* request of the current batch has finished: that is the "
                 "difference from continuous batching, which the engine already does on its own."))
        if got_b != ref_b:
            k = next((i for i, (a, b) in enumerate(zip(got_b, ref_b)) if a != b), min(len(got_b), len(ref_b)))
            fail("static_batching", desc,
                 _("the run took {steps} steps, expected {expected}; first difference at step {k}").format(
                     steps=len(got_b), expected=len(ref_b), k=k),
                 _("batches are consecutive prompts: prompts[0:batch_size], prompts[batch_size:2*batch_size], ...; "
                 "do not step the engine when it has nothing to do."))
    return len(cases)
