"""A KV connector for *real vLLM* that records every hook call and does nothing else.

Runs only inside the vLLM environment (``.venv-vllm``): vLLM imports it by name through
``KVTransferConfig(kv_connector="RecordingKVConnector", kv_connector_module_path="vllm_recording_connector")``
(the directory of this file is put on ``sys.path`` by ``vllm_recorder.py``). vLLM builds two instances, one per
role (scheduler side, worker side); with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` both live in the recorder's process
and append to the module-level ``EVENTS`` list, interleaved with the step markers the recorder adds, so the list is
the true order of the calls.

The connector never has anything to load (``get_num_new_matched_tokens`` returns ``(0, False)``) and never
delays a free, so it leaves vLLM's schedule as it would be without a connector, apart from the calls themselves.
The interface is vLLM 0.32.0's ``KVConnectorBase_V1``
(``vllm/distributed/kv_transfer/kv_connector/v1/base.py``). minivllm is never imported here.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

EVENTS: List[Dict[str, Any]] = []


class RecordingMetadata(KVConnectorMetadata):
    """Empty per-step metadata (the scheduler side has nothing to tell the worker side)."""


def _block_ids(blocks: Any) -> List[List[int]]:
    try:
        return [list(g) for g in blocks.get_block_ids()]
    except Exception:  # noqa: BLE001 - only a description for the log
        return []


class RecordingKVConnector(KVConnectorBase_V1):
    """Appends ``{"call": name, "side": "scheduler"|"worker", ...}`` to ``EVENTS`` for each hook vLLM calls."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._side = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"

    @property
    def requires_kv_delivery(self) -> bool:
        # Nothing is handed off, so a preemption need not drop in-flight output (vLLM's default ties this to
        # kv_role; the recording must not change what vLLM does without a connector).
        return False

    def _rec(self, call: str, **info: Any) -> None:
        EVENTS.append({"kind": "connector", "call": call, "side": self._side, **info})

    # ---- scheduler side -------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        self._rec("get_num_new_matched_tokens", req_id=request.request_id, num_computed_tokens=num_computed_tokens)
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._rec("update_state_after_alloc", req_id=request.request_id, block_ids=_block_ids(blocks),
                  num_external_tokens=num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        c = scheduler_output.scheduled_cached_reqs
        resumed = set(getattr(c, "resumed_req_ids", ()) or ())
        self._rec(
            "build_connector_meta",
            new=[r.req_id for r in scheduler_output.scheduled_new_reqs],
            cached=[r for r in c.req_ids if r not in resumed],
            resumed=[r for r in c.req_ids if r in resumed],
            num_scheduled_tokens=dict(scheduler_output.num_scheduled_tokens),
        )
        return RecordingMetadata()

    def request_finished(self, request, block_ids: List[int]):
        self._rec("request_finished", req_id=request.request_id, block_ids=[int(b) for b in block_ids])
        return False, None

    def update_connector_output(self, connector_output) -> None:
        self._rec("update_connector_output")

    # ---- worker side ----------------------------------------------------------------------------------------
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._rec("bind_connector_metadata")
        super().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        self._rec("clear_connector_metadata")
        super().clear_connector_metadata()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._rec("handle_preemptions")

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self._rec("start_load_kv")

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._rec("wait_for_layer_load", layer=layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        self._rec("save_kv_layer", layer=layer_name)

    def wait_for_save(self) -> None:
        self._rec("wait_for_save")

    def get_finished(self, finished_req_ids: set) -> tuple:
        self._rec("get_finished", finished_req_ids=sorted(finished_req_ids))
        return None, None

    def build_connector_worker_meta(self) -> Optional[Any]:
        self._rec("build_connector_worker_meta")
        return None
