"""What each request was doing in each step: the data behind the timeline plot.

``timeline_states`` turns a ``SchedulerTrace`` into a requests x steps matrix of states (waiting, prefill chunk,
decode, preempted, running without tokens, not in the engine).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np

from minivllm.course.trace import SchedulerTrace
from minivllm.course.viz.colors import request_order
from minivllm.i18n import N_

ABSENT, WAITING, PREFILL, DECODE, PREEMPTED, IDLE = range(6)
STATE_NAMES = [N_("not in engine"), N_("waiting"), N_("prefill chunk"), N_("decode"), N_("preempted"),
               N_("running, no tokens")]
"""Names of the state codes, indexed by code (English; the plots show them through ``minivllm.i18n._``)."""
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
