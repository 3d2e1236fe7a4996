"""What the scheduler hands the model runner each step (vLLM: ``vllm/v1/core/sched/output.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

from minivllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the model runner has not seen (or must rebuild): sent with its full prompt and block table.

    ``prefill_token_ids`` (Model Runner V2 only, as in vLLM 0.32): every token the runner must know, i.e. the
    prompt plus the outputs so far when a preempted request resumes as new; ``None`` under the V1 runner.
    """

    req_id: str
    prompt_token_ids: List[int]
    sampling_params: SamplingParams
    block_ids: List[int]
    num_computed_tokens: int
    prefill_token_ids: Optional[List[int]] = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class CachedRequestData:
    """Requests the runner already holds state for: only what changed since the last step.

    ``resumed_req_ids`` are requests coming back after preemption: for them ``new_block_ids`` is the *whole*
    new block table. ``all_token_ids`` carries prompt + outputs so far for every request the model runner did not
    see in the previous step (a resumed one, or one that skipped a step), and only under the V1 model runner
    (vLLM 0.32 sends the same; under V2 a resumed request comes as a ``NewRequestData`` instead).
    """

    req_ids: List[str] = field(default_factory=list)
    resumed_req_ids: Set[str] = field(default_factory=set)
    new_block_ids: List[List[int]] = field(default_factory=list)
    num_computed_tokens: List[int] = field(default_factory=list)
    all_token_ids: Dict[str, List[int]] = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    """One step's schedule.

    Attributes:
        scheduled_new_reqs: requests admitted from the waiting queue for the first time.
        scheduled_cached_reqs: running requests (prefill chunks and decodes) and resumed ones.
        num_scheduled_tokens: ``req_id -> tokens computed this step`` (a chunk size, or 1 for a decode).
        total_num_scheduled_tokens: their sum, never more than ``max_num_batched_tokens``.
        finished_req_ids: requests that finished or were aborted since the previous step (the runner drops
            their state).
        preempted_req_ids: requests preempted in this step, and those preempted since the last step by
            ``reset_prefix_cache(reset_running_requests=True)`` (they may be resumed in this same step).
        kv_connector_metadata: what the KV connector's worker side must do this step (or ``None``).
    """

    scheduled_new_reqs: List[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: Dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: Set[str]
    preempted_req_ids: Set[str]
    kv_connector_metadata: Optional[Any] = None

    @property
    def scheduled_req_ids(self) -> List[str]:
        return list(self.num_scheduled_tokens)


def block_updates(scheduler_output: "SchedulerOutput") -> Iterator[Tuple[str, List[int], bool, int]]:
    """The block-table changes of one ``SchedulerOutput``, request by request.

    Yields ``(req_id, block_ids, replace, num_computed_tokens)``: a new or resumed request's whole block list
    (``replace=True``: vLLM's ``add_row``), or the blocks a running request got this step (``replace=False``:
    ``append_row``), with the request's ``num_computed_tokens`` before the step. The model runner and the offload
    connector's scheduler side both keep block tables; both read them from here.
    """
    for new in scheduler_output.scheduled_new_reqs:
        yield new.req_id, list(new.block_ids), True, new.num_computed_tokens
    c = scheduler_output.scheduled_cached_reqs
    for rid, blocks, ncomp in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens):
        yield rid, list(blocks), rid in c.resumed_req_ids, ncomp
