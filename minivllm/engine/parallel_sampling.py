"""``n > 1``: one request fanned out into ``n`` child requests (vLLM: ``vllm/v1/engine/parallel_sampling.py``).

As in vLLM, the fan-out happens in the front end: the engine core and the model runner only ever see ordinary
``n == 1`` requests. Child ``i`` is named ``f"{i}_{parent_id}"`` and, when the parent has a ``seed``, gets
``seed + i`` (``ParentRequest._get_child_sampling_params``); without a seed every child shares one copy of the
parameters. The ``OutputProcessor`` gathers the children's ``CompletionOutput``s (``ParentRequest.get_outputs``):
each carries its ``index``; with ``FINAL_ONLY`` one output with all ``n`` comes when the last child finishes.

Where minivllm differs from vLLM: with ``CUMULATIVE`` and ``DELTA`` vLLM's outputs carry the one child that
changed, also the last one; minivllm's last output (``finished=True``) carries all ``n`` completions, sorted by
index, so that ``LLM.generate`` and ``run_to_completion`` (which keep each request's final output) return them all.
"""

from __future__ import annotations

from copy import copy
from typing import Dict, List, Optional, Set, Tuple

from minivllm.outputs import CompletionOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["ParentRequest"]


class ParentRequest:
    """The parent of ``n`` child requests (vLLM ``ParentRequest``).

    Args:
        request_id: the caller's id (outputs carry it).
        sampling_params: the caller's parameters, ``n > 1``.
    """

    def __init__(self, request_id: str, sampling_params: SamplingParams) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.child_requests: Set[str] = set()
        self.child_ids: List[str] = []
        self.latest: Dict[int, CompletionOutput] = {}
        self._cached_child_params: Optional[SamplingParams] = None

    @property
    def n(self) -> int:
        return self.sampling_params.n

    def _get_child_sampling_params(self, index: int) -> SamplingParams:
        if self._cached_child_params is not None:
            return self._cached_child_params
        child = copy(self.sampling_params)
        child.n = 1
        if self.sampling_params.seed is None:
            self._cached_child_params = child
        else:
            child.seed = self.sampling_params.seed + index
        return child

    def get_child_info(self, index: int) -> Tuple[str, SamplingParams]:
        """``(f"{index}_{parent id}", the child's SamplingParams)`` (vLLM ``get_child_info``)."""
        child_id = f"{index}_{self.request_id}"
        self.child_requests.add(child_id)
        self.child_ids.append(child_id)
        return child_id, self._get_child_sampling_params(index)

    def get_outputs(self, child_id: str, completion: CompletionOutput) -> Tuple[List[CompletionOutput], bool]:
        """The completions the parent's output carries now, and whether every child has finished."""
        already_returned = False
        if completion.finished():
            if child_id in self.child_requests:
                self.child_requests.remove(child_id)
            else:
                already_returned = True
        self.latest[completion.index] = completion
        finished = not self.child_requests
        kind = self.sampling_params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY or (finished and kind == RequestOutputKind.CUMULATIVE):
            if self.child_requests:
                return [], False
            return [self.latest[i] for i in sorted(self.latest)], finished
        return ([] if already_returned else [completion]), finished
