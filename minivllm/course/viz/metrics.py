"""Numbers of a recorded run: per-request latency in steps, and how full each step's batch was.

Steps are the time unit: one step is one forward pass of the whole batch, which is how vLLM's engine core
advances (``vllm/v1/engine/core.py`` ``EngineCore.step``). On a GPU a decode step costs about the same for 1 or 32
requests (it is memory-bound), so a step is a fair clock for comparing schedules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np

from minivllm.course.trace import SchedulerTrace
from minivllm.course.viz.colors import request_order


@dataclass
class RequestLatency:
    """Latency of one request, in engine steps counted from its arrival.

    Attributes:
        arrival: step at which it arrived (first seen in the trace, or given).
        first_scheduled: first step in which it computed tokens.
        first_token: step in which its first output token was sampled.
        finished: step in which it finished (``None`` if the trace ends before).
        ttft_steps: ``first_token - arrival + 1`` (steps until the first token exists).
        latency_steps: ``finished - arrival + 1`` (steps until the request is complete).
        num_output_tokens: tokens it generated in the trace.
    """

    arrival: int
    first_scheduled: Optional[int]
    first_token: Optional[int]
    finished: Optional[int]
    ttft_steps: Optional[int]
    latency_steps: Optional[int]
    num_output_tokens: int


def request_latencies(
    trace: SchedulerTrace, arrivals: Optional[Dict[str, int]] = None
) -> Dict[str, RequestLatency]:
    """``request id -> RequestLatency`` for every request in ``trace`` (ids in order of first appearance).

    A step samples a token for a request when the request's ``num_computed_tokens`` reaches its ``num_tokens``
    in that step (a decode, or the last chunk of a prefill); a partial prefill chunk samples none.
    """
    ids = request_order(trace)
    out: Dict[str, RequestLatency] = {}
    for rid in ids:
        arrival = (arrivals or {}).get(rid)
        first_seen = first_sched = first_tok = fin = None
        n_out = 0
        for k, s in enumerate(trace):
            if first_seen is None and rid in s.requests:
                first_seen = k
            if rid in s.num_scheduled_tokens:
                if first_sched is None:
                    first_sched = k
                snap = s.requests[rid]
                if snap.num_computed_tokens >= snap.num_tokens:
                    n_out += 1
                    if first_tok is None:
                        first_tok = k
            if rid in s.finished and fin is None:
                fin = k
        arrival = first_seen if arrival is None else arrival
        out[rid] = RequestLatency(
            arrival, first_sched, first_tok, fin,
            None if first_tok is None else first_tok - arrival + 1,
            None if fin is None else fin - arrival + 1,
            n_out,
        )
    return out


def batch_occupancy(trace: SchedulerTrace, max_num_seqs: Optional[int] = None) -> np.ndarray:
    """Per step, the fraction of the ``max_num_seqs`` batch slots used by requests that computed tokens.

    ``float64 [len(trace)]`` in ``[0, 1]``. ``max_num_seqs`` defaults to the one recorded in the trace.

    Raises:
        ValueError: if the trace records no ``max_num_seqs`` and none is given, or it is < 1.
    """
    limit = max_num_seqs if max_num_seqs is not None else (trace[0].max_num_seqs if len(trace) else 0)
    if limit < 1:
        raise ValueError(f"max_num_seqs must be >= 1 (give it when the trace does not record it), got {limit}")
    return np.array([len(s.num_scheduled_tokens) / limit for s in trace], dtype=np.float64)


def budget_usage(trace: SchedulerTrace) -> np.ndarray:
    """Per step, scheduled tokens / token budget (``max_num_batched_tokens``): ``float64 [len(trace)]``."""
    return np.array([s.total_scheduled / s.token_budget for s in trace], dtype=np.float64)
