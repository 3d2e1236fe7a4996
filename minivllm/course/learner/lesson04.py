"""Lesson 04's part: the waiting loop (``Scheduler._schedule_waiting``), written by the learner.

The learner's exercise cell (notebook 04, ``# Your turn: waiting_loop``) defines ``WaitingLoop``, a ``Scheduler``
subclass that overrides ``_schedule_waiting`` only, vLLM's "Next, schedule the WAITING requests"
(`v0.32.0 L899-L1401 <https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/v1/core/sched/scheduler.py#L899>`_).
The learner writes the loop condition (queue not empty, budget left, fewer than ``max_num_seqs`` running), the peek
at the head, the no-fit ``break`` (head of line: nothing overtakes the first request that does not fit), the
allocation with the whole-prompt check (``allocate_slots(..., full_sequence_must_fit=
scheduler_reserve_full_isl)``), the pop and the admission bookkeeping (running list, new or resumed, status,
``num_computed_tokens``, ``num_scheduled_tokens``, ``new_block_ids``, budget). The cell gives, written and
marked as given, the lines that other lessons teach: the prefix-cache lookup (``_prefix_cache_lookup``, notebook
07), chunk sizing (``_num_new_tokens_waiting``, notebook 05) and the prefix cache's hit statistics.

Out of the learner's class's scope, where it runs the reference loop (``super()._schedule_waiting(step)``, the
given first line of the cell): an engine with a KV connector (notebook 08: asynchronous loads, a connector that
cannot tell its hit yet, ``update_state_after_alloc``), async scheduling (a preempted request whose output is
still in flight is set aside) and vLLM 0.33's prefill cadence (``prefill_schedule_interval`` > 1 under
``vllm_release="0.33"``). Everywhere else, every synchronous engine without a connector (every run of notebooks
04-07 and the course's SmolLM2 runs), the learner's method is the one the engine runs.

The checker runs the learner's class against the reference ``Scheduler`` step by step
(``compare.check_scheduler_part``) on the notebook's three workloads and, hidden, on random ones and hand-made
ones that hit ``max_num_seqs``, the whole-prompt check on and off, a head that does not fit (blocks, or a budget
without chunked prefill), the watermark, prefix-cache hits and resumed requests. Before the step records are
compared, a guard stops a run whose waiting loop broke a limit the engine asserts (``max_num_seqs``, the token
budget), or that peeks at the head far more often than requests wait (a ``continue`` that does not take the
request out of the queue loops forever), naming the step and the limit.
"""

from __future__ import annotations

from typing import Any, Dict, List, Type

from minivllm.core.sched.scheduler import Scheduler, SchedulerStep
from minivllm.course.learner import compare
from minivllm.course.learner.parts import Part, register
from minivllm.i18n import N_, _

PART = "waiting_loop"
METHODS = ("_schedule_waiting",)

#: The workloads the notebook shows (by name), in the order it shows them.
NOTEBOOK_WORKLOADS: List[Dict[str, Any]] = [
    compare.workload(
        N_("two limits"), dict(num_usable_blocks=32, max_num_batched_tokens=24, max_num_seqs=3),
        [("A", 10, 3), ("B", 10, 4), ("C", 6, 2), ("D", 5, 3), ("E", 8, 2)],
        shows="step 0 admits A, B and C's first chunk: the budget runs out and max_num_seqs=3 is reached"),
    compare.workload(
        N_("whole prompt"), dict(num_usable_blocks=8, max_num_batched_tokens=8, max_num_seqs=8, max_model_len=32),
        [("A", 8, 10), ("B", 21, 2, 1), ("C", 4, 2, 1)],
        shows="B's whole prompt needs 6 blocks: it waits until A finishes, and C, which would fit, waits behind it"),
    compare.workload(
        N_("first chunk"), dict(num_usable_blocks=8, max_num_batched_tokens=8, max_num_seqs=8, max_model_len=32),
        [("A", 8, 10), ("B", 21, 2, 1), ("C", 4, 2, 1)],
        extra_engine_kwargs={"scheduler_reserve_full_isl": False},
        shows="without the whole-prompt check B starts on its first chunk and is preempted again and again"),
]


