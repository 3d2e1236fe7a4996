"""A step-by-step record of what the scheduler did: the input of every widget, plot and FAQ answer.

One ``StepRecord`` per engine step, taken right after ``schedule()`` (queues, blocks, what was scheduled) and
completed when the step's outputs are final (which requests finished). Nothing here is drawn by hand: every frame of
the course's animations is one of these records.

``SchedulerTrace`` is a step observer (``minivllm.engine.core``): the engine knows nothing of it; the course registers
it (``engine.add_step_observer(trace)``), or uses ``TracedLLMEngine``, an ``LLMEngine`` that does so itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from minivllm.core.sched.scheduler import SchedulerStep
from minivllm.engine.llm_engine import LLMEngine
from minivllm.i18n import L_
from minivllm.request import RequestStatus

if TYPE_CHECKING:
    from minivllm.core.sched.output import SchedulerOutput
    from minivllm.engine.core import EngineCore
    from minivllm.outputs import RequestOutput


_INPUT_FIELDS = ("req_ids", "input_ids", "positions", "query_start_loc", "seq_lens", "num_computed_tokens",
                 "block_table", "slot_mapping", "logits_indices", "discard_mask", "sampled")


@dataclass
class RequestSnapshot:
    """One request's counters at a step, in tokens (``block_ids`` in block-table order; ``arrival_time`` in
    seconds of ``time.monotonic()``, the priority policy's tie-break)."""

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
    arrival_time: float = 0.0


@dataclass
class WaitingHeadCheck:
    """The waiting queue's head after a step, asked what the waiting loop asks a request before admitting it.

    Taken right after ``schedule()``: the pool and the token budget are then exactly as the waiting loop left
    them (nothing allocates after it), so these are the facts behind its stop. Each number comes from the
    engine's own code, asked without changing anything: the prefix-cache hit from
    ``KVCacheManager.get_computed_blocks``, the chunk from the scheduler's ``_num_new_tokens_waiting`` (with the
    budget left and the step's ``long_prefill_token_threshold``), the blocks from
    ``KVCacheManager.get_num_blocks_to_allocate`` and ``num_blocks_to_admit``. A KV connector's hit is not asked
    (asking may change the connector's state), so with a connector the blocks count local hits only.

    Attributes:
        request_id / status: the head (the first of ``StepRecord.waiting``) and its ``RequestStatus`` name.
        num_tokens: its tokens so far (prompt, plus output for a preempted request).
        num_hit_tokens: tokens its prefix-cache hit would cover now (0 unless ``num_computed_tokens`` was 0).
        num_new_tokens: the chunk it would get from the budget left; ``None``: without chunked prefill its tokens
            do not fit the budget left; 0 when no budget is left (then no blocks are asked).
        blocks_for_chunk: free blocks that allocating that chunk would take.
        blocks_for_whole: free blocks its whole current sequence needs (``scheduler_reserve_full_isl``'s check).
        watermark_blocks: blocks an admission must leave free in this state (0 unless a watermark is set and
            other requests run).
    """

    request_id: str
    status: str
    num_tokens: int
    num_hit_tokens: int
    num_new_tokens: Optional[int]
    blocks_for_chunk: int
    blocks_for_whole: int
    watermark_blocks: int


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
        new_block_ids: block ids each scheduled request got in this step (its whole table when admitted).
        waiting_head: the waiting queue's head checked as the waiting loop checks it (``None``: nobody waits).
        policy: ``"fcfs"`` or ``"priority"``.
        reserve_full_isl / chunked_prefill: ``scheduler_reserve_full_isl`` and ``enable_chunked_prefill``.
        long_prefill_token_threshold: the step's cap on one request's tokens (0 = none; the lone-request rule
            applied).
        block_size: tokens per KV block (0 in records made before this field existed).
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
    new_block_ids: Dict[str, List[int]] = field(default_factory=dict)
    waiting_head: Optional[WaitingHeadCheck] = None
    policy: str = "fcfs"
    reserve_full_isl: bool = True
    chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    block_size: int = 0

    @property
    def total_scheduled(self) -> int:
        return sum(self.num_scheduled_tokens.values())


def _runner_last_inputs(worker: Any) -> Any:
    """A worker's last ``StepInputs`` (sent to worker processes by ``collective_rpc``)."""
    return worker.model_runner.last_inputs


def _last_inputs(engine_core: "EngineCore") -> Any:
    """The last step's ``StepInputs``: the driver worker's in this process, else rank 0's from its process (every
    rank runs the same batch)."""
    executor = engine_core.model_executor
    worker = getattr(executor, "driver_worker", None)
    if worker is not None:
        return worker.model_runner.last_inputs
    return executor.collective_rpc(_runner_last_inputs, unique_reply_rank=0)


