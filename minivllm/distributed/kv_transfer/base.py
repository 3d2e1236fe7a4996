"""The KV connector interface (vLLM: ``vllm/distributed/kv_transfer/kv_connector/v1/base.py``).

A connector lets an external KV store plug into the engine at two places. The *scheduler side* answers "how many
more prompt tokens can you supply?" and records what must be loaded or saved; the *worker side* moves the bytes
around the forward pass. vLLM runs them in different processes as two instances with different roles; minivllm
uses one object for both roles, and keeps the method split and names so vLLM connectors read the same.

Per scheduler step the engine calls, in this order:

* scheduler side, for each waiting request reached by the waiting loop with ``num_computed_tokens == 0``:
  ``get_num_new_matched_tokens``; then, only if ``allocate_slots`` succeeded, ``update_state_after_alloc``;
* scheduler side, once per ``schedule()`` call, even when nothing was scheduled: ``build_connector_meta``;
* worker side: ``bind_connector_metadata``, ``start_load_kv`` (before the forward pass), ``save_kv_layer`` (after
  each layer), ``wait_for_save``, ``get_finished``, ``clear_connector_metadata``;
* scheduler side, when a request finishes (before its blocks are freed): ``request_finished``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, List, Optional, Set, Tuple

if TYPE_CHECKING:
    import torch

    from minivllm.core.kv_cache_utils import KVCacheBlock
    from minivllm.core.sched.output import SchedulerOutput
    from minivllm.request import Request


class KVConnectorMetadata:
    """Base class of the per-step message from the scheduler side to the worker side."""

    def describe(self) -> dict:
        """A small JSON-like summary (request ids, block counts) for traces and tables; empty by default."""
        return {}


class KVConnectorBase(ABC):
    """Abstract KV connector with vLLM's V1 method names."""

    def __init__(self) -> None:
        self._connector_metadata: Optional[KVConnectorMetadata] = None

    # ---- scheduler side -------------------------------------------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        """How many prompt tokens *beyond* ``num_computed_tokens`` (the local prefix-cache hit) the external store
        can supply, and whether they are loaded asynchronously. ``(None, False)`` means "ask me again next step".
        Called again every step while the request waits, so it must not record load intent."""

    @abstractmethod
    def update_state_after_alloc(self, request: "Request", blocks: List["KVCacheBlock"], num_external_tokens: int) -> None:
        """Blocks for ``request`` were allocated: ``blocks`` is its whole block table. Record what to load here."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        """Once per ``schedule()``: package this step's loads and saves and *reset the per-step state*."""

    def request_finished(self, request: "Request", block_ids: List[int]) -> Tuple[bool, Optional[dict]]:
        """A request finished; its blocks are freed right after. Returns ``(delay_free, params)``.

        minivllm frees the blocks right after this call whatever ``delay_free`` says (vLLM would keep them until
        ``get_finished`` reports the transfer in ``finished_sending`` or ``finished_recving``): a connector must
        finish or cancel any transfer into or out of them before it returns. A later report for this request is
        then dropped by the scheduler; a report for a live request that is not waiting for one raises there.
        """
        return False, None

    @property
    def is_kv_consumer(self) -> bool:
        """Whether this connector may load KV into blocks (vLLM: ``KVTransferConfig.is_kv_consumer``, True for the
        roles ``kv_consumer`` and ``kv_both``). minivllm's connector plays both roles, so True by default. Under
        async scheduling it makes the scheduler defer block frees (see ``Scheduler``)."""
        return True

    @property
    def requires_kv_delivery(self) -> bool:
        """Whether a request preempted with a step in flight must drop that step's output rather than deliver it
        (vLLM: ``KVConnectorBase_V1.requires_kv_delivery``, default: the producer role, True for ``kv_both``).
        A connector that hands nothing off may return False."""
        return True

    # ---- worker side ----------------------------------------------------------------------------------------
    def bind_connector_metadata(self, metadata: Optional[KVConnectorMetadata]) -> None:
        """Before the step runs: hand this step's metadata (from ``build_connector_meta``) to the worker side."""
        self._connector_metadata = metadata

    def clear_connector_metadata(self) -> None:
        """After the step: forget this step's metadata, so nothing acts on it twice."""
        self._connector_metadata = None

    def _get_connector_metadata(self) -> Optional[KVConnectorMetadata]:
        return self._connector_metadata

    @abstractmethod
    def start_load_kv(self, kv_caches: List["torch.Tensor"]) -> None:
        """Before the forward pass: copy this step's external KV into the paged cache."""

    def save_kv_layer(self, layer_idx: int, kv_cache: "torch.Tensor", attn_metadata: Any) -> None:
        """After layer ``layer_idx`` wrote this step's K/V into ``kv_cache``: save what the metadata asks for."""

    def wait_for_save(self) -> None:
        """Block until every save of this step is done (the blocks may be reused next step)."""

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        """``(finished_sending, finished_recving)`` request ids since the last call (async transfers).

        ``finished_recving`` may name only requests in ``WAITING_FOR_REMOTE_KVS`` (or already finished ones);
        ``finished_sending`` only finished ones. Anything else makes ``Scheduler.update_from_output`` raise a
        ``RuntimeError`` (vLLM asserts), see ``Scheduler._check_kv_xfer_reports``.
        """
        return None, None
