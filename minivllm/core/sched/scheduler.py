"""The V1-style scheduler (vLLM: ``vllm/v1/core/sched/scheduler.py``).

There are no prefill and decode phases. Each step the scheduler hands out one token budget
(``max_num_batched_tokens``): first to the running requests in order (each wants
``num_tokens - num_computed_tokens`` tokens: a prefill chunk or one decode token), then, only if no running
request had to be preempted in this step, to waiting requests in queue order.

This file is over 300 lines on purpose: it is read side by side with vLLM's one ``scheduler.py`` (3,400 lines in
0.32). vLLM's ``schedule()`` is one method of about 970 lines (L591-L1556 in 0.32); minivllm splits it into
the parts a course lesson teaches, each a method that a ``scheduler_cls`` subclass (vLLM's seam,
``SchedulerConfig.scheduler_cls``) can replace on its own, and keeps vLLM's order and names so that each part
still reads beside vLLM's lines (issue 26; each method's docstring names them). The split changes no decision: every scheduler test and the live vLLM check
are the same as before it.

* ``schedule()``: the step's locals (``SchedulerStep``), then the parts below, the invariants, the output.
* ``_long_prefill_token_threshold`` (0.32's lone-request rule) and ``_defer_prefills`` (0.33's cadence).
* ``_schedule_running``: the running loop; ``_num_new_tokens_running`` (chunk sizing of a running request);
  ``_allocate_slots_or_preempt`` (the preemption step), ``_pick_victim``, ``_preempt_request``.
* ``_admission_gate_open``: the no-admission gate (``if not preempted_reqs``).
* ``_schedule_waiting``: the waiting loop; ``_prefix_cache_lookup`` (the prefix-cache and connector lookup at
  admission); ``_num_new_tokens_waiting`` (chunk sizing of a waiting request).
* ``_build_scheduler_output`` and ``_make_cached_request_data``: the ``SchedulerOutput``.

Which release: ``SchedulerConfig.vllm_release`` (``"0.32"`` by default, ``"0.33"``) picks the two rules in which
vLLM 0.33's ``Scheduler.schedule`` decides differently from 0.32's (both read at their tags; the course's recorded
scenarios, FCFS without a prefill interval, are scheduled alike by both, which the live check shows):

* a running request that cannot get its blocks and preempts itself under the priority policy: 0.32 stops the
  running loop (``if new_blocks is None: break``, "Cannot schedule this request"), so the requests behind it get
  nothing this step; 0.33 goes on with them (``continue``: the request was the worst one and has just freed its
  blocks). Under FCFS the victim is always the last running request, so both stop.
  ``tests/core/test_scheduler.py::test_priority_self_preemption_per_release`` pins both.
* ``prefill_schedule_interval`` N > 1: 0.33 holds prefill (new admissions and the chunks of running prompts) until
  N executed steps have passed since the last step that carried prefill, while a decoding request runs
  (``defer_prefills``, its local cadence without data parallelism); 0.32 applies the interval only under data
  parallelism, which minivllm lacks, so there it changes nothing. 0.33's capacity escape is kept: once a release
  step cannot admit every waiting request that is not held for another reason, the hold stops.

Steps in flight (async scheduling, ``AsyncScheduler``): the bookkeeping vLLM 0.32 keeps in the base class lives
here too, and costs nothing when scheduling is synchronous (every step's output is processed before the next
``schedule()``): ``Request.num_in_flight_tokens``, stale output of a request preempted with a step in flight, and
deferred block frees. With a KV connector (minivllm's connectors play both roles, so each is a "KV consumer" in
vLLM's terms) and async scheduling, the blocks of a request freed while a step that scheduled it is in flight go
back to the pool only once that step's output is processed (vLLM: ``defer_block_free``, "a step may still be
writing a freed request's KV blocks"); such a request cannot be a preemption victim until then.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Deque, Dict, Iterable, List, NamedTuple, Optional, Set, Tuple

from minivllm.config import SchedulerConfig
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.kv_cache_utils import KVCacheBlock
from minivllm.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from minivllm.core.sched.request_queue import create_request_queue
from minivllm.core.sched.utils import check_stop
from minivllm.engine import EngineCoreOutput
from minivllm.metrics.stats import SchedulerCounters, SchedulerStats
from minivllm.outputs import ModelRunnerOutput
from minivllm.request import Request, RequestStatus, is_partial_prefill

if TYPE_CHECKING:
    from minivllm.distributed.kv_transfer.base import KVConnectorBase


@dataclass
class SchedulerStep:
    """One ``schedule()`` call's working state, passed between its parts (vLLM keeps these as locals of its one
    ``schedule()``, declared at `v0.32.0 L604-L656
    <https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/v1/core/sched/scheduler.py#L604>`_; minivllm splits
    ``schedule()`` so that a ``scheduler_cls`` subclass can replace one part, issue 26). The lists and dicts are
    filled in place: ``schedule()`` holds the same objects.

    Attributes:
        token_budget: tokens this step may still schedule, all requests together; starts at
            ``max_num_batched_tokens`` (vLLM ``token_budget``, from ``max_num_scheduled_tokens``).
        long_prefill_token_threshold: the most tokens one request gets in this step, 0 for no cap; the
            configured value, or 0 when the request is alone (``Scheduler._long_prefill_token_threshold``; vLLM's
            local of the same name).
        defer_prefills: this step holds prefill (prompt chunks and admissions): vLLM 0.33's local prefill cadence
            (``Scheduler._defer_prefills``; vLLM's local of the same name). Always ``False`` under 0.32.
        num_scheduled_tokens: request id -> tokens scheduled in this step (vLLM the same; becomes
            ``SchedulerOutput.num_scheduled_tokens``).
        new_reqs: requests admitted for the first time, in admission order (vLLM ``scheduled_new_reqs``).
        resumed_reqs: preempted requests admitted again (vLLM ``scheduled_resumed_reqs``).
        running_scheduled: running requests scheduled in this step, in running order (vLLM
            ``scheduled_running_reqs``).
        new_block_ids: request id -> its KV block ids to send the runner: a running request's newly allocated
            blocks, an admitted one's whole block table (vLLM ``req_to_new_blocks``, ``KVCacheBlocks`` there).
        preempted_reqs: requests preempted in this step, in order; non-empty closes the admission gate (vLLM the
            same).
        req_index: the running loop's cursor into ``Scheduler.running`` (vLLM ``req_index``); a priority
            preemption of an earlier request moves it back.
        prefill_scheduled: a running request's prompt chunk was scheduled (vLLM the same; with
            ``prefill_admitted``, restarts 0.33's prefill cadence).
        prefill_admitted: a request was admitted with prompt left to compute (vLLM 0.33 the same).
    """

    token_budget: int
    long_prefill_token_threshold: int = 0
    defer_prefills: bool = False
    num_scheduled_tokens: Dict[str, int] = field(default_factory=dict)
    new_reqs: List[Request] = field(default_factory=list)
    resumed_reqs: List[Request] = field(default_factory=list)
    running_scheduled: List[Request] = field(default_factory=list)
    new_block_ids: Dict[str, List[int]] = field(default_factory=dict)
    preempted_reqs: List[Request] = field(default_factory=list)
    req_index: int = 0
    prefill_scheduled: bool = False
    prefill_admitted: bool = False


class PrefixCacheHit(NamedTuple):
    """What ``Scheduler._prefix_cache_lookup`` found for a request being admitted (vLLM's locals of the same
    names, `v0.32.0 L954-L1084
    <https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/v1/core/sched/scheduler.py#L954>`_)."""

    new_computed_blocks: List[KVCacheBlock]
    """its blocks already in the prefix cache, to be shared (full blocks only, in order)"""
    num_new_local_computed_tokens: int
    """tokens those blocks hold (a multiple of ``block_size``)"""
    num_external_computed_tokens: int
    """tokens the KV connector can load beyond them (0 without a connector)"""
    load_kv_async: bool
    """the connector loads them asynchronously: the request waits (``WAITING_FOR_REMOTE_KVS``) and computes
    nothing until the load is reported finished"""


class Scheduler:
    """Decides, each step, which requests compute how many tokens.

    Args:
        scheduler_config: budget, ``max_num_seqs``, chunking, policy, ``max_model_len``.
        kv_cache_manager: block allocation and prefix-cache lookups.
        connector: optional KV connector (scheduler side); see ``minivllm.distributed.kv_transfer``.

    Attributes:
        waiting: the waiting queue (FCFS deque or priority heap); preempted requests go back here.
        running: running requests in admission order; preemption takes victims from the end (FCFS).
        requests: every unfinished request by id.
        finished_req_ids: ids finished since the last ``schedule()``, sent to the model runner to drop.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        connector: Optional["KVConnectorBase"] = None,
    ) -> None:
        self.config = scheduler_config
        self.kv_cache_manager = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.max_model_len = scheduler_config.max_model_len
        self.connector = connector
        self.policy = scheduler_config.policy
        self.waiting = create_request_queue(self.policy)
        self.running: List[Request] = []
        self.requests: Dict[str, Request] = {}
        self.finished_req_ids: Set[str] = set()
        self.finished_recving_kv_req_ids: Set[str] = set()
        # Preempted between steps by reset_prefix_cache(reset_running_requests=True); sent with the next step's
        # SchedulerOutput.preempted_req_ids (vLLM keeps every preemption in a set of this name).
        self.reset_preempted_req_ids: Set[str] = set()
        self.stats = SchedulerCounters()
        # vLLM's log_stats: make_stats() returns a snapshot only when a front end asked for one (AsyncLLM does).
        self.log_stats = False
        self.use_v2_model_runner = scheduler_config.use_v2_model_runner
        # V1 runner only: a cached request not scheduled in the previous step gets its all_token_ids again
        # (vLLM's prev_step_scheduled_req_ids; the V2 runner keeps every request's tokens itself).
        self.prev_step_scheduled_req_ids: Set[str] = set()
        # Deferred block frees (vLLM 0.32: only with steps in flight and a connector that loads KV).
        self.defer_block_free = bool(
            scheduler_config.async_scheduling and connector is not None and connector.is_kv_consumer
        )
        # A preempted request's in-flight output is dropped, not delivered (vLLM: requires_kv_delivery).
        self.requires_kv_delivery = bool(connector is not None and connector.requires_kv_delivery)
        self.sched_step_seq = 0  # non-empty steps scheduled
        self.processed_step_seq = 0  # non-empty steps whose output was processed
        self.deferred_frees: Deque[Tuple[int, List[KVCacheBlock]]] = deque()
        # vLLM 0.33's local prefill cadence (see the module docstring): the interval, the executed step that last
        # carried prefill (a whole interval back, so that the first step is never held), steps that scheduled
        # tokens, whether the last release step left admissible requests waiting, and the requests skipped in the
        # waiting loop for reasons of their own (vLLM's deferred_waiting), by id.
        self.local_prefill_interval = (scheduler_config.prefill_schedule_interval
                                       if scheduler_config.vllm_release == "0.33" else 1)
        self.last_prefill_step = -self.local_prefill_interval
        self.num_executed_steps = 0
        self.prefill_capacity_bound = False
        self.deferred_waiting: Set[str] = set()

    # ---------------------------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a validated request (the engine validates; see ``LLMEngine.add_request``)."""
        self.waiting.add_request(request)
        self.requests[request.request_id] = request

    def has_unfinished_requests(self) -> bool:
        return len(self.waiting) > 0 or len(self.running) > 0

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---------------------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Build one step's ``SchedulerOutput`` (vLLM ``Scheduler.schedule``,
        `v0.32.0 L591-L1556 <https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/v1/core/sched/scheduler.py#L591>`_;
        `v0.33.0 L699-L1784 <https://github.com/vllm-project/vllm/blob/v0.33.0/vllm/v1/core/sched/scheduler.py#L699>`_).

        1. Running loop (``_schedule_running``): each running request, in order, gets ``min(num_tokens -
           num_computed_tokens, long_prefill_token_threshold, remaining budget)`` tokens
           (``_num_new_tokens_running``). If its blocks cannot be allocated, the scheduler preempts a victim (FCFS:
           the last running request; priority: the worst one) and retries, until it fits or the request has
           preempted itself (``_allocate_slots_or_preempt``, ``_pick_victim``, ``_preempt_request``).
        2. Waiting loop (``_schedule_waiting``), *only if nobody was preempted in this step*
           (``_admission_gate_open``): admit requests in queue order while budget, ``max_num_seqs`` and blocks
           allow. The first request that does not fit stops the loop (no overtaking). With
           ``scheduler_reserve_full_isl`` (the default) a waiting request is admitted only if blocks for its whole
           current sequence are free; without it, when its first chunk fits.
        3. ``SchedulerOutput`` (``_build_scheduler_output``), the connector's metadata, and
           ``num_computed_tokens`` of every scheduled request advanced now, at schedule time.

        vLLM's ``schedule()`` is one method; minivllm splits it, in vLLM's order and with vLLM's names, so that a
        ``scheduler_cls`` subclass (a learner's, issue 26) can replace one part and keep the rest. The split changes
        no decision. The step's locals that vLLM declares at the top (L604-L656) travel between the parts in one
        ``SchedulerStep``.

        Under async scheduling a running request wants ``num_tokens + num_output_placeholders -
        num_computed_tokens`` tokens, and one whose placeholders already reach ``max_tokens`` is skipped (vLLM's
        check at the top of the running loop). Under the V2 model runner, resumed requests are sent as new ones.

        The assertions at the end (budget and ``max_num_seqs`` never exceeded) are the invariants vLLM asserts.
        """
        cfg = self.config
        # The step's lists, locals of schedule() as in vLLM (L604-L611); the parts below fill them through `step`.
        num_scheduled_tokens: Dict[str, int] = {}
        new_reqs: List[Request] = []
        resumed_reqs: List[Request] = []
        running_scheduled: List[Request] = []
        new_block_ids: Dict[str, List[int]] = {}
        preempted_reqs: List[Request] = []
        step = SchedulerStep(
            token_budget=cfg.max_num_batched_tokens,
            long_prefill_token_threshold=self._long_prefill_token_threshold(),
            defer_prefills=self._defer_prefills(),
            num_scheduled_tokens=num_scheduled_tokens,
            new_reqs=new_reqs,
            resumed_reqs=resumed_reqs,
            running_scheduled=running_scheduled,
            new_block_ids=new_block_ids,
            preempted_reqs=preempted_reqs,
        )

        # 1. First, schedule the RUNNING requests.
        self._schedule_running(step)

        # 2. Next, schedule the WAITING requests: only in a step that preempted nobody (vLLM's gate, L900).
        if self._admission_gate_open(step):
            self._schedule_waiting(step)

        # Check if the scheduling constraints are satisfied (vLLM L1403-L1414; v0.33.0 L1618-L1639, which also
        # stamps the prefill cadence here).
        total = sum(num_scheduled_tokens.values())
        if total > 0:
            self.num_executed_steps += 1
        if self.local_prefill_interval > 1 and (step.prefill_scheduled or step.prefill_admitted):
            self.last_prefill_step = self.num_executed_steps
        assert total <= cfg.max_num_batched_tokens, (total, cfg.max_num_batched_tokens)
        assert step.token_budget >= 0
        assert len(self.running) <= cfg.max_num_seqs
        assert len(running_scheduled) + len(new_reqs) + len(resumed_reqs) == len(num_scheduled_tokens)

        # 3. Construct the scheduler output.
        output = self._build_scheduler_output(step)
        if self.connector is not None:
            # Once per schedule() call, even when nothing was scheduled (vLLM L1528-L1530, build_connector_meta).
            output.kv_connector_metadata = self.connector.build_connector_meta(output)
        if self.defer_block_free and total > 0:
            self.sched_step_seq += 1  # only steps that write KV fence deferred frees
        self._update_after_schedule(output)
        self.stats.num_steps += 1
        self.stats.num_preemptions += len(preempted_reqs)
        self.stats.num_scheduled_tokens += total
        return output

    # -- the parts of schedule(), in vLLM's order ------------------------------------------------------------------
    def _long_prefill_token_threshold(self) -> int:
        """This step's cap on one request's tokens, 0 for none (vLLM's local ``long_prefill_token_threshold``,
        `v0.32.0 L640-L655 <https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/v1/core/sched/scheduler.py#L640>`_;
        `v0.33.0 L754-L769 <https://github.com/vllm-project/vllm/blob/v0.33.0/vllm/v1/core/sched/scheduler.py#L754>`_).

        ``SchedulerConfig.long_prefill_token_threshold``, except with at most one eligible request (running plus
        waiting) in the step: the cap exists so that a long prefill does not starve other requests, and a request
        alone starves nobody, so it may use the whole budget (0.32's lone-request rule). Computed once, before
        either loop, from the queues as they stand (the waiting loop pops skipped requests for a while).
        vLLM's adaptive floor (``long_prefill_token_threshold_adaptive``) has no counterpart in minivllm.
        Part of ``schedule()``, split out so that a subclass can replace it (issue 26).
        """
        if len(self.running) + len(self.waiting) <= 1:
            return 0
        return self.config.long_prefill_token_threshold

    def _defer_prefills(self) -> bool:
        """Whether this step holds prefill (vLLM 0.33's local prefill cadence, ``defer_prefills``,
        `v0.33.0 L771-L791 <https://github.com/vllm-project/vllm/blob/v0.33.0/vllm/v1/core/sched/scheduler.py#L771>`_):
        with ``prefill_schedule_interval`` N > 1 under ``vllm_release="0.33"``, until N executed steps have passed
        since the last step that carried prefill, while some running request decodes, unless the last release step
        left admissible requests waiting (``prefill_capacity_bound``). vLLM 0.32 defers only under data
        parallelism (`L634-L638 <https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/v1/core/sched/scheduler.py#L634>`_),
        which minivllm lacks: always ``False`` there. Part of ``schedule()``, split out (issue 26)."""
        return (
            self.local_prefill_interval > 1 and not self.prefill_capacity_bound
            and (self.num_executed_steps + 1) - self.last_prefill_step < self.local_prefill_interval
            and any(not r.is_prefill_chunk for r in self.running)
        )

    def _schedule_running(self, step: SchedulerStep) -> None:
        """The running loop: give each running request, in order, its next tokens (vLLM's "First, schedule the
        RUNNING requests",
        `v0.32.0 L657-L887 <https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/v1/core/sched/scheduler.py#L657>`_;
        `v0.33.0 L793-L1036 <https://github.com/vllm-project/vllm/blob/v0.33.0/vllm/v1/core/sched/scheduler.py#L793>`_).

        Skips a request whose steps in flight already sample its last allowed token (async scheduling), a prompt's
        next chunk in a step that holds prefill (``step.defer_prefills``) and a request that gets no token
        (``_num_new_tokens_running`` <= 0). Allocates, preempting if need be (``_allocate_slots_or_preempt``); a
        request that cannot get its blocks stops the loop (0.32: ``break``), except that under 0.33 and the priority
        policy a request that preempted itself lets the ones behind it go on (``continue``; see the module
        docstring). Fills ``step.running_scheduled``, ``num_scheduled_tokens``, ``new_block_ids``,
        ``preempted_reqs`` and spends ``step.token_budget``. Part of ``schedule()``, split out (issue 26).
        """
        cfg = self.config
        step.req_index = 0
        while step.req_index < len(self.running) and step.token_budget > 0:
            request = self.running[step.req_index]
            placeholders = request.num_output_placeholders
            if (
                placeholders > 0
                and request.max_tokens is not None
                and request.num_computed_tokens + 2 - placeholders >= request.num_prompt_tokens + request.max_tokens
            ):
                # Async scheduling: the steps in flight already sample its last allowed token (vLLM 0.32's check,
                # L664; computed + 2 - placeholders is the token count once they are processed, for placeholders
                # <= 1).
                step.req_index += 1
                continue
            if step.defer_prefills and request.is_prefill_chunk:
                step.req_index += 1  # vLLM 0.33: this prompt's next chunk waits for a step that carries prefill
                continue
            num_new_tokens = self._num_new_tokens_running(request, step)
            if num_new_tokens <= 0:
                step.req_index += 1
                continue
            new_blocks = self._allocate_slots_or_preempt(request, num_new_tokens, step)
            if new_blocks is None:
                if (cfg.vllm_release == "0.33" and self.policy == "priority"
                        and request.status == RequestStatus.PREEMPTED):
                    # vLLM 0.33 (0.32 breaks here for both policies; see the module docstring): the request
                    # preempted itself and freed its blocks; the requests behind it may still fit.
                    continue
                break  # Cannot schedule this request.
            # Schedule the request.
            step.running_scheduled.append(request)
            step.prefill_scheduled |= request.is_prefill_chunk
            step.num_scheduled_tokens[request.request_id] = num_new_tokens
            step.new_block_ids[request.request_id] = [b.block_id for b in new_blocks]
            step.token_budget -= num_new_tokens
            step.req_index += 1

    def _num_new_tokens_running(self, request: Request, step: SchedulerStep) -> int:
        """Chunk sizing of a running request: how many tokens it computes this step; <= 0 skips it (vLLM
        `v0.32.0 L703-L721 <https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/v1/core/sched/scheduler.py#L703>`_;
        `v0.33.0 L839-L857 <https://github.com/vllm-project/vllm/blob/v0.33.0/vllm/v1/core/sched/scheduler.py#L839>`_).

        What it still wants, ``num_tokens + num_output_placeholders - num_computed_tokens`` (a prefill chunk or one
        decode token), capped by ``step.long_prefill_token_threshold`` (when > 0), by ``step.token_budget``, and so
        that no position reaches ``max_model_len``. vLLM caps at ``max_model_len - num_computed_tokens - 1``
        always (a step that samples needs a position for its token); minivllm drops the -1 when no output is
        pending, so that a prompt of exactly ``max_model_len`` tokens (vLLM rejects it at input) still gets its last
        chunk. With placeholders the -1 is what stops async scheduling at ``max_model_len``, as in vLLM.
        Part of ``schedule()``, split out so that a subclass can replace it (issue 26).
        """
        placeholders = request.num_output_placeholders
        num_new_tokens = request.num_tokens + placeholders - request.num_computed_tokens
        if 0 < step.long_prefill_token_threshold < num_new_tokens:
            num_new_tokens = step.long_prefill_token_threshold
        return min(num_new_tokens, step.token_budget,
                   self.max_model_len - request.num_computed_tokens - (1 if placeholders else 0))

    def _allocate_slots_or_preempt(
        self, request: Request, num_new_tokens: int, step: SchedulerStep
    ) -> Optional[List[KVCacheBlock]]:
        """The preemption step: allocate ``request``'s new blocks, preempting victims until they fit (vLLM's
        "Schedule newly needed KV blocks for the request",
        `v0.32.0 L775-L848 <https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/v1/core/sched/scheduler.py#L775>`_;
        `v0.33.0 L911-L994 <https://github.com/vllm-project/vllm/blob/v0.33.0/vllm/v1/core/sched/scheduler.py#L911>`_).

        Each victim is ``_pick_victim()``'s; it leaves ``self.running`` (the loop's cursor ``step.req_index`` moves
        back if it was before it), gives back what it was scheduled earlier in this step (budget, block ids) and is
        preempted (``_preempt_request``) and listed in ``step.preempted_reqs``. Stops when the blocks fit (returns
        them, the newly allocated ones), when ``request`` preempted itself, or when the victim's blocks could only
        be freed once a step in flight is processed (vLLM: "A deferred free will not help with immediate
        allocation"); then returns ``None``. Part of ``schedule()``, split out (issue 26).
        """
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            if new_blocks is not None:
                return new_blocks
            victim = self._pick_victim()
            if not self._request_blocks_can_be_freed(victim):
                return None
            victim_index = self.running.index(victim)
            del self.running[victim_index]
            if victim_index < step.req_index:  # priority: the victim was already visited in this step
                step.req_index -= 1
            if victim.request_id in step.num_scheduled_tokens:
                step.token_budget += step.num_scheduled_tokens.pop(victim.request_id)
                step.new_block_ids.pop(victim.request_id, None)
                step.running_scheduled.remove(victim)
            self._preempt_request(victim, drop_stale_output=self.requires_kv_delivery)
            step.preempted_reqs.append(victim)
            if victim is request:
                return None  # No more request to preempt. Cannot schedule this request.

    def _pick_victim(self) -> Request:
        """The request to preempt: FCFS the last running one, priority the worst ``(priority, arrival_time)``
        (vLLM inline, `v0.32.0 L796-L802
        <https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/v1/core/sched/scheduler.py#L796>`_;
        `v0.33.0 L932-L938 <https://github.com/vllm-project/vllm/blob/v0.33.0/vllm/v1/core/sched/scheduler.py#L932>`_)."""
        if self.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _admission_gate_open(self, step: SchedulerStep) -> bool:
        """The no-admission gate: whether the waiting loop runs in this step (vLLM ``if not preempted_reqs``,
        `v0.32.0 L900 <https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/v1/core/sched/scheduler.py#L900>`_;
        `v0.33.0 L1050 <https://github.com/vllm-project/vllm/blob/v0.33.0/vllm/v1/core/sched/scheduler.py#L1050>`_;
        vLLM's ``and self._pause_state != PauseState.PAUSED_ALL`` has no counterpart: minivllm cannot be paused).

        Only in a step that preempted nobody: blocks were just short, so admitting would preempt again. Part of
        ``schedule()``, split out so that a subclass can turn the gate off (``return True``) or make it persistent
        (issue 26).
        """
        return not step.preempted_reqs

    def _schedule_waiting(self, step: SchedulerStep) -> None:
        """The waiting loop: admit waiting requests in queue order (vLLM's "Next, schedule the WAITING requests",
        `v0.32.0 L899-L1401 <https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/v1/core/sched/scheduler.py#L899>`_;
        `v0.33.0 L1050-L1616 <https://github.com/vllm-project/vllm/blob/v0.33.0/vllm/v1/core/sched/scheduler.py#L1050>`_).

        While the queue is not empty, budget is left and fewer than ``max_num_seqs`` requests run: peek at the
        head; set it aside for this step (``step_skipped_waiting``, put back at the front afterwards) if its async
        KV load is not finished, if it has deliverable stale output in flight, or if the connector cannot tell its
        hit yet; else look up its prefix-cache hit (``_prefix_cache_lookup``, only when ``num_computed_tokens ==
        0``), size its chunk (``_num_new_tokens_waiting``) and allocate its blocks (whole sequence with
        ``scheduler_reserve_full_isl``). The first request that does not fit stops the loop: waiting requests
        never preempt, and nothing overtakes it. An admitted request becomes RUNNING and joins ``step.new_reqs``
        or, if it was preempted, ``step.resumed_reqs``. Part of ``schedule()``, split out (issue 26).
        """
        cfg = self.config
        step_skipped_waiting: List[Request] = []
        while self.waiting and step.token_budget > 0 and len(self.running) < cfg.max_num_seqs:
            request = self.waiting.peek_request()
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if not self._update_waiting_for_remote_kv(request):
                    step_skipped_waiting.append(self.waiting.pop_request())
                    continue
            if request.num_stale_output_tokens and not request.drop_stale_output:
                # Preempted with a step in flight whose output will still be delivered: resuming now could
                # sample again a position that output fills (vLLM 0.32 skips it the same way, L934).
                step_skipped_waiting.append(self.waiting.pop_request())
                continue
            num_external_computed_tokens, load_kv_async = 0, False
            did_prefix_cache_lookup = request.num_computed_tokens == 0
            if did_prefix_cache_lookup:
                hit = self._prefix_cache_lookup(request)
                if hit is None:  # the connector cannot tell yet: ask again next step
                    step_skipped_waiting.append(self.waiting.pop_request())
                    continue
                new_computed_blocks, num_new_local_computed_tokens, num_external_computed_tokens, load_kv_async = hit
            else:  # its KV was loaded by an async connector load
                new_computed_blocks, num_new_local_computed_tokens = [], 0
            num_computed_tokens = (
                request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
            )
            if load_kv_async:
                num_new_tokens = 0  # loading remote KV: nothing to compute until it has arrived
            elif step.defer_prefills and num_computed_tokens < request.num_tokens - 1:
                break  # vLLM 0.33: no prefill is admitted in a held step
            else:
                size = self._num_new_tokens_waiting(request, num_computed_tokens, step)
                if size is None:
                    break  # strict FCFS: nothing overtakes a prompt that does not fit this step
                num_new_tokens = size
            new_blocks = self.kv_cache_manager.allocate_slots(
                request,
                num_new_tokens,
                num_new_computed_tokens=num_new_local_computed_tokens + num_external_computed_tokens,
                new_computed_blocks=new_computed_blocks,
                full_sequence_must_fit=cfg.scheduler_reserve_full_isl,
                delay_cache_blocks=load_kv_async,
                has_scheduled_reqs=bool(self.running),
            )
            if new_blocks is None:
                if not self.running and not step.num_scheduled_tokens:
                    self._release_blocks_of_waiting_requests(keep=request)
                break  # waiting requests never preempt; the queue head waits for blocks
            if request.num_computed_tokens == 0:
                self.kv_cache_manager.record_prefix_cache_query(request, num_new_local_computed_tokens)
            if self.connector is not None:
                self.connector.update_state_after_alloc(
                    request, self.kv_cache_manager.get_blocks(request.request_id), num_external_computed_tokens
                )
            self.waiting.pop_request()
            if load_kv_async:
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                request.num_computed_tokens = num_computed_tokens
                request.num_external_computed_tokens = num_external_computed_tokens
                step_skipped_waiting.append(request)
                continue
            self.running.append(request)
            self.deferred_waiting.discard(request.request_id)
            step.prefill_admitted |= num_computed_tokens < request.num_tokens - 1
            if request.status == RequestStatus.PREEMPTED:
                step.resumed_reqs.append(request)
            else:
                step.new_reqs.append(request)
            request.status = RequestStatus.RUNNING
            if request.num_cached_tokens < 0:
                # num_computed_tokens, not local + external: after an async load both are 0 here
                request.num_cached_tokens = num_computed_tokens
            request.num_computed_tokens = num_computed_tokens
            if did_prefix_cache_lookup:  # not on the second visit after an async load, which asks nothing
                request.num_external_computed_tokens = num_external_computed_tokens
            step.num_scheduled_tokens[request.request_id] = num_new_tokens
            step.new_block_ids[request.request_id] = self.kv_cache_manager.get_block_ids(request.request_id)
            step.token_budget -= num_new_tokens
        if step_skipped_waiting:
            if self.local_prefill_interval > 1:
                self.deferred_waiting.update(r.request_id for r in step_skipped_waiting)
            self.waiting.prepend_requests(step_skipped_waiting)
        if self.local_prefill_interval > 1 and not step.defer_prefills:
            # vLLM 0.33: a release step that leaves admissible requests waiting (not merely skipped ones)
            # lifts the hold from then on.
            held = sum(1 for r in self.waiting if r.request_id in self.deferred_waiting)
            self.prefill_capacity_bound = len(self.waiting) > held

    def _prefix_cache_lookup(self, request: Request) -> Optional[PrefixCacheHit]:
        """The prefix-cache lookup at admission, for a request with ``num_computed_tokens == 0`` (vLLM's "Get
        already-cached tokens",
        `v0.32.0 L959-L1084 <https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/v1/core/sched/scheduler.py#L959>`_;
        `v0.33.0 L1109-L1261 <https://github.com/vllm-project/vllm/blob/v0.33.0/vllm/v1/core/sched/scheduler.py#L1109>`_;
        its local half is vLLM's ``_get_local_prefix_cache_hit``, L558).

        The local hit from ``kv_cache_manager.get_computed_blocks`` (its full blocks still cached; nothing for a
        request with ``skip_reading_prefix_cache``), then, with a connector, the tokens it can load beyond them
        (``get_num_new_matched_tokens``). A ``skip_reading_prefix_cache`` request reads the connector's cache
        neither (vLLM 0.32 L983). Returns the hit, or ``None`` when the connector cannot tell yet (the request is
        skipped this step). vLLM's block-aligned hand-over of a partial local block, the sliding-window replay and
        the connector's hit statistics have no counterpart in minivllm. Part of ``schedule()``, split out so that a
        subclass can replace it (issue 26).
        """
        new_computed_blocks, num_new_local_computed_tokens = self.kv_cache_manager.get_computed_blocks(request)
        num_external_computed_tokens, load_kv_async = 0, False
        if self.connector is not None:
            ext_tokens, load_kv_async = self.connector.get_num_new_matched_tokens(
                request, num_new_local_computed_tokens
            )
            if request.sampling_params.skip_reading_prefix_cache:
                ext_tokens, load_kv_async = 0, False  # nor the connector's cache (vLLM 0.32, L983)
            if ext_tokens is None:
                return None
            num_external_computed_tokens = ext_tokens
        return PrefixCacheHit(new_computed_blocks, num_new_local_computed_tokens, num_external_computed_tokens,
                              load_kv_async)

    def _num_new_tokens_waiting(self, request: Request, num_computed_tokens: int,
                                step: SchedulerStep) -> Optional[int]:
        """Chunk sizing of a waiting request about to be admitted with ``num_computed_tokens`` already computed
        (prefix-cache and connector hits included); ``None`` stops the waiting loop (vLLM
        `v0.32.0 L1117-L1169 <https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/v1/core/sched/scheduler.py#L1117>`_;
        `v0.33.0 L1294-L1346 <https://github.com/vllm-project/vllm/blob/v0.33.0/vllm/v1/core/sched/scheduler.py#L1294>`_).

        ``num_tokens - num_computed_tokens`` (``num_tokens``, not the prompt: a resumed request has output tokens
        too), capped by ``step.long_prefill_token_threshold`` (when > 0), then by ``step.token_budget``. Without
        chunked prefill a request whose tokens exceed the budget is not cut: ``None`` (strict FCFS, nothing
        overtakes it). Part of ``schedule()``, split out so that a subclass can replace it (issue 26).
        """
        num_new_tokens = request.num_tokens - num_computed_tokens
        if 0 < step.long_prefill_token_threshold < num_new_tokens:
            num_new_tokens = step.long_prefill_token_threshold
        if not self.config.enable_chunked_prefill and num_new_tokens > step.token_budget:
            return None
        return min(num_new_tokens, step.token_budget)

    def _build_scheduler_output(self, step: SchedulerStep) -> SchedulerOutput:
        """The step's ``SchedulerOutput`` (vLLM's "Construct the scheduler output",
        `v0.32.0 L1417-L1522 <https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/v1/core/sched/scheduler.py#L1417>`_;
        `v0.33.0 L1641-L1750 <https://github.com/vllm-project/vllm/blob/v0.33.0/vllm/v1/core/sched/scheduler.py#L1641>`_):
        new requests with their prompts and block ids, the cached ones (``_make_cached_request_data``),
        ``num_scheduled_tokens``, the finished ids since the last step and this step's preempted ids. Under the V2
        model runner a resumed request is sent as new, with all its tokens so far (vLLM L1418). Remembers which
        requests were scheduled (V1 runner). Part of ``schedule()``, split out (issue 26).
        """
        new_reqs, resumed_reqs = step.new_reqs, step.resumed_reqs
        if self.use_v2_model_runner:
            # Model Runner V2 rebuilds a resumed request from scratch: it is sent as new, with all its tokens so
            # far as the prompt (vLLM 0.32 scheduler.py: scheduled_new_reqs.extend(scheduled_resumed_reqs)).
            new_reqs, resumed_reqs = new_reqs + resumed_reqs, []
        cached = self._make_cached_request_data(step.running_scheduled, resumed_reqs, step.new_block_ids)
        if not self.use_v2_model_runner:
            self.prev_step_scheduled_req_ids = set(step.num_scheduled_tokens)
        return SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData(
                    r.request_id,
                    list(r.prompt_token_ids),
                    r.sampling_params,
                    step.new_block_ids[r.request_id],
                    r.num_computed_tokens,
                    list(r.all_token_ids) if self.use_v2_model_runner else None,
                )
                for r in new_reqs
            ],
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=step.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(step.num_scheduled_tokens.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in step.preempted_reqs} | self.reset_preempted_req_ids,
        )

    def _preempt_request(self, request: Request, drop_stale_output: bool = False) -> None:
        """Preemption by recompute (vLLM ``Scheduler._preempt_request``).

        Frees all blocks, resets ``num_computed_tokens`` to 0 and puts the request at the front of the waiting
        queue (FCFS; priority re-inserts it by priority). Its prompt *and generated tokens* are kept: on
        re-admission all of them are prefilled again (prefix-cache hits can skip full blocks still cached).

        Under async scheduling the output of its steps still in flight becomes *stale*: it is delivered when it
        arrives (the tokens are appended; a stop still finishes the request) unless ``drop_stale_output``, and
        the request is not resumed before that (the waiting loop skips it). Its placeholders are dropped.
        """
        self._free_request_blocks(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        # An undrained stale share that was already to be dropped stays dropped (its positions were resampled).
        request.drop_stale_output = drop_stale_output or (
            request.drop_stale_output and request.num_stale_output_tokens > 0
        )
        request.num_stale_output_tokens = request.num_in_flight_tokens
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        self.waiting.prepend_request(request)

    def _update_after_schedule(self, output: SchedulerOutput) -> None:
        # Advance now, so the next schedule() could already give the next chunk (vLLM does the same).
        for req_id, n in output.num_scheduled_tokens.items():
            request = self.requests[req_id]
            request.num_computed_tokens += n
            request.num_in_flight_tokens += n
            request.last_sched_seq = self.sched_step_seq
            request.is_prefill_chunk = is_partial_prefill(
                request.num_computed_tokens, request.num_tokens + request.num_output_placeholders)
        self.finished_req_ids = set()
        self.reset_preempted_req_ids = set()

    def _make_cached_request_data(self, running_scheduled: List[Request], resumed_reqs: List[Request],
                                  new_block_ids: Dict[str, List[int]]) -> CachedRequestData:
        """The running and resumed requests of the step, as the runner gets them (vLLM
        ``Scheduler._make_cached_request_data``, `v0.32.0 L1693
        <https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/v1/core/sched/scheduler.py#L1693>`_;
        `v0.33.0 L1922 <https://github.com/vllm-project/vllm/blob/v0.33.0/vllm/v1/core/sched/scheduler.py#L1922>`_):
        new block ids and ``num_computed_tokens`` of each; under the V1 runner all token ids of one not scheduled in
        the previous step (a resumed one, or one that skipped a step: the runner may have dropped it)."""
        cached = CachedRequestData()
        for r in running_scheduled + resumed_reqs:
            cached.req_ids.append(r.request_id)
            cached.new_block_ids.append(new_block_ids[r.request_id])
            cached.num_computed_tokens.append(r.num_computed_tokens)
            if r in resumed_reqs:
                cached.resumed_req_ids.add(r.request_id)
            if not self.use_v2_model_runner and r.request_id not in self.prev_step_scheduled_req_ids:
                cached.all_token_ids[r.request_id] = list(r.all_token_ids)
        return cached

    # -- block frees, deferred while a step in flight may still write the blocks --------------------------------
    def _request_blocks_can_be_freed(self, request: Request) -> bool:
        return not self.defer_block_free or request.last_sched_seq <= self.processed_step_seq

    def _free_request_blocks(self, request: Request) -> None:
        if self._request_blocks_can_be_freed(request):
            self.kv_cache_manager.free(request)
            return
        blocks = self.kv_cache_manager.pop_blocks_for_free(request)
        if blocks:
            self.deferred_frees.append((self.sched_step_seq, blocks))

    def _drain_deferred_frees(self) -> None:
        """Return the deferred blocks whose fencing step has been processed, last block first."""
        while self.deferred_frees and self.deferred_frees[0][0] <= self.processed_step_seq:
            _, blocks = self.deferred_frees.popleft()
            self.kv_cache_manager.block_pool.free_blocks(reversed(blocks))

    def _release_blocks_of_waiting_requests(self, keep: Request) -> None:
        """Deadlock guard for async connector loads: free the blocks that waiting requests hold.

        An async load allocates blocks to a request that then waits. If nothing runs and the queue head does
        not fit, only those blocks could make room, and their owners sit behind the head: nothing would move
        again. Their loads are finished (a load still being written keeps its blocks until it is reported), so
        they are dropped like a preemption (``num_computed_tokens = 0``); the requests ask the connector again.
        vLLM avoids the same deadlock by admitting async loads only into blocks not reserved for others
        (``scheduler.py``, "to avoid deadlock").
        """
        for r in list(self.waiting):
            rid = r.request_id
            if r is keep or not self.kv_cache_manager.get_blocks(rid):
                continue
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and rid not in self.finished_recving_kv_req_ids:
                continue  # its blocks are still being written
            self.finished_recving_kv_req_ids.discard(rid)
            self.kv_cache_manager.free(r)
            r.status = RequestStatus.PREEMPTED if r.num_preemptions > 0 else RequestStatus.WAITING
            r.num_computed_tokens = 0

    def _update_waiting_for_remote_kv(self, request: Request) -> bool:
        """True once an async connector load of ``request`` has finished; then it is schedulable again."""
        if request.request_id not in self.finished_recving_kv_req_ids:
            return False
        self.finished_recving_kv_req_ids.discard(request.request_id)
        self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        request.status = RequestStatus.PREEMPTED if request.num_preemptions > 0 else RequestStatus.WAITING
        if request.num_computed_tokens >= request.num_tokens:
            request.num_computed_tokens = request.num_tokens - 1  # recompute one token to get its logits
        return True

    def make_stats(self) -> Optional[SchedulerStats]:
        """The queues and the pool now, or ``None`` when ``log_stats`` is off (vLLM ``Scheduler.make_stats``, called
        at the end of ``update_from_output``; minivllm's ``EngineCore`` calls it after each step and the
        ``AsyncLLM`` after aborts, so that no gauge goes stale)."""
        if not self.log_stats:
            return None
        return SchedulerStats(num_running_reqs=len(self.running), num_waiting_reqs=len(self.waiting),
                              kv_cache_usage=self.kv_cache_manager.usage, step_counter=self.stats.num_steps,
                              num_preemptions=self.stats.num_preemptions)

    # ---------------------------------------------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> List[EngineCoreOutput]:
        """Append sampled tokens, check stop conditions, free finished requests (vLLM ``update_from_output``).

        A request whose step was a partial prefill got ``[]``: nothing is appended, nothing is emitted, and
        ``num_computed_tokens`` (already advanced at schedule time) stays as it is.

        The connector's transfer reports are checked first (see ``_check_kv_xfer_reports``).

        Under async scheduling the output may belong to a step scheduled before the request finished (nothing is
        emitted for it) or was preempted (stale output: delivered, or dropped with ``drop_stale_output``; a
        stop in it finishes the request from the waiting queue).

        Raises:
            RuntimeError: a transfer report that vLLM would assert on; raised before any state changes.
        """
        self._check_kv_xfer_reports(model_runner_output)
        if self.defer_block_free and scheduler_output.total_num_scheduled_tokens > 0:
            # Every write of this step and the earlier ones is done: their deferred blocks may go back.
            self.processed_step_seq += 1
            self._drain_deferred_frees()
        outputs: List[EngineCoreOutput] = []
        stopped_running: List[Request] = []
        stopped_waiting: List[Request] = []
        sampled = model_runner_output.sampled_token_ids
        for req_id, num_tokens_scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            output_is_stale = False
            if request is not None:
                request.num_in_flight_tokens -= num_tokens_scheduled
                if request.num_stale_output_tokens > 0:  # drained in step order
                    output_is_stale = True
                    request.num_stale_output_tokens -= num_tokens_scheduled
                    assert request.num_stale_output_tokens >= 0
            if request is None or request.is_finished():
                continue  # finished or aborted while the step ran
            if output_is_stale and request.drop_stale_output:
                continue
            new_ids = sampled[model_runner_output.req_id_to_index[req_id]]
            if not new_ids:
                continue  # a partial prefill
            status_before = request.status
            kept, done = self._update_request_with_output(request, list(new_ids), is_stale=output_is_stale)
            if done:
                (stopped_running if status_before == RequestStatus.RUNNING else stopped_waiting).append(request)
                self._free_request(request)
            eco = EngineCoreOutput(req_id, kept, request.get_finished_reason(), request.stop_reason)
            # The runner's logprobs ride with the tokens they belong to (vLLM update_from_output does the same).
            if model_runner_output.logprobs is not None:
                entry = model_runner_output.logprobs[model_runner_output.req_id_to_index[req_id]]
                if entry is not None:
                    eco.new_logprobs = [entry] if kept else []
            if model_runner_output.prompt_logprobs_dict:
                eco.new_prompt_logprobs = model_runner_output.prompt_logprobs_dict.get(req_id)
            outputs.append(eco)
        if stopped_running:
            ids = {id(r) for r in stopped_running}
            self.running = [r for r in self.running if id(r) not in ids]
        if stopped_waiting:  # rare: stale output of a preempted request stopped it
            self.waiting.remove_requests(stopped_waiting)
        for req_id in model_runner_output.finished_recving or ():
            if req_id in self.requests:  # checked above: it is WAITING_FOR_REMOTE_KVS
                self.finished_recving_kv_req_ids.add(req_id)
        return outputs

    def _update_request_with_output(
        self, request: Request, new_token_ids: List[int], is_stale: bool = False
    ) -> Tuple[List[int], bool]:
        """Append sampled tokens one by one until one stops the request (vLLM
        ``Scheduler._update_request_with_output``). Returns ``(tokens kept, stopped)``; tokens after the stop are
        dropped. ``is_stale`` is used by ``AsyncScheduler``."""
        for k, tok in enumerate(new_token_ids, 1):
            request.append_output_token_ids([tok])
            if check_stop(request, self.max_model_len):
                return new_token_ids[:k], True
        return new_token_ids, False

    def _check_kv_xfer_reports(self, model_runner_output: ModelRunnerOutput) -> None:
        """Reject transfer reports for live requests that are not waiting for them (vLLM 0.32
        ``Scheduler._update_from_kv_xfer_finished``, which asserts on them).

        * ``finished_recving``: vLLM records the id for a request in ``WAITING_FOR_REMOTE_KVS`` and frees the
          blocks a *finished* request kept for the transfer. minivllm frees a request's blocks when it finishes
          (``request_finished`` must be done with them; minivllm has no delayed free), so an id it no longer
          knows has nothing left to free and its report is dropped. Keeping it would make a later load of a
          request with that id look finished before it is.
        * ``finished_sending``: vLLM frees the blocks of a finished request; the same holds as above.
        * Any other state (``WAITING``, ``RUNNING``, ``PREEMPTED``): vLLM asserts; minivllm raises here, before the
          step's tokens are appended, so the scheduler is left exactly as it was.
        (vLLM's third report path, blocks that failed to load, has no counterpart in minivllm.)
        """
        for kind in ("finished_recving", "finished_sending"):
            for req_id in sorted(getattr(model_runner_output, kind) or ()):
                request = self.requests.get(req_id)
                if request is None:
                    continue
                if kind == "finished_recving" and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                    continue
                expected = "WAITING_FOR_REMOTE_KVS or finished" if kind == "finished_recving" else "finished"
                raise RuntimeError(
                    f"{type(self.connector).__name__}.get_finished reported {kind} for request {req_id!r}, which is "
                    f"{request.status.name} (expected {expected}); vLLM asserts on this report "
                    "(scheduler.py, _update_from_kv_xfer_finished). The step's outputs were not applied."
                )

    def finish_requests(self, request_ids: Iterable[str], finished_status: RequestStatus) -> List[Request]:
        """Finish requests from outside the step (abort, stop string). Unknown or finished ids are ignored.

        Returns the requests that were finished here; their blocks are back in the pool on return.
        """
        done: List[Request] = []
        seen: Set[str] = set()
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished() or rid in seen:
                continue
            seen.add(rid)
            done.append(request)
        # Out of both queues in one pass each, as vLLM 0.32 does (remove_all, waiting.remove_requests): one at a
        # time cost O(n^2) when a parent with thousands of n-children was aborted.
        running = {id(r) for r in done if r.status == RequestStatus.RUNNING}
        if running:
            self.running[:] = [r for r in self.running if id(r) not in running]
        waiting = [r for r in done if r.status != RequestStatus.RUNNING]
        if waiting:
            self.waiting.remove_requests(waiting)
        for request in done:
            request.status = finished_status
            self._free_request(request)
        return done

    def _free_request(self, request: Request) -> None:
        if self.connector is not None:
            self.connector.request_finished(request, self.kv_cache_manager.get_block_ids(request.request_id))
        self._free_request_blocks(request)
        self.finished_req_ids.add(request.request_id)
        self.finished_recving_kv_req_ids.discard(request.request_id)
        self.deferred_waiting.discard(request.request_id)
        del self.requests[request.request_id]

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget all prefix-cache hashes (vLLM ``Scheduler.reset_prefix_cache``, v0.32.0). Returns success.

        Without ``reset_running_requests`` it only succeeds while no request holds blocks (else ``False``, nothing
        changed). With it, every running request is first preempted back to the waiting queue, as vLLM does: taken
        from the end of ``running`` and put at the front of ``waiting``, so they come back in their running
        order, ahead of the requests that were already waiting. Each counts as a preemption (its
        ``num_preemptions`` and ``stats.num_preemptions``) and is listed in the next step's
        ``SchedulerOutput.preempted_req_ids``; it resumes by recomputing its whole sequence, so greedy (or
        seeded) outputs do not change.

        Raises:
            RuntimeError: with ``reset_running_requests``, if a waiting request holds blocks (an asynchronous
                connector load): the reset could not succeed. vLLM raises too, after preempting; minivllm raises
                before changing anything.
        """
        if reset_running_requests:
            holders = [r for r in self.waiting if self.kv_cache_manager.get_blocks(r.request_id)]
            if holders:
                raise RuntimeError(
                    "reset_prefix_cache(reset_running_requests=True): waiting requests hold KV blocks for an "
                    f"asynchronous connector load ({', '.join(f'{r.request_id!r} {r.status.name}' for r in holders)}); "
                    "preempting the running requests would not free them. Nothing was changed."
                )
            in_flight = [r.request_id for r in self.running if not self._request_blocks_can_be_freed(r)]
            if in_flight or self.deferred_frees:
                raise RuntimeError(
                    "reset_prefix_cache(reset_running_requests=True): blocks of "
                    f"{', '.join(map(repr, in_flight)) or 'finished requests'} are still written by a step in flight "
                    "(async scheduling with a KV connector defers their free); process that step's output first. "
                    "Nothing was changed. (vLLM raises too, after preempting.)"
                )
            while self.running:
                request = self.running.pop()
                # Preempted and possibly resumed in the same step: output still in flight is dropped, not
                # delivered (it would arrive after the resumed request resampled those positions).
                self._preempt_request(request, drop_stale_output=True)
                self.reset_preempted_req_ids.add(request.request_id)
                self.stats.num_preemptions += 1
            self.prev_step_scheduled_req_ids = set()
        ok = self.kv_cache_manager.reset_prefix_cache()
        assert ok or not reset_running_requests, "every block should be free after preempting all requests"
        return ok

    def queue_snapshot(self) -> Tuple[List[str], List[str]]:
        """``(waiting ids in queue order, running ids in order)``."""
        return [r.request_id for r in self.waiting], [r.request_id for r in self.running]
