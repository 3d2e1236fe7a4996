"""The scheduler under async scheduling (vLLM: ``vllm/v1/core/sched/async_scheduler.py``, v0.32.0).

With async scheduling the engine schedules step N+1 *before* it processes step N's sampled tokens, so the
forward pass of N+1 can be queued while N's output travels back (the model runner feeds N's sampled tokens into
N+1 itself). The scheduler cannot know those tokens yet, so every scheduled step that will sample leaves an
*output placeholder* on its request: ``num_output_placeholders`` counts tokens that are sampled but not yet
appended, and ``num_computed_tokens`` already includes the position of each.

Consequences, all as in vLLM 0.32:

* a running request wants ``num_tokens + num_output_placeholders - num_computed_tokens`` tokens: 1 for a
  decode whose previous step is still in flight;
* a request that stops on EOS or a stop token in step N was already scheduled in step N+1: it appears once more
  in that ``SchedulerOutput`` (and in ``build_connector_meta``); its sampled token there is discarded because
  the request is finished when step N+1's output is processed;
* a request whose placeholders already reach ``max_tokens`` is not scheduled again (the check at the top of the
  running loop, ``Scheduler.schedule``), nor one at ``max_model_len`` (no position left for a sampled token);
* blocks whose last tokens were placeholders are hashed for the prefix cache when the tokens arrive.

Not carried over from vLLM: speculative decoding placeholders and the pipeline-parallel decode stagger
(minivllm has neither).
"""

from __future__ import annotations

from typing import List, Tuple

from minivllm.core.sched.output import SchedulerOutput
from minivllm.core.sched.scheduler import Scheduler
from minivllm.request import Request, RequestStatus


class AsyncScheduler(Scheduler):
    """``Scheduler`` with output placeholders; the engine keeps two steps in flight (see the module docstring).

    Args: as ``Scheduler``.
    """

    def _update_after_schedule(self, output: SchedulerOutput) -> None:
        super()._update_after_schedule(output)
        for req_id in output.num_scheduled_tokens:
            request = self.requests[req_id]
            if not request.is_prefill_chunk:
                request.num_output_placeholders += 1  # this step samples one token

    def _update_request_with_output(
        self, request: Request, new_token_ids: List[int], is_stale: bool = False
    ) -> Tuple[List[int], bool]:
        status_before = request.status
        kept, stopped = super()._update_request_with_output(request, new_token_ids)
        if not is_stale:
            # Preemption zeroed the placeholders; a stale delivery must not take them below zero.
            request.num_output_placeholders -= len(kept)
            assert request.num_output_placeholders >= 0, request
        if status_before == RequestStatus.RUNNING:
            # The new tokens may complete blocks whose hash could not be known when they were allocated.
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens - request.num_output_placeholders)
        return kept, stopped
