"""KV connectors: the seams through which an external KV store plugs into the scheduler and the model runner
(vLLM: ``vllm/distributed/kv_transfer/kv_connector/v1/``).

Files: ``base`` (the interface), ``kv_store`` (blocks by prefix hash in memory and on disk), ``offload_connector``
(``OffloadConnectorBase``: the store, the saves and the worker side; ``OffloadConnector``: with the load
decision, a working connector; its step metadata in ``offload_metadata``, its counters in ``offload_metrics``). The
course's connectors (``RecordingConnector``, which records every call into the engine trace, and
``BuggyOffloadConnector``, the classic mistake of notebook 08) live in ``minivllm.course``: the engine never
imports course code.
"""

from minivllm.distributed.kv_transfer.base import KVConnectorBase, KVConnectorMetadata
from minivllm.distributed.kv_transfer.kv_store import KVBlockStore
from minivllm.distributed.kv_transfer.offload_connector import OffloadConnector, OffloadConnectorBase
from minivllm.distributed.kv_transfer.offload_metadata import BlockTransfer, OffloadConnectorMetadata
from minivllm.distributed.kv_transfer.offload_metrics import OffloadStats

__all__ = [
    "KVConnectorBase", "KVConnectorMetadata", "KVBlockStore", "OffloadConnector", "OffloadConnectorBase", "OffloadConnectorMetadata",
    "OffloadStats", "BlockTransfer",
]
