"""What each request was doing in each step: the data behind the timeline plot and the latency numbers.

``timeline_states`` turns a ``SchedulerTrace`` into a requests x steps matrix of states; ``request_latencies``
counts, per request, the steps until its first token and until it finished. Steps are the time unit: one step is
one forward pass of the whole batch, which is how vLLM's engine core advances.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

from minivllm.engine.trace import SchedulerTrace
from minivllm.viz.colors import request_order

ABSENT, WAITING, PREFILL, DECODE, PREEMPTED, IDLE = range(6)
STATE_NAMES = ["not in engine", "waiting", "prefill chunk", "decode", "preempted", "running, no tokens"]
"""Names of the state codes, indexed by code."""
STATE_COLORS = ["#ffffff", "#d9d9d9", "#f28e2b", "#4e79a7", "#e15759", "#b6d7f2"]
"""Colour of each state code in the timeline plot."""


def timeline_states(
    trace: SchedulerTrace, arrivals: Optional[Dict[str, int]] = None
) -> Tuple[List[str], np.ndarray]:
    """Requests x steps matrix of state codes (``ABSENT``, ``WAITING``, ``PREFILL``, ``DECODE``, ``PREEMPTED``,
    ``IDLE``).

    Args:
        trace: a recorded run.
        arrivals: optional ``request id -> step`` at which a request arrived at the *client*: steps from then until
            it first appears in the engine count as ``WAITING`` (used for static batching, where the client holds
            requests back). Requests only in ``arrivals`` get rows too.

    Returns:
        ``(ids, states)``: ids in order of first appearance; ``states`` is ``int8 [len(ids), len(trace)]``.
        ``PREEMPTED`` marks the step in which the request was preempted (afterwards it is ``WAITING``);
        ``IDLE`` is a running request that got no tokens because the budget ran out.
    """
    ids = request_order(trace)
    for rid in arrivals or {}:
        if rid not in ids:
            ids.append(rid)
    row = {rid: i for i, rid in enumerate(ids)}
    states = np.full((len(ids), len(trace)), ABSENT, dtype=np.int8)
    for k, s in enumerate(trace):
        for rid in s.waiting:
            states[row[rid], k] = WAITING
        for rid in s.running:
            states[row[rid], k] = IDLE
        for rid, kind in s.kinds.items():
            states[row[rid], k] = PREFILL if kind == "prefill" else DECODE
        for rid in s.preempted:
            states[row[rid], k] = PREEMPTED
    for rid, step in (arrivals or {}).items():
        r = row[rid]
        seen = np.nonzero(states[r] != ABSENT)[0]
        first = seen[0] if len(seen) else len(trace)
        states[r, max(step, 0):first] = WAITING
    return ids, states


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
