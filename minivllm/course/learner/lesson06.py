"""Lesson 06's parts: the running loop with the no-admission gate, and preemption (see
``minivllm.course.learner.parts``).

The learner writes two ``Scheduler`` subclasses, each plugged into the engine as vLLM's ``scheduler_cls``:

* ``running_loop`` (``RunningLoop``): ``_schedule_running``, the loop that gives each running request, in order,
  its next tokens and stops at the first one that cannot get its blocks, and ``_admission_gate_open``, vLLM's
  ``if not preempted_reqs`` before the waiting loop (`v0.32.0 L657-L900
  <https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/v1/core/sched/scheduler.py#L657>`_).
* ``preempt_request`` (``Preemption``): ``_allocate_slots_or_preempt`` (allocate, preempting victims until the
  blocks fit or the request preempted itself), ``_pick_victim`` (FCFS the last running request, priority the
  worst ``(priority, arrival_time)``) and ``_preempt_request`` (free the blocks, ``PREEMPTED``,
  ``num_computed_tokens = 0``, ``num_preemptions += 1``, back to the front of the waiting queue; vLLM
  `v0.32.0 L1571 <https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/v1/core/sched/scheduler.py#L1571>`_).

What the learner does not write (the exercise cells say so): under async scheduling or ``vllm_release="0.33"``
the learner's ``_schedule_running`` hands over to the reference (``super()``: output placeholders, 0.33's prefill
cadence and its priority ``continue``), and with deferred block frees (async scheduling with a KV connector that
loads) so does ``_allocate_slots_or_preempt``; the three lines of ``_preempt_request`` about stale output of steps
in flight and the block free itself (``_free_request_blocks``, which defers it when needed) are given.

The checkers compare with the reference ``Scheduler`` step by step (``compare.check_scheduler_part``) on the
notebook's workloads (sections 1, 4, 5 and 7 of ``notebooks/06_preemption.ipynb``, FCFS and priority) and on
hidden ones: random FCFS workloads with tight blocks (many preemptions) and random priority workloads, in which a
request preempts itself and a victim can have been scheduled earlier in the same step.
"""

from __future__ import annotations

import random
from typing import Any, Dict, List

from minivllm.core.sched.scheduler import Scheduler
from minivllm.course.learner import compare
from minivllm.course.learner.parts import Part, register
from minivllm.i18n import N_

RUNNING_LOOP_METHODS = ("_schedule_running", "_admission_gate_open")
PREEMPTION_METHODS = ("_allocate_slots_or_preempt", "_pick_victim", "_preempt_request")

PRIORITY = {"scheduling_policy": "priority"}


def _with_priorities(w: Dict[str, Any], priorities: Dict[str, int]) -> Dict[str, Any]:
    """``w`` under the priority policy, each request with its priority (lower is more important, as in vLLM)."""
    w["extra_engine_kwargs"] = {**w.get("extra_engine_kwargs", {}), **PRIORITY}
    for r in w["requests"]:
        r["priority"] = priorities.get(r["id"], 0)
    return w


def notebook_workloads() -> List[Dict[str, Any]]:
    """The workloads of notebook 06 the checkers run (the notebook shows each of them run by the engine).

    * section 1: three 8-token prompts, 20 output tokens each, in 9 blocks of 4 (3 preemptions, FCFS);
    * section 5: thrashing, five 4-token prompts in 12 blocks (E preempted 4 times);
    * section 4: the gate under priority: A (priority 0) and V (5) run in 5 blocks, W (1, one token) arrives
      before step 1, in which V is preempted;
    * section 7: ``low`` (priority 1) runs, ``high`` (0) arrives at step 2, ``w`` (0) at step 10, 9 blocks;
    * a request that preempts itself under priority: V (priority 5) runs first, A (0) arrives at step 1, 5
      blocks; in step 5 V needs a block and is the worst: it preempts itself, and A, behind it, waits a step.
    """
    bs = dict(block_size=4, max_num_batched_tokens=64, max_num_seqs=16)
    return [
        compare.workload(N_("06 section 1: three requests in 9 blocks (fcfs)"), dict(bs, num_usable_blocks=9),
                         [("A", 8, 20), ("B", 8, 20), ("C", 8, 20)]),
        compare.workload(N_("06 section 5: thrashing in 12 blocks (fcfs)"), dict(bs, num_usable_blocks=12),
                         [("A", 4, 30), ("B", 4, 8), ("C", 4, 12), ("D", 4, 16), ("E", 4, 20)]),
        _with_priorities(compare.workload(N_("06 section 4: the gate (priority A:0 V:5 W:1)"),
                                          dict(bs, num_usable_blocks=5),
                                          [("A", 8, 6), ("V", 8, 6), ("W", 1, 2, 1)]),
                         {"A": 0, "V": 5, "W": 1}),
        _with_priorities(compare.workload(N_("06 section 7: low and high (priority low:1 high:0 w:0)"),
                                          dict(bs, num_usable_blocks=9),
                                          [("low", 8, 20), ("high", 8, 20, 2), ("w", 4, 3, 10)]),
                         {"low": 1, "high": 0, "w": 0}),
        _with_priorities(compare.workload(N_("a request preempts itself (priority V:5 A:0)"),
                                          dict(bs, num_usable_blocks=5),
                                          [("V", 8, 8), ("A", 4, 8, 1)]),
                         {"V": 5, "A": 0}),
    ]


