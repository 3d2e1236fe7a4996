"""The step observer that fills a ``SchedulerTrace`` (course tooling; see ``minivllm.engine.core`` for the hooks).

It reads only what the step produces and public views: the ``SchedulerOutput``, the scheduler's queues
(``queue_snapshot``) and live requests, the KV cache manager's block tables (``get_block_ids``) and evictable
blocks (``get_cached_free_block_ids``), the model runner's ``last_inputs`` and the step's ``RequestOutput``s.
"""

from __future__ import annotations

from typing import Dict, List, Optional

from minivllm.core.sched.output import SchedulerOutput
from minivllm.engine.trace import RequestSnapshot, SchedulerTrace, StepRecord

_INPUT_FIELDS = ("req_ids", "input_ids", "positions", "query_start_loc", "seq_lens", "num_computed_tokens",
                 "block_table", "slot_mapping", "logits_indices", "discard_mask", "sampled")


class TraceRecorder:
    """Appends one ``StepRecord`` per engine step to ``trace``.

    Args:
        trace: the ``SchedulerTrace`` to fill.
        record_inputs: also keep each step's flattened batch (positions, slot mapping, ...) in ``StepRecord.inputs``.
    """

    def __init__(self, trace: SchedulerTrace, record_inputs: bool = False) -> None:
        self.trace = trace
        self.record_inputs = record_inputs
        self._record: Optional[StepRecord] = None
        self._scheduler_output: Optional[SchedulerOutput] = None

    def on_schedule(self, engine_core, scheduler_output: SchedulerOutput) -> None:
        """Snapshot queues, requests and blocks right after ``schedule()``, before the forward pass."""
        sched, kv = engine_core.scheduler, engine_core.kv_cache_manager
        config = engine_core.vllm_config
        so = scheduler_output
        waiting, running = sched.queue_snapshot()
        snaps: Dict[str, RequestSnapshot] = {}
        for rid in waiting + running:
            r = sched.requests[rid]
            snaps[rid] = RequestSnapshot(
                rid, r.status.name, r.num_prompt_tokens, r.num_computed_tokens, r.num_output_tokens, r.num_tokens,
                kv.get_block_ids(rid), r.num_preemptions, r.num_cached_tokens, r.priority,
            )
        kinds, before = {}, {}
        for rid, n in so.num_scheduled_tokens.items():
            r = sched.requests[rid]
            before[rid] = r.num_computed_tokens - n
            is_decode = n == 1 and r.num_output_tokens > 0 and before[rid] == r.num_tokens - 1
            kinds[rid] = "decode" if is_decode else "prefill"
        num_gpu_blocks = config.cache_config.num_gpu_blocks
        owners: List[List[str]] = [[] for _ in range(num_gpu_blocks)]
        for rid, snap in snaps.items():
            for b in snap.block_ids:
                owners[b].append(rid)
        self._scheduler_output = so
        self._record = StepRecord(
            step=len(self.trace.steps),
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
            max_num_seqs=config.scheduler_config.max_num_seqs,
        )

    def on_step_end(self, engine_core, engine_core_outputs, request_outputs) -> None:
        """Complete the record (inputs, connector calls, finished requests) and append it."""
        record, so = self._record, self._scheduler_output
        if record is None:
            return
        self._record = self._scheduler_output = None
        li = engine_core.model_executor.last_inputs
        if self.record_inputs and li is not None and so.total_num_scheduled_tokens:
            record.inputs = {f: (list(li.req_ids) if f == "req_ids" else getattr(li, f).tolist()) for f in _INPUT_FIELDS}
        take_calls = getattr(engine_core.vllm_config.kv_connector, "take_step_calls", None)  # a RecordingConnector
        if take_calls is not None:
            record.connector_calls = take_calls()
        for o in request_outputs:
            if o.finished:
                record.finished[o.request_id] = o.outputs[0].finish_reason
        self.trace.steps.append(record)
