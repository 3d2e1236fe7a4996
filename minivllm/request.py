"""A request's scheduler-side state (vLLM: ``vllm/v1/request.py``)."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Callable, List, Optional

from minivllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minivllm.core.block_hash import BlockHash


def is_partial_prefill(num_computed_tokens: int, num_tokens: int) -> bool:
    """Whether a request's step is a partial prefill: after it, fewer tokens are computed than the request has, so
    the logits row of its last scheduled token predicts a token that already exists, and is not sampled into the
    output.

    The one rule behind three places: the scheduler's ``Request.is_prefill_chunk`` (``num_tokens`` there counts
    output placeholders too; vLLM ``Scheduler._update_after_schedule``), and both model runners' discarded rows
    (``ModelRunnerBase._prepare_inputs``: ``seq_len < len(token_ids)``; vLLM's V1 runner builds its discard mask
    the same way, V2 its ``num_sampled`` from ``seq_len < prefill_len``).

    Args:
        num_computed_tokens: tokens computed once the step has run (the step's ``seq_len``).
        num_tokens: tokens the request has when the step is scheduled.
    """
    return num_computed_tokens < num_tokens


class RequestStatus(enum.IntEnum):
    """Where a request is in its life. Every status after ``PREEMPTED`` is a finished one (as in vLLM)."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: "RequestStatus") -> Optional[str]:
        """``"stop"``, ``"length"`` or ``"abort"``: the strings vLLM puts in ``CompletionOutput.finish_reason``."""
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH_CAPPED: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(status)


class Request:
    """One generation request as the scheduler sees it.

    The central counter is ``num_computed_tokens``: how many tokens of ``all_token_ids`` have their KV written
    (or being written in the step just scheduled). Each step the scheduler tries to let it catch up with
    ``num_tokens`` (prompt + output). There is no prefill or decode *phase*: a prefill chunk and a decode step
    are the same operation with a different number of new tokens.

    Attributes:
        prompt_token_ids: the prompt, ``list[int]``.
        output_token_ids: tokens generated so far (kept across preemption).
        all_token_ids: prompt + output.
        num_computed_tokens: tokens whose KV is in the cache (reset to 0 by preemption).
        num_cached_tokens: prompt tokens served by the prefix cache at first admission (-1 before it).
        num_preemptions: how many times this request was preempted.
        block_hashes: hashes of this request's full blocks, extended as tokens arrive (prefix caching).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: List[int],
        sampling_params: SamplingParams,
        arrival_time: Optional[float] = None,
        priority: int = 0,
        eos_token_id: Optional[int] = None,
        block_hasher: Optional[Callable[["Request"], List["BlockHash"]]] = None,
        prompt: Optional[str] = None,
        cache_salt: Optional[str] = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.max_tokens = sampling_params.max_tokens
        self.status = RequestStatus.WAITING
        self.stop_reason: Optional[object] = None

        self.output_token_ids: List[int] = []
        self.all_token_ids: List[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        self.num_external_computed_tokens = 0
        self.num_preemptions = 0

        # Async scheduling (vLLM ``request.py``, v0.32.0). ``num_computed_tokens`` runs ahead of the known tokens:
        # it counts the steps already scheduled, whose sampled tokens are not processed yet.
        # num_output_placeholders: tokens those steps will sample (one per scheduled non-prefill-chunk step).
        self.num_output_placeholders = 0
        # num_in_flight_tokens: tokens scheduled in steps whose output is not processed yet (sync: 0 at schedule).
        self.num_in_flight_tokens = 0
        # A request preempted with steps in flight: that output is "stale". It is still delivered (appended)
        # when it arrives, but must not touch the counters preemption reset; drop_stale_output discards it
        # instead (reset_prefix_cache, or a connector that must deliver its KV).
        self.num_stale_output_tokens = 0
        self.drop_stale_output = False
        # After this step's tokens, the request is still short of its known tokens (plus placeholders).
        self.is_prefill_chunk = False
        # Sequence number of the last step that scheduled it (deferred block frees, see Scheduler).
        self.last_sched_seq = 0

        self.block_hashes: List["BlockHash"] = []
        self._block_hasher = block_hasher
        if block_hasher is not None:
            self.block_hashes = block_hasher(self)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens, in tokens."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: List[int]) -> None:
        """Append sampled tokens and extend ``block_hashes`` over any block they completed."""
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> Optional[str]:
        return RequestStatus.get_finished_reason(self.status)

    def __lt__(self, other: "Request") -> bool:
        # Priority queue order (vLLM request.py): lower priority value first, then earlier arrival, then id.
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"computed={self.num_computed_tokens}, output={self.num_output_tokens})"
        )