def _check_waiting_head(engine_core: "EngineCore", waiting: List[str], budget_left: int,
                        threshold: int) -> Optional[WaitingHeadCheck]:
    """``WaitingHeadCheck`` of the waiting queue's head right after ``schedule()`` (``None`` if nobody waits).
    Changes nothing: it asks the pure parts of the scheduler and the KV cache manager. The head is the first of
    ``waiting`` (``queue_snapshot()``'s order, the order ``peek_request`` serves), not asked of the queue: a
    notebook that counts ``peek_request`` calls (10's peek counter) must count the scheduler's only."""
    sched, kv = engine_core.scheduler, engine_core.kv_cache_manager
    if not waiting:
        return None
    r = sched.requests[waiting[0]]
    hits, hit_tokens = kv.get_computed_blocks(r) if r.num_computed_tokens == 0 else ([], 0)
    n: Optional[int] = 0
    blocks_for_chunk = 0
    if budget_left > 0:
        n = sched._num_new_tokens_waiting(
            r, r.num_computed_tokens + hit_tokens,
            SchedulerStep(token_budget=budget_left, long_prefill_token_threshold=threshold))
        if n is not None:
            blocks_for_chunk = kv.get_num_blocks_to_allocate(r, n, hit_tokens, hits)
    admitting = r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    return WaitingHeadCheck(
        request_id=r.request_id, status=r.status.name, num_tokens=r.num_tokens, num_hit_tokens=hit_tokens,
        num_new_tokens=n, blocks_for_chunk=blocks_for_chunk, blocks_for_whole=kv.num_blocks_to_admit(r, hits),
        watermark_blocks=kv.watermark_blocks if sched.running and admitting else 0,
    )


