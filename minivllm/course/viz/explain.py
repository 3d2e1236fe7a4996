"""Why each step went as it did, in words, read off the recorded trace: the animator's "why" line.

Every reason here is a comparison of numbers the trace recorded (``minivllm/course/trace.py``), not a second
scheduler: the budget left (``token_budget - total_scheduled``), the running requests against ``max_num_seqs``, the
waiting queue's head as the waiting loop checks it (``StepRecord.waiting_head``: its chunk, the blocks that chunk
and its whole sequence need, asked from the engine's own code right after ``schedule()``), the free blocks, the
preempted requests (the gate), and the running queue at the start of the step (the previous step's running queue
less the requests that finished in it) for the choice of a preemption victim.

The waiting loop stops at the first of (vLLM 0.32 ``Scheduler.schedule``, `L900-L1401
<https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/v1/core/sched/scheduler.py#L900>`_): no budget left, ``max_num_seqs``
requests running, a prompt larger than the budget left without chunked prefill, blocks for the whole sequence not
free (``scheduler_reserve_full_isl``), blocks for the chunk not free. ``explain_step`` names the first that holds
for the head, in that order. When none holds, the line says so (``cause="unexplained"``): the loop stopped for a
reason the trace does not record, such as a modified scheduler's gate or a KV connector's lookup.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from minivllm.course.trace import SchedulerTrace, StepRecord
from minivllm.i18n import _, ngettext

EVENT_KINDS = ("preemption", "admission", "finish")
"""The events the animator can jump to."""


@dataclass(frozen=True)
class Reason:
    """One sentence of a step's explanation.

    Attributes:
        kind: ``"preempted"``, ``"gate"``, ``"admitted"``, ``"resumed"``, ``"not_admitted"``, ``"no_tokens"`` or
            ``"finished"``.
        request_id: the request the sentence is about (``None`` for the gate).
        cause: why, as a key a test or a notebook can compare: for ``"not_admitted"`` one of ``"budget"``,
            ``"no_chunking"`` (without chunked prefill its prompt exceeds the budget left), ``"max_num_seqs"``,
            ``"whole_prompt"``, ``"blocks"``, ``"loading"`` (its KV is still arriving) or ``"unexplained"``; for
            ``"preempted"`` ``"fcfs_last"`` or ``"priority_worst"`` (vLLM's rule), ``"not_last"`` or
            ``"not_worst"`` (a modified scheduler broke it); for ``"gate"`` ``"preemption"`` (closed by this
            step's preemption) or ``"open_despite_preemption"``; for ``"no_tokens"`` ``"budget"``; else ``""``.
        text: the sentence shown.
    """

    kind: str
    request_id: Optional[str]
    cause: str
    text: str


@dataclass
class StepChanges:
    """What differs between step ``k - 1`` and step ``k`` (all empty for the first step recorded).

    Attributes:
        moved: request id -> ``(queue before, queue now)``, each ``"waiting"``, ``"running"`` or ``None`` (not in
            the engine), for every request whose queue changed.
        blocks_taken: block ids held now whose holders differ from the step before (newly allocated or shared).
        blocks_freed: block ids held the step before and free now.
    """

    moved: Dict[str, Tuple[Optional[str], Optional[str]]] = field(default_factory=dict)
    blocks_taken: List[int] = field(default_factory=list)
    blocks_freed: List[int] = field(default_factory=list)


def _check_k(trace: SchedulerTrace, k: int) -> StepRecord:
    if len(trace) == 0:
        raise ValueError("trace is empty: record the run with a SchedulerTrace (a TracedLLMEngine) and step it at least once")
    if not isinstance(k, int) or not 0 <= k < len(trace):
        raise ValueError(f"k must be an int in [0, {len(trace) - 1}], got {k!r}")
    return trace[k]


def running_at_start(trace: SchedulerTrace, k: int) -> List[str]:
    """The running queue when step ``k``'s ``schedule()`` began, in order: step ``k - 1``'s running queue less the
    requests that finished in it. For the first step recorded (nothing before it) the requests running after it
    that were not admitted in it, then its preempted ones (their order unknown, taken as recorded)."""
    s = _check_k(trace, k)
    if k > 0:
        prev = trace[k - 1]
        return [r for r in prev.running if r not in prev.finished]
    admitted = set(s.new) | set(s.resumed)
    return [r for r in s.running if r not in admitted] + list(s.preempted)


def _queue_of(s: StepRecord, rid: str) -> Optional[str]:
    if rid in s.running:
        return "running"
    if rid in s.waiting:
        return "waiting"
    return None


def step_changes(trace: SchedulerTrace, k: int) -> StepChanges:
    """``StepChanges`` from step ``k - 1`` to step ``k``.

    Raises:
        ValueError: if ``k`` is outside ``[0, len(trace))``.
    """
    s = _check_k(trace, k)
    if k == 0:
        return StepChanges()
    prev = trace[k - 1]
    moved = {}
    for rid in dict.fromkeys(prev.running + prev.waiting + s.running + s.waiting):
        before_q, now_q = _queue_of(prev, rid), _queue_of(s, rid)
        if before_q != now_q:
            moved[rid] = (before_q, now_q)
    taken, freed = [], []
    for b, owners in enumerate(s.block_owners):
        before = prev.block_owners[b] if b < len(prev.block_owners) else []
        if owners and sorted(owners) != sorted(before):
            taken.append(b)
        elif before and not owners:
            freed.append(b)
    return StepChanges(moved, taken, freed)


def event_steps(trace: SchedulerTrace, kind: str) -> List[int]:
    """Steps with an event of ``kind``: ``"preemption"`` (someone preempted), ``"admission"`` (someone admitted or
    resumed) or ``"finish"`` (someone finished).

    Raises:
        ValueError: for another ``kind``.
    """
    if kind not in EVENT_KINDS:
        raise ValueError(f"kind must be one of {EVENT_KINDS}, got {kind!r}")
    if kind == "preemption":
        return [k for k, s in enumerate(trace) if s.preempted]
    if kind == "admission":
        return [k for k, s in enumerate(trace) if s.new or s.resumed]
    return [k for k, s in enumerate(trace) if s.finished]


def next_event(trace: SchedulerTrace, k: int, kind: str) -> Optional[int]:
    """The first step after ``k`` with an event of ``kind`` (see ``event_steps``), or ``None``."""
    return next((j for j in event_steps(trace, kind) if j > k), None)


def _ids(xs) -> str:
    return " ".join(xs) if xs else _("(none)")


def _preemptions(trace: SchedulerTrace, k: int, s: StepRecord) -> List[Reason]:
    start = running_at_start(trace, k)
    victims = [r for r in start if r in s.preempted] + [r for r in s.preempted if r not in start]
    if not victims:
        return []
    new_blocks = [ngettext("{request} got block {blocks}", "{request} got blocks {blocks}", len(b)).format(
                  request=r, blocks=" ".join(map(str, b))) for r, b in s.new_block_ids.items() if b and r in start]
    need = _("a running request needed a new KV block and none was free")
    if new_blocks:
        need += _(" ({blocks} in this step)").format(blocks=_("; ").join(new_blocks))
    out = []
    remaining = list(start)
    if s.policy == "priority":
        def key(r: str) -> Tuple[int, float]:
            snap = s.requests.get(r)
            return (snap.priority, snap.arrival_time) if snap else (0, 0.0)

        def priorities(rs: List[str]) -> str:
            return ", ".join(f"{r} {key(r)[0]}" for r in rs)

        # the scheduler takes them one at a time, each time the worst of those still running
        for v in sorted(victims, key=key, reverse=True):
            worst = max(remaining, key=key) if remaining else None
            if v == worst:
                text = _("{victim} preempted: {need}; the priority policy preempts the running request with the "
                         "largest (priority, arrival time), the least urgent; priorities: {priorities}").format(
                    victim=v, need=need, priorities=priorities(remaining))
                out.append(Reason("preempted", v, "priority_worst", text))
            else:
                text = _("{victim} preempted, but the worst (priority, arrival time) of the running queue "
                         "({priorities}) was {worst}: not vLLM's priority rule").format(
                    victim=v, priorities=priorities(remaining), worst=worst)
                out.append(Reason("preempted", v, "not_worst", text))
            if v in remaining:
                remaining.remove(v)
        return out
    order = sorted(victims, key=lambda r: -start.index(r) if r in start else 1)  # the last running one first
    for v in order:
        queue = _ids(remaining)
        if remaining and remaining[-1] == v:
            text = _("{victim} preempted: {need}; FCFS preempts the last request of the running queue ({queue}), "
                     "the one that arrived last").format(victim=v, need=need, queue=queue)
            out.append(Reason("preempted", v, "fcfs_last", text))
            remaining.pop()
        else:
            last = remaining[-1] if remaining else _("(none)")
            text = _("{victim} preempted, but the last request of the running queue ({queue}) was {last}: not "
                     "FCFS's rule (vLLM preempts the last one)").format(victim=v, queue=queue, last=last)
            out.append(Reason("preempted", v, "not_last", text))
            if v in remaining:
                remaining.remove(v)
    return out


def _admissions(s: StepRecord) -> List[Reason]:
    out = []
    used = 0
    admitted = set(s.new) | set(s.resumed)
    for rid, n in s.num_scheduled_tokens.items():
        left = s.token_budget - used
        used += n
        if rid not in admitted:
            continue
        snap = s.requests.get(rid)
        before = s.num_computed_before.get(rid, 0)
        total = snap.num_tokens if snap else before + n
        cached = _(", {n} already cached").format(n=before) if before else ""
        todo = total - before
        if n >= todo:
            what = _("all {todo} tokens to compute fit the {left} budget tokens left").format(todo=todo, left=left)
        elif n == left:
            what = _("{n} of its {todo} tokens to compute, all the budget left").format(n=n, todo=todo)
        elif n == s.long_prefill_token_threshold:
            what = _("{n} of its {todo} tokens to compute (long_prefill_token_threshold)").format(n=n, todo=todo)
        else:
            what = _("{n} of its {todo} tokens to compute").format(n=n, todo=todo)
        nb = len(snap.block_ids) if snap else 0
        blocks = ngettext(" ({n} KV block{cached})", " ({n} KV blocks{cached})", nb).format(
            n=nb, cached=cached) if snap else ""
        if rid in s.resumed:
            out.append(Reason("resumed", rid, "", _("{request} resumed after its preemption, next in line: "
                                                    "{what}{blocks}").format(request=rid, what=what, blocks=blocks)))
        else:
            out.append(Reason("admitted", rid, "", _("{request} admitted, next in line: {what}{blocks}").format(
                request=rid, what=what, blocks=blocks)))
    return out


def _head(s: StepRecord) -> Optional[Reason]:
    h = s.waiting_head
    if h is None:
        return None
    rid = h.request_id
    left = s.token_budget - s.total_scheduled
    free, wm = s.num_free_blocks, h.watermark_blocks
    mark = _(" + {n} watermark").format(n=wm) if wm else ""
    if h.status == "WAITING_FOR_REMOTE_KVS":
        return Reason("not_admitted", rid, "loading",
                      _("{request} waits: its KV is still arriving from the KV connector").format(request=rid))
    if left <= 0:
        return Reason("not_admitted", rid, "budget",
                      _("{request} not admitted: the token budget is spent ({scheduled} of {budget} tokens "
                        "scheduled)").format(request=rid, scheduled=s.total_scheduled, budget=s.token_budget))
    if s.max_num_seqs and len(s.running) >= s.max_num_seqs:
        return Reason("not_admitted", rid, "max_num_seqs",
                      ngettext("{request} not admitted: {n} is running, max_num_seqs = {max_num_seqs}",
                               "{request} not admitted: {n} are running, max_num_seqs = {max_num_seqs}",
                               len(s.running)).format(request=rid, n=len(s.running), max_num_seqs=s.max_num_seqs))
    if h.num_new_tokens is None:
        return Reason("not_admitted", rid, "no_chunking",
                      _("{request} not admitted: its {todo} tokens to compute exceed the {left} budget tokens left "
                        "and chunked prefill is off (a prompt is never split)").format(
                          request=rid, todo=h.num_tokens - h.num_hit_tokens, left=left))
    if s.reserve_full_isl and h.blocks_for_whole + wm > free:
        first = (_("; its first chunk of {n} tokens alone would fit ({blocks} blocks)").format(
                 n=h.num_new_tokens, blocks=h.blocks_for_chunk) if h.blocks_for_chunk + wm <= free else "")
        return Reason("not_admitted", rid, "whole_prompt",
                      ngettext("{request} not admitted: the whole-prompt check (scheduler_reserve_full_isl) wants "
                               "{need}{mark} free blocks for all its {tokens} tokens and {free} is free{first}",
                               "{request} not admitted: the whole-prompt check (scheduler_reserve_full_isl) wants "
                               "{need}{mark} free blocks for all its {tokens} tokens and {free} are free{first}",
                               free).format(request=rid, need=h.blocks_for_whole, mark=mark, tokens=h.num_tokens,
                                            free=free, first=first))
    if h.blocks_for_chunk + wm > free:
        return Reason("not_admitted", rid, "blocks",
                      ngettext("{request} not admitted: its next {n} tokens need {need}{mark} KV blocks and {free} "
                               "is free",
                               "{request} not admitted: its next {n} tokens need {need}{mark} KV blocks and {free} "
                               "are free", free).format(request=rid, n=h.num_new_tokens, need=h.blocks_for_chunk,
                                                        mark=mark, free=free))
    return Reason("not_admitted", rid, "unexplained",
                  _("{request} waits although budget ({left} left), max_num_seqs and blocks ({free} free) would "
                    "admit it: the waiting loop stopped for a reason the trace does not record (a modified gate, a "
                    "KV connector's lookup, vLLM 0.33's prefill cadence)").format(request=rid, left=left, free=free))


def explain_step(trace: SchedulerTrace, k: int) -> List[Reason]:
    """The reasons behind step ``k``, in the scheduler's order: preemptions (and why that victim), the gate,
    admissions, why the waiting queue's head was not admitted, running requests left without tokens, finishes.

    Args:
        trace: a recorded run.
        k: the step, ``0 <= k < len(trace)``.

    Returns:
        ``Reason``s; empty for a step in which nothing was admitted, preempted or finished and nobody waits.

    Raises:
        ValueError: if ``trace`` is empty or ``k`` is outside ``[0, len(trace))``.
    """
    s = _check_k(trace, k)
    out = _preemptions(trace, k, s)
    admitted = s.new or s.resumed
    if s.preempted:
        others = [r for r in s.waiting if r not in s.preempted]
        if admitted:
            out.append(Reason("gate", None, "open_despite_preemption",
                              _("the waiting loop ran although this step preempted: not vLLM's rule (vLLM admits "
                                "nobody in a step that preempts)")))
        else:
            text = _("the waiting loop did not run: the preemption in this step closes the gate (vLLM's "
                     "'if not preempted_reqs'), so nobody is admitted")
            if others:
                text += ngettext("; {requests} keeps waiting", "; {requests} keep waiting", len(others)).format(
                    requests=_ids(others))
            out.append(Reason("gate", None, "preemption", text))
    out += _admissions(s)
    if not s.preempted or admitted:
        head = _head(s)
        if head is not None:
            out.append(head)
    if s.total_scheduled >= s.token_budget:
        for rid in s.running:
            if rid not in s.num_scheduled_tokens:
                out.append(Reason("no_tokens", rid, "budget",
                                  _("{request} (running) got no tokens: the running queue is served in order and "
                                    "the budget ran out before it").format(request=rid)))
    for rid, why in s.finished.items():
        out.append(Reason("finished", rid, "", _("{request} finished ({reason})").format(request=rid, reason=why)))
    return out


def explain_line(trace: SchedulerTrace, k: int) -> str:
    """``explain_step(trace, k)`` as one line, the sentences joined by ``"; "`` (a quiet step says what ran)."""
    reasons = explain_step(trace, k)
    if reasons:
        # Translators: the separator between the sentences of a step's explanation.
        return _("; ").join(r.text for r in reasons)
    s = trace[k]
    return _("nothing admitted, preempted or finished: {n} running requests computed tokens").format(
        n=len(s.num_scheduled_tokens))