def _hidden_workloads() -> List[Dict[str, Any]]:
    """Workloads the notebook never shows: random ones, then hand-made ones for each rule of the loop."""
    ws = compare.random_workloads(2604, 10) + compare.random_workloads(2605, 3, prefix_caching=True,
                                                                       tight_blocks=False)
    ws += [
        compare.workload(N_("one slot"), dict(num_usable_blocks=32, max_num_batched_tokens=32, max_num_seqs=1),
                         [("A", 6, 3), ("B", 3, 2), ("C", 5, 2, 1)]),
        compare.workload(N_("two slots, big budget"), dict(num_usable_blocks=64, max_num_batched_tokens=64,
                                                       max_num_seqs=2),
                         [("A", 9, 4), ("B", 7, 6), ("C", 5, 2), ("D", 4, 3, 2)]),
        # No chunked prefill: B's 20 tokens exceed what A left of the budget; C (4) would fit and must wait.
        compare.workload(N_("no chunking, head too long"), dict(num_usable_blocks=32, max_num_batched_tokens=32,
                                                            max_model_len=32),
                         [("A", 20, 6), ("B", 20, 3), ("C", 4, 2)],
                         extra_engine_kwargs={"enable_chunked_prefill": False}),
        # Blocks: B's whole prompt does not fit while A runs; C would; with the check off B's chunk fits.
        compare.workload(N_("head waits for blocks"), dict(num_usable_blocks=10, max_num_batched_tokens=12,
                                                       max_num_seqs=4, max_model_len=40),
                         [("A", 12, 9), ("B", 26, 2, 1), ("C", 3, 3, 1), ("D", 2, 2, 2)]),
        compare.workload(N_("head waits for blocks, check off"), dict(num_usable_blocks=10, max_num_batched_tokens=12,
                                                                  max_num_seqs=4, max_model_len=40),
                         [("A", 12, 9), ("B", 26, 2, 1), ("C", 3, 3, 1), ("D", 2, 2, 2)],
                         extra_engine_kwargs={"scheduler_reserve_full_isl": False}),
        # The watermark (vLLM 0.32 SchedulerConfig.watermark) holds back admissions only while others run.
        compare.workload(N_("watermark"), dict(num_usable_blocks=8, max_num_batched_tokens=32),
                         [("A", 12, 4), ("B", 16, 2), ("C", 4, 3, 1)], extra_engine_kwargs={"watermark": 0.25}),
        # A shared prefix: admissions read cached blocks (new_computed_blocks) and start past them.
        compare.workload(N_("shared prefix"), dict(num_usable_blocks=24, max_num_batched_tokens=16,
                                               enable_prefix_caching=True),
                         [("A", 14, 3), ("B", 13, 3, 1), ("C", 15, 2, 3)], shared_prefix=8),
        # Preempted requests come back through the waiting loop as resumed ones.
        compare.workload(N_("resumed"), dict(num_usable_blocks=7, max_num_batched_tokens=32, max_model_len=28),
                         [("A", 10, 12), ("B", 10, 12)]),
    ]
    return ws


HIDDEN_WORKLOADS = _hidden_workloads()


class LimitExceeded(Exception):
    """The learner's waiting loop broke a rule that the engine itself asserts (or looped without end)."""


def _guarded(cls: Type[Scheduler]) -> type:
    """``cls`` with its ``_schedule_waiting`` watched: after it returns, no more than ``max_num_seqs`` requests run
    and the budget left is ``max_num_batched_tokens`` minus the tokens scheduled; while it runs, it peeks at the
    queue's head at most ten times per waiting request (a loop that never ends is stopped). Raises
    ``LimitExceeded`` naming the step. Same name as ``cls``, so that the checker's messages say "your
    WaitingLoop"."""

    def _schedule_waiting(self: Scheduler, step: SchedulerStep) -> None:
        cfg = self.config
        call = self.stats.num_steps  # schedule() calls before this one: this step's index
        queue = self.waiting
        peek = queue.peek_request
        waiting = len(queue)
        limit = 10 * (waiting + 1)  # a correct loop peeks once per admission and once more; a few extra are fine
        peeks = [0]

        def counted_peek():
            peeks[0] += 1
            if peeks[0] > limit:
                raise LimitExceeded(
                    _("step {step}: your loop peeked at the waiting queue's head {peeks} times with only {waiting} "
                      "requests waiting: a request that is not admitted must stop the loop (break); a `continue` "
                      "that leaves it at the head looks at it forever").format(step=call, peeks=peeks[0],
                                                                               waiting=waiting))
            return peek()

        queue.peek_request = counted_peek  # type: ignore[method-assign]
        try:
            cls._schedule_waiting(self, step)
        finally:
            del queue.peek_request
        if len(self.running) > cfg.max_num_seqs:
            raise LimitExceeded(
                _("step {step}: after your waiting loop {n} requests run ({requests}), more than "
                  "max_num_seqs={max_num_seqs}: the loop must stop once len(self.running) reaches "
                  "max_num_seqs").format(step=call, n=len(self.running),
                                         requests=", ".join(r.request_id for r in self.running),
                                         max_num_seqs=cfg.max_num_seqs))
        total = sum(step.num_scheduled_tokens.values())
        if step.token_budget != cfg.max_num_batched_tokens - total:
            raise LimitExceeded(
                _("step {step}: after your waiting loop step.token_budget is {budget}, but the step scheduled "
                  "{total} tokens ({scheduled}) of max_num_batched_tokens={max_tokens}, which leaves {left}: each "
                  "admitted request's tokens come off the budget").format(
                    step=call, budget=step.token_budget, total=total, scheduled=step.num_scheduled_tokens,
                    max_tokens=cfg.max_num_batched_tokens, left=cfg.max_num_batched_tokens - total))

    return type(cls.__name__, (cls,), {"_schedule_waiting": _schedule_waiting, "__module__": cls.__module__})