@dataclass
class SchedulerTrace:
    """All steps of a run, with the queries the course asks of it; also the step observer that records them.

    Register it on an engine (``engine.add_step_observer(trace)``, or use ``TracedLLMEngine``) and each step
    appends one ``StepRecord``. ``on_schedule`` snapshots the queues, requests and blocks right after
    ``schedule()``, before the forward pass changes anything; ``on_step_end`` adds what the step produced (the
    model runner's inputs when ``record_inputs``, a ``RecordingConnector``'s calls, the requests that finished).
    It reads public views (``Scheduler.queue_snapshot`` and ``requests``, ``KVCacheManager.get_block_ids``,
    ``num_free_blocks`` and ``get_cached_free_block_ids``, ``ModelRunner.last_inputs``, the step's outputs) and
    asks the engine's own pure parts about the waiting queue's head (``WaitingHeadCheck``): the facts from which
    ``minivllm.course.viz.explain`` says why each step went as it did. All of it runs in the observer, only when
    a trace is registered: the engine computes nothing for the course.

    Attributes:
        steps: the records, one per step.
        record_inputs: also keep each step's flattened batch (positions, slot mapping, ...) in ``StepRecord.inputs``.
    """

    steps: List[StepRecord] = field(default_factory=list)
    record_inputs: bool = False
    _pending: Optional[StepRecord] = field(default=None, repr=False, compare=False)
    _num_scheduled: int = field(default=0, repr=False, compare=False)

    # ---- the observer (see minivllm.engine.core.StepObserver) ------------------------------------------------
    def on_schedule(self, engine_core: "EngineCore", scheduler_output: "SchedulerOutput") -> None:
        sched, kv, config = engine_core.scheduler, engine_core.kv_cache_manager, engine_core.vllm_config
        so = scheduler_output
        waiting, running = sched.queue_snapshot()
        snaps: Dict[str, RequestSnapshot] = {}
        for rid in waiting + running:
            r = sched.requests[rid]
            snaps[rid] = RequestSnapshot(
                rid, r.status.name, r.num_prompt_tokens, r.num_computed_tokens, r.num_output_tokens, r.num_tokens,
                kv.get_block_ids(rid), r.num_preemptions, r.num_cached_tokens, r.priority, r.arrival_time,
            )
        kinds, before = {}, {}
        for rid, n in so.num_scheduled_tokens.items():
            r = sched.requests[rid]
            before[rid] = r.num_computed_tokens - n
            is_decode = n == 1 and r.num_output_tokens > 0 and before[rid] == r.num_tokens - 1
            kinds[rid] = "decode" if is_decode else "prefill"
        num_gpu_blocks = kv.block_pool.num_gpu_blocks  # the pool's size (the config's is Optional until profiled)
        owners: List[List[str]] = [[] for _ in range(num_gpu_blocks)]
        for rid, snap in snaps.items():  # every request holding blocks is in a queue
            for b in snap.block_ids:
                owners[b].append(rid)
        self._num_scheduled = so.total_num_scheduled_tokens
        new_block_ids = {n.req_id: list(n.block_ids) for n in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        new_block_ids.update({rid: list(b) for rid, b in zip(cached.req_ids, cached.new_block_ids)})
        sc = config.scheduler_config
        # the lone-request rule reads the queues' total, which schedule() does not change: the step's value
        threshold = sched._long_prefill_token_threshold()
        self._pending = StepRecord(
            step=len(self.steps),
            waiting=waiting,
            running=running,
            num_scheduled_tokens=dict(so.num_scheduled_tokens),
            kinds=kinds,
            num_computed_before=before,
            new=[n.req_id for n in so.scheduled_new_reqs],
            resumed=sorted(so.scheduled_cached_reqs.resumed_req_ids, key=so.scheduled_cached_reqs.req_ids.index),
            preempted=sorted(so.preempted_req_ids),
            finished={},
            requests=snaps,
            num_free_blocks=kv.num_free_blocks,
            num_gpu_blocks=num_gpu_blocks,
            block_owners=owners,
            cached_free_blocks=kv.get_cached_free_block_ids(),
            token_budget=config.scheduler_config.max_num_batched_tokens,
            max_num_seqs=sc.max_num_seqs,
            new_block_ids={rid: new_block_ids.get(rid, []) for rid in so.num_scheduled_tokens},
            waiting_head=_check_waiting_head(
                engine_core, waiting, sc.max_num_batched_tokens - so.total_num_scheduled_tokens, threshold),
            policy=sc.policy,
            reserve_full_isl=sc.scheduler_reserve_full_isl,
            chunked_prefill=sc.enable_chunked_prefill,
            long_prefill_token_threshold=threshold,
            block_size=config.cache_config.block_size,
        )

    def on_step_end(self, engine_core: "EngineCore", engine_core_outputs: Any,
                    request_outputs: List["RequestOutput"]) -> None:
        record, self._pending = self._pending, None
        if record is None:  # registered in the middle of a step
            return
        li = _last_inputs(engine_core) if self.record_inputs and self._num_scheduled else None
        if li is not None:
            record.inputs = {f: list(li.req_ids) if f == "req_ids" else getattr(li, f).tolist() for f in _INPUT_FIELDS}
        take_calls = getattr(engine_core.kv_connector, "take_step_calls", None)  # a RecordingConnector
        if take_calls is not None:
            record.connector_calls = take_calls()
        for o in request_outputs:
            if o.finished:
                record.finished[o.request_id] = str(o.outputs[0].finish_reason)  # never None once finished
        self.steps.append(record)

    # ---- the queries -------------------------------------------------------------------------------------------

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
        """One row per step: the table shown in the notebooks. The column names are English (code indexes them);
        :func:`minivllm.course.tables.translated_labels` shows them in the learner's language."""
        rows = []
        for s in self.steps:
            sched = ", ".join(
                f"{r}:{'P' if s.kinds[r] == 'prefill' else 'D'}{n}" for r, n in s.num_scheduled_tokens.items()
            )
            rows.append(
                {
                    L_("step"): s.step,
                    L_("waiting"): " ".join(s.waiting) or "-",
                    L_("running"): " ".join(s.running) or "-",
                    L_("scheduled (P=prefill, D=decode)"): sched or "-",
                    L_("tokens"): s.total_scheduled,
                    L_("preempted"): " ".join(s.preempted) or "",
                    L_("finished"): " ".join(s.finished) or "",
                    L_("free blocks"): s.num_free_blocks,
                }
            )
        return rows

    def to_dataframe(self):
        """``to_rows()`` as a pandas DataFrame indexed by step."""
        import pandas as pd

        return pd.DataFrame(self.to_rows()).set_index("step")


class TracedLLMEngine(LLMEngine):
    """An ``LLMEngine`` that records every step in ``self.trace`` (a ``SchedulerTrace``): the course's engine.

    Args:
        model, **engine_kwargs: as for ``LLMEngine``.
        record_inputs: also keep each step's flattened batch in ``StepRecord.inputs``.
    """

    def __init__(self, model=None, *, record_inputs: bool = False, **engine_kwargs) -> None:
        super().__init__(model, **engine_kwargs)
        self.trace = SchedulerTrace(record_inputs=record_inputs)
        self.add_step_observer(self.trace)
