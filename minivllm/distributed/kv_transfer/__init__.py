"""KV connectors: the seams through which an external KV store plugs into the scheduler and the model runner
(vLLM: ``vllm/distributed/kv_transfer/kv_connector/v1/``).

Files: ``base`` (the interface), ``kv_store`` (blocks by prefix hash in memory and on disk), ``offload_connector``
(a working connector), ``recording_connector`` (records every call into the engine trace), ``buggy_connector``
(the classic mistake, for notebook 08).
"""

from minivllm.distributed.kv_transfer.base import KVConnectorBase, KVConnectorMetadata
from minivllm.distributed.kv_transfer.buggy_connector import BuggyOffloadConnector
from minivllm.distributed.kv_transfer.kv_store import KVBlockStore
from minivllm.distributed.kv_transfer.offload_connector import (
    BlockTransfer, OffloadConnector, OffloadConnectorMetadata, OffloadStats,
)
from minivllm.distributed.kv_transfer.recording_connector import RecordingConnector, connector_rows, format_call

__all__ = [
    "KVConnectorBase", "KVConnectorMetadata", "KVBlockStore", "OffloadConnector", "OffloadConnectorMetadata",
    "OffloadStats", "BlockTransfer", "RecordingConnector", "BuggyOffloadConnector", "connector_rows", "format_call",
]
