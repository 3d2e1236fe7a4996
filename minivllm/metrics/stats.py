"""Scheduler and prefix-cache statistics (vLLM: ``vllm/v1/metrics/stats.py``).

``SchedulerStats`` is vLLM's: the snapshot the scheduler makes after each step (``Scheduler.make_stats``), carried
to the front end in ``EngineCoreOutputs.scheduler_stats`` (``/metrics`` reads it). ``SchedulerCounters`` is
minivllm's: counters of a whole run, read directly (``Scheduler.stats``: ``LLMEngine.num_preemptions``, the CLI
summary, the benchmark, notebook 07); vLLM counts preemptions from the requests' events instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class SchedulerStats:
    """One step's view of the scheduler (vLLM ``SchedulerStats``, the fields minivllm has).

    Attributes:
        num_running_reqs / num_waiting_reqs: requests in the running and waiting queues after the step.
        kv_cache_usage: fraction of the pool's blocks in use, in [0, 1] (``KVCacheManager.usage``).
        step_counter: ``schedule()`` calls so far.
        num_preemptions: preemptions since the engine started (minivllm's addition; see the module docstring).
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    step_counter: int = 0
    num_preemptions: int = 0


@dataclass
class SchedulerCounters:
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


@dataclass
class RequestStateStats:
    """One request's timing, taken by the output processor as its tokens arrive (vLLM ``RequestStateStats``, the
    fields minivllm has). Times are ``time.monotonic()`` seconds.

    Attributes:
        arrival_time: when the front end took the request.
        first_token_ts / last_token_ts: when its first and its latest token came out of a step (``None`` before).
        num_generation_tokens: tokens generated so far.
    """

    arrival_time: float
    first_token_ts: Optional[float] = None
    last_token_ts: Optional[float] = None
    num_generation_tokens: int = 0

    @property
    def first_token_latency(self) -> Optional[float]:
        """Seconds from arrival to the first token (vLLM's time to first token), or ``None`` before it."""
        return None if self.first_token_ts is None else self.first_token_ts - self.arrival_time