def hidden_workloads() -> List[Dict[str, Any]]:
    """Workloads the notebook never shows: 10 random FCFS ones with tight blocks and 8 random priority ones
    (priorities 0-3 drawn per request, reproducible)."""
    fcfs = compare.random_workloads(606, 10, tight_blocks=True)
    rng = random.Random(607)
    prio = []
    for w in compare.random_workloads(608, 8, tight_blocks=True):
        w["name"] = w["name"].replace("hidden", "hidden priority")
        prio.append(_with_priorities(w, {r["id"]: rng.randint(0, 3) for r in w["requests"]}))
    return fcfs + prio


def check_running_loop(cls: Any, hidden: bool) -> int:
    """The checker of ``running_loop``: ``cls`` overrides ``_schedule_running`` and ``_admission_gate_open`` and
    schedules every workload as the reference does. Returns the number of workloads; raises ``NotWritten`` /
    ``PartFailed`` (``compare.check_scheduler_part``)."""
    return compare.check_scheduler_part("running_loop", cls, RUNNING_LOOP_METHODS, notebook_workloads(),
                                        hidden_workloads() if hidden else ())


def check_preempt_request(cls: Any, hidden: bool) -> int:
    """The checker of ``preempt_request``: ``cls`` overrides ``_allocate_slots_or_preempt``, ``_pick_victim`` and
    ``_preempt_request`` and schedules every workload as the reference does."""
    return compare.check_scheduler_part("preempt_request", cls, PREEMPTION_METHODS, notebook_workloads(),
                                        hidden_workloads() if hidden else ())


class ReferenceRunningLoop(Scheduler):
    """The reference ``running_loop``: the package's own ``Scheduler._schedule_running`` and
    ``_admission_gate_open`` (overrides nothing; a class of its own so that ``your_engine`` can combine it with
    the other lessons' classes)."""


class ReferencePreemption(Scheduler):
    """The reference ``preempt_request``: the package's own ``_allocate_slots_or_preempt``, ``_pick_victim`` and
    ``_preempt_request`` (overrides nothing)."""


def scheduler_cls(running_loop: type, preemption: type) -> type:
    """One ``scheduler_cls`` with both parts (the learner's or the references), for the notebook's engine runs.

    Raises ``TypeError`` when either is not a ``Scheduler`` subclass."""
    for name, c in (("running_loop", running_loop), ("preemption", preemption)):
        if not (isinstance(c, type) and issubclass(c, Scheduler)):
            raise TypeError(f"{name} must be a Scheduler subclass, got {c!r}")
    bases = tuple(dict.fromkeys(c for c in (running_loop, preemption) if c is not Scheduler)) or (Scheduler,)
    return type("Lesson06Scheduler", bases, {"__doc__": "lesson 06's running loop and preemption, combined"})


register(Part(
    name="running_loop", lesson="06", symbol="RunningLoop", kind="scheduler",
    seam="scheduler_cls: Scheduler._schedule_running, Scheduler._admission_gate_open",
    writes=N_("the running loop (in order, stop at the first that cannot get blocks) and the gate"),
    check=check_running_loop,
    hints=(
        N_("Walk self.running with the cursor step.req_index (not a for loop: a preemption removes requests from "
        "self.running and may move the cursor back), while step.token_budget > 0. And the gate: which list of "
        "the step says that somebody was preempted in it?"),
        N_("For each request: n = self._num_new_tokens_running(request, step); skip it (req_index += 1) when n <= 0; "
        "blocks = self._allocate_slots_or_preempt(request, n, step); None means it could not get its blocks (it "
        "may have preempted itself): stop the loop, nobody behind it runs in this step (vLLM 0.32 `break`). "
        "Otherwise record it in step.running_scheduled, step.num_scheduled_tokens, step.new_block_ids (block "
        "ids), spend step.token_budget and move the cursor. The gate is open only in a step that preempted nobody."),
        "if new_blocks is None: break  ...  step.new_block_ids[request.request_id] = [b.block_id for b in "
        "new_blocks]; step.token_budget -= num_new_tokens; step.req_index += 1   and   "
        "return not step.preempted_reqs",
    ),
    reference=ReferenceRunningLoop,
))

register(Part(
    name="preempt_request", lesson="06", symbol="Preemption", kind="scheduler",
    seam="scheduler_cls: Scheduler._allocate_slots_or_preempt, _pick_victim, _preempt_request",
    writes=N_("allocate or preempt: the victim, what preemption resets, where the victim goes"),
    check=check_preempt_request,
    hints=(
        N_("Retry kv_cache_manager.allocate_slots in a loop; each failure preempts one victim. Which running "
        "request does FCFS give up (section 1)? What does a preempted request lose, and where does it wait "
        "(section 3)?"),
        N_("Victim: self.running[-1] (FCFS), max(self.running, key=lambda r: (r.priority, r.arrival_time)) "
        "(priority). Take it out of self.running (move step.req_index back if it stood before the cursor; if it "
        "was already scheduled in this step, give back its tokens and block ids), preempt it, append it to "
        "step.preempted_reqs; when the victim was the request itself, return None. _preempt_request: status "
        "PREEMPTED, num_computed_tokens = 0 (its KV is gone, its tokens are kept), num_preemptions += 1, and the "
        "FRONT of the waiting queue."),
        "request.status = RequestStatus.PREEMPTED; request.num_computed_tokens = 0; request.num_preemptions += 1; "
        "self.waiting.prepend_request(request)",
    ),
    reference=ReferencePreemption,
))
