"""The offload connector's transfer counters (vLLM: ``vllm/distributed/kv_transfer/kv_connector/v1/offloading/
metrics.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict


@dataclass
class OffloadStats:
    """Transfers per request id, counted on the worker side when the copy is done.

    Attributes:
        num_loads: load operations (one per admission that found blocks in the store).
        num_loaded_blocks: blocks copied store -> paged cache.
        num_saved_blocks: blocks copied paged cache -> store.
    """

    num_loads: Dict[str, int] = field(default_factory=dict)
    num_loaded_blocks: Dict[str, int] = field(default_factory=dict)
    num_saved_blocks: Dict[str, int] = field(default_factory=dict)

    def for_request(self, req_id: str) -> Dict[str, int]:
        """``{"loads": ..., "loaded_blocks": ..., "saved_blocks": ...}`` for one request (0 when none)."""
        return {
            "loads": self.num_loads.get(req_id, 0),
            "loaded_blocks": self.num_loaded_blocks.get(req_id, 0),
            "saved_blocks": self.num_saved_blocks.get(req_id, 0),
        }
