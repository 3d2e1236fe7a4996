"""The offload connector's per-step message from its scheduler side to its worker side (vLLM:
``vllm/v1/simple_kv_offload/metadata.py``; the ``KVConnectorMetadata`` of ``offload_connector``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List

from minivllm.core.kv_cache_utils import BlockHash
from minivllm.distributed.kv_transfer.base import KVConnectorMetadata


@dataclass
class BlockTransfer:
    """Blocks of one request to copy in one direction: ``block_ids[i]`` holds the block keyed ``block_hashes[i]``."""

    req_id: str
    block_ids: List[int]
    block_hashes: List[BlockHash]


@dataclass
class OffloadConnectorMetadata(KVConnectorMetadata):
    """One step's work for the worker side.

    Attributes:
        loads: copy store -> paged cache before this step's forward pass.
        async_loads: start copying now; the request waits in ``WAITING_FOR_REMOTE_KVS`` until ``get_finished``
            reports it.
        saves: copy paged cache -> store after each layer of this step's forward pass.
        loads_in_flight: requests whose asynchronous load has not been reported finished yet (information only).
    """

    loads: List[BlockTransfer] = field(default_factory=list)
    async_loads: List[BlockTransfer] = field(default_factory=list)
    saves: List[BlockTransfer] = field(default_factory=list)
    loads_in_flight: List[str] = field(default_factory=list)

    def describe(self) -> Dict[str, Any]:
        """``{"load": {req: blocks}, "load_async": {...}, "save": {...}, "in_flight": [req, ...]}``."""
        return {
            "load": {t.req_id: len(t.block_ids) for t in self.loads},
            "load_async": {t.req_id: len(t.block_ids) for t in self.async_loads},
            "save": {t.req_id: len(t.block_ids) for t in self.saves},
            "in_flight": list(self.loads_in_flight),
        }

    def req_ids(self) -> List[str]:
        """Every request this metadata asks the worker to do something for (load, save or wait on)."""
        ids: List[str] = []
        for t in self.loads + self.async_loads + self.saves:
            if t.req_id not in ids:
                ids.append(t.req_id)
        for r in self.loads_in_flight:
            if r not in ids:
                ids.append(r)
        return ids
