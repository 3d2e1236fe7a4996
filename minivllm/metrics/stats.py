"""Scheduler and prefix-cache counters (vLLM: ``vllm/v1/metrics/stats.py``).

minivllm differs from vLLM here: vLLM's ``SchedulerStats`` is a snapshot the scheduler makes each step for the
loggers (queue lengths, KV usage); minivllm has no stat loggers, so ``SchedulerStats`` counts a whole run and is
read directly (``LLMEngine.num_preemptions``, the CLI summary, the benchmark, notebook 07).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerStats:
    """Counters of a whole run, kept by the ``Scheduler`` (one increment per ``schedule()`` call).

    Attributes:
        num_steps: ``schedule()`` calls so far.
        num_preemptions: requests preempted so far (a request preempted twice counts twice).
        num_scheduled_tokens: tokens scheduled so far (prefill chunks plus decodes), in tokens.
    """

    num_steps: int = 0
    num_preemptions: int = 0
    num_scheduled_tokens: int = 0


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters, in tokens (vLLM ``PrefixCacheStats``). Counted once per admission.

    ``requests``/``queries``/``hits`` count first admissions; the ``preempted_*`` fields count re-admissions after
    a preemption apart, as vLLM does, so that recomputation does not inflate the hit rate.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    @property
    def hit_rate(self) -> float:
        """``hits / queries`` of first admissions, in [0, 1]; 0.0 before any query."""
        return self.hits / self.queries if self.queries else 0.0
