"""Engine runs for the scheduler checkers of notebooks 05 and 07: ``Workload`` (settings and requests) and a hook
that sees the scheduler before and after every ``schedule()``.

Notebook 06's running loop is no longer checked here: since issue 26 the learner writes it as a ``scheduler_cls``
subclass that the engine runs, checked by ``minivllm.course.learner.lesson06``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

from minivllm.i18n import _


@dataclass
class Workload:
    """One engine run for a checker: settings and requests (``(request id, prompt length, max_tokens)``)."""

    name: str
    engine_kwargs: Dict[str, Any]
    requests: List[Tuple[str, int, int]]

    def describe(self) -> str:
        reqs = ", ".join(f"{rid}: {n}+{m}" for rid, n, m in self.requests)
        kw = ", ".join(f"{k}={v}" for k, v in self.engine_kwargs.items())
        return _("workload {name} ({settings}; prompt+output tokens {requests})").format(
            name=repr(self.name), settings=kw, requests=reqs)

    def engine(self):
        from minivllm import SamplingParams
        from minivllm.course.trace import TracedLLMEngine

        eng = TracedLLMEngine("tiny", **self.engine_kwargs)
        for i, (rid, n, m) in enumerate(self.requests):
            prompt = [10 + 7 * i + j for j in range(n)]  # distinct per request: no two share a block
            eng.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
        return eng


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


__all__ = ["Workload"]
