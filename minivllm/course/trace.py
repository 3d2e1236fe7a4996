"""A step-by-step record of what the scheduler did: the input of every widget, plot and FAQ answer.

One ``StepRecord`` per engine step, taken right after ``schedule()`` (queues, blocks, what was scheduled) and
completed after ``update_from_output()`` (which requests finished). Nothing here is drawn by hand: every frame of
the course's animations is one of these records.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


@dataclass
class RequestSnapshot:
    """One request's counters at a step, in tokens (``block_ids`` in block-table order)."""

    request_id: str
    status: str
    num_prompt_tokens: int
    num_computed_tokens: int
    num_output_tokens: int
    num_tokens: int
    block_ids: List[int]
    num_preemptions: int
    num_cached_tokens: int
    priority: int = 0


@dataclass
class StepRecord:
    """What happened in one step.

    Attributes:
        step: 0-based step index.
        waiting / running: request ids in queue order after scheduling (running = admission order).
        num_scheduled_tokens: tokens each scheduled request computes in this step (scheduler order).
        kinds: ``"prefill"`` (a prompt chunk, or a recompute after preemption) or ``"decode"`` per scheduled id.
        num_computed_before: each scheduled request's ``num_computed_tokens`` before this step (its context).
        new / resumed / preempted: ids admitted for the first time, re-admitted after preemption, preempted.
        finished: ``request id -> finish reason`` for requests that ended in this step.
        requests: snapshots of every request in a queue this step, after scheduling.
        num_free_blocks / num_gpu_blocks: pool state after scheduling.
        block_owners: for each block id, the ids of the requests holding it (empty = free).
        cached_free_blocks: ids of free blocks that still carry a prefix-cache hash (evictable).
        token_budget: ``max_num_batched_tokens``.
        inputs: the model runner's flattened batch as lists (``positions``, ``slot_mapping``, ...), when recorded.
        connector_calls: KV connector calls made during this step, when a recording connector is used.
        max_num_seqs: the limit on running requests (0 in records made before this field existed).
    """

    step: int
    waiting: List[str]
    running: List[str]
    num_scheduled_tokens: Dict[str, int]
    kinds: Dict[str, str]
    num_computed_before: Dict[str, int]
    new: List[str]
    resumed: List[str]
    preempted: List[str]
    finished: Dict[str, str]
    requests: Dict[str, RequestSnapshot]
    num_free_blocks: int
    num_gpu_blocks: int
    block_owners: List[List[str]]
    cached_free_blocks: List[int]
    token_budget: int
    inputs: Optional[Dict[str, Any]] = None
    connector_calls: List[Dict[str, Any]] = field(default_factory=list)
    max_num_seqs: int = 0

    @property
    def total_scheduled(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass
class SchedulerTrace:
    """All steps of a run, with the queries the course asks of it."""

    steps: List[StepRecord] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, i: int) -> StepRecord:
        return self.steps[i]

    def __iter__(self):
        return iter(self.steps)

    def chunk_sizes(self, request_id: str, kind: Optional[str] = "prefill") -> List[int]:
        """Tokens scheduled for ``request_id`` in each step it ran (only ``kind`` steps unless ``kind=None``)."""
        return [
            s.num_scheduled_tokens[request_id]
            for s in self.steps
            if request_id in s.num_scheduled_tokens and (kind is None or s.kinds[request_id] == kind)
        ]

    def steps_of(self, request_id: str) -> List[int]:
        """Step indices in which ``request_id`` was scheduled."""
        return [s.step for s in self.steps if request_id in s.num_scheduled_tokens]

    def preemptions(self) -> List[tuple]:
        """``(step, request_id)`` for every preemption."""
        return [(s.step, r) for s in self.steps for r in s.preempted]

    def recomputed_tokens(self, request_id: str) -> int:
        """Tokens of ``request_id`` computed more than once (the cost of its preemptions), in tokens.

        Every scheduled token is one KV computation. The distinct positions that needed one are those from the
        first admission's prefix-cache hit up to the furthest position ever computed; everything beyond that count
        was computed again. (The newest sampled token of a preempted request had never been computed: its KV is
        new work on resume, not recomputation.)
        """
        total, furthest, first_cached = 0, 0, None
        for s in self.steps:
            n = s.num_scheduled_tokens.get(request_id)
            if n is None:
                continue
            if first_cached is None:
                first_cached = s.num_computed_before[request_id]
            total += n
            furthest = max(furthest, s.num_computed_before[request_id] + n)
        return total - (furthest - (first_cached or 0))

    def to_rows(self) -> List[Dict[str, Any]]:
        """One row per step: the table shown in the notebooks."""
        rows = []
        for s in self.steps:
            sched = ", ".join(
                f"{r}:{'P' if s.kinds[r] == 'prefill' else 'D'}{n}" for r, n in s.num_scheduled_tokens.items()
            )
            rows.append(
                {
                    "step": s.step,
                    "waiting": " ".join(s.waiting) or "-",
                    "running": " ".join(s.running) or "-",
                    "scheduled (P=prefill, D=decode)": sched or "-",
                    "tokens": s.total_scheduled,
                    "preempted": " ".join(s.preempted) or "",
                    "finished": " ".join(s.finished) or "",
                    "free blocks": s.num_free_blocks,
                }
            )
        return rows

    def to_dataframe(self):
        """``to_rows()`` as a pandas DataFrame indexed by step."""
        import pandas as pd

        return pd.DataFrame(self.to_rows()).set_index("step")