def check_waiting_loop(cls: Any, hidden: bool = True) -> int:
    """The checker of ``waiting_loop``: ``cls`` overrides ``_schedule_waiting`` and no other part's method, and
    schedules the notebook's workloads (and, with ``hidden``, the hidden ones) exactly as ``Scheduler`` does.

    Returns the number of workloads. Raises ``NotWritten`` while blank, ``PartFailed`` naming the first
    difference (or the limit broken, with its step).
    """
    compare.check_scheduler_part(PART, cls, METHODS, [])  # the class's shape: a Scheduler, the right override
    return compare.check_scheduler_part(PART, _guarded(cls), METHODS, NOTEBOOK_WORKLOADS,
                                        HIDDEN_WORKLOADS if hidden else ())


HINTS = (
    N_("Read Scheduler._schedule_waiting's docstring (minivllm/core/sched/scheduler.py). Three things must hold "
    "before the loop looks at the next waiting request; the first request that cannot be admitted ends the loop. "
    "Peek, and take a request out of the queue only once its blocks are allocated."),
    N_("while the queue is not empty, step.token_budget > 0 and len(self.running) < max_num_seqs: peek the head; if "
    "its chunk is None or allocate_slots(...) returns None, break (nothing overtakes it; with "
    "full_sequence_must_fit=self.config.scheduler_reserve_full_isl, allocate_slots refuses a request whose whole "
    "current sequence does not fit the free blocks). Then pop it, append it to self.running, list it in "
    "step.resumed_reqs if its status is PREEMPTED else in step.new_reqs, set it RUNNING, set its "
    "num_computed_tokens, and record its tokens and block ids in the step; the tokens come off step.token_budget."),
    "while self.waiting and step.token_budget > 0 and len(self.running) < self.config.max_num_seqs:\n"
    "    request = self.waiting.peek_request()\n"
    "    ...\n"
    "    new_blocks = self.kv_cache_manager.allocate_slots(\n"
    "        request, num_new_tokens, num_new_computed_tokens=hit.num_new_local_computed_tokens,\n"
    "        new_computed_blocks=hit.new_computed_blocks,\n"
    "        full_sequence_must_fit=self.config.scheduler_reserve_full_isl, has_scheduled_reqs=bool(self.running))\n"
    "    if new_blocks is None:\n"
    "        break\n"
    "    ...\n"
    "    self.waiting.pop_request()\n"
    "    self.running.append(request)\n"
    "    (step.resumed_reqs if request.status == RequestStatus.PREEMPTED else step.new_reqs).append(request)\n"
    "    request.status = RequestStatus.RUNNING\n"
    "    ...\n"
    "    step.num_scheduled_tokens[request.request_id] = num_new_tokens\n"
    "    step.new_block_ids[request.request_id] = self.kv_cache_manager.get_block_ids(request.request_id)\n"
    "    step.token_budget -= num_new_tokens",
)

register(Part(
    name=PART, lesson="04", symbol="WaitingLoop", kind="scheduler",
    seam="scheduler_cls: Scheduler._schedule_waiting",
    writes=N_("waiting loop: budget, max_num_seqs, whole prompt, FCFS"),
    check=check_waiting_loop, hints=HINTS, reference=Scheduler,
))
