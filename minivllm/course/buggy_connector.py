"""A deliberately wrong connector, for the course: it decides loads in the wrong place and never forgets them.

The mistake is the one learners make when they first write a connector (see notebook 08):

1. it records "this request needs a load" in ``get_num_new_matched_tokens``. That method is only a *question*;
   the scheduler asks it again every step a request waits, also when the request then gets no blocks;
2. its ``build_connector_meta`` emits every recorded load and never clears the record, although vLLM's contract
   says that calling it "will reset the state of the connector".

Symptom: from the first match on, the same request appears in every step's metadata, also while it cannot be
admitted and after it finished, and the worker copies the same blocks again and again. The fix is what
``OffloadConnector`` does: decide the load in ``update_state_after_alloc`` and clear the per-step record in
``build_connector_meta`` (vLLM ``example_connector.py``: ``_requests_need_load`` is filled in
``update_state_after_alloc`` and cleared at the end of ``build_connector_meta``).

It stands alone beside ``OffloadConnector``: both subclass ``OffloadConnectorBase`` (the store, the saves, the
worker side; no load decision), so a subclass of this class inherits the bug and nothing correct to borrow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

from minivllm.distributed.kv_transfer.offload_connector import (
    BlockTransfer, OffloadConnectorBase, OffloadConnectorMetadata,
)

if TYPE_CHECKING:
    from minivllm.core.kv_cache_utils import KVCacheBlock
    from minivllm.core.sched.output import SchedulerOutput
    from minivllm.request import Request


class BuggyOffloadConnector(OffloadConnectorBase):
    """An offload connector with the "needs load" bug (synchronous loads only; ``OffloadConnectorBase``'s
    arguments).

    Attributes:
        requests_need_load: ``req_id -> (request, first block, number of blocks)``, filled by
            ``get_num_new_matched_tokens`` and never emptied (the bug).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.requests_need_load: Dict[str, Tuple["Request", int, int]] = {}

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        first, end = self.matched_blocks(request, num_computed_tokens)
        if end > first:
            # BUG 1: load intent recorded at question time, before anyone knows whether blocks will exist.
            self.requests_need_load[request.request_id] = (request, first, end - first)
        return (end - first) * self.block_size, False

    def update_state_after_alloc(self, request: "Request", blocks: List["KVCacheBlock"], num_external_tokens: int) -> None:
        # Only bookkeeping here; the load was already "decided" in get_num_new_matched_tokens.
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> OffloadConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)  # this step's saves
        for rid, (request, first, num_blocks) in self.requests_need_load.items():
            ids = self._block_ids.get(rid, [])[first : first + num_blocks]  # [] while it has no blocks
            meta.loads.append(BlockTransfer(rid, ids, list(request.block_hashes[first : first + len(ids)])))
        # BUG 2: self.requests_need_load is never cleared, so every recorded request is emitted every step.
        return meta
