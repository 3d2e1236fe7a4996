"""A KV connector that offloads full KV blocks to CPU memory (optionally a disk folder) and loads them back.

Every full block a request computes is saved once, keyed by its prefix hash. A later request whose prompt starts
with the same blocks (or a preempted request whose device blocks were handed to someone else) loads them back
instead of recomputing them. Loads are block-aligned and never cover the last token of the sequence: its
logits are needed, so at least that token is always computed (as vLLM's ``ExampleConnector`` does).

Two classes: ``OffloadConnectorBase`` is everything but the load decision (the store, the saves, the
per-request bookkeeping, the whole worker side, which copies whatever the metadata lists); ``OffloadConnector``
adds the scheduler side's load decision (``get_num_new_matched_tokens``, ``update_state_after_alloc``,
``build_connector_meta``). vLLM splits its ``OffloadingConnector`` by role instead
(``OffloadingConnectorScheduler`` and ``OffloadingConnectorWorker``); minivllm splits off the load decision so
that notebook 08's exercise (write it) starts from a base that has none to borrow.

vLLM's counterparts: ``vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py``
(``OffloadingConnector``, CPU offloading keyed by block hashes) and ``example_connector.py``
(``ExampleConnector``, a disk store; the split of per-step state this file copies). The step's metadata is in
``offload_metadata.py``, the counters in ``offload_metrics.py``.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

import torch

from minivllm.core.kv_cache_utils import BlockHash
from minivllm.distributed.kv_transfer.base import KVConnectorBase
from minivllm.distributed.kv_transfer.kv_store import KVBlockStore
from minivllm.distributed.kv_transfer.offload_metadata import BlockTransfer, OffloadConnectorMetadata
from minivllm.distributed.kv_transfer.offload_metrics import OffloadStats
from minivllm.core.sched.output import block_updates

if TYPE_CHECKING:
    from minivllm.core.kv_cache_utils import KVCacheBlock
    from minivllm.core.sched.output import SchedulerOutput
    from minivllm.request import Request


def _add(d: Dict[str, int], key: str, n: int) -> None:
    d[key] = d.get(key, 0) + n


class OffloadConnectorBase(KVConnectorBase):
    """An offload connector without a load decision: it saves every full block once, keyed by its prefix hash,
    and its worker side copies whatever the step's metadata lists; it never decides a load itself.

    Given to a subclass (``OffloadConnector``, or notebook 08's ``FixedConnector``), which writes the load
    decision: ``get_num_new_matched_tokens`` (abstract here), and the loads added to ``update_state_after_alloc``
    and ``build_connector_meta``, whose versions here do only the bookkeeping and the saves:

    * ``update_state_after_alloc`` remembers the request and its block table (the saves need its block hashes
      and ids); a subclass calls it first.
    * ``build_connector_meta`` returns a metadata with this step's saves (the blocks that become full in this
      step and are not in the store yet) and no load; a subclass adds its loads and resets its own per-step state.
    * ``request_finished`` drops the request's records.
    * ``matched_blocks(request, num_computed_tokens)`` is the store lookup a subclass answers with.

    Args:
        block_size: the engine's ``block_size`` (checked against the KV cache at the first step).
        async_load_delay_steps: the worker reports an asynchronous load (``metadata.async_loads``) finished this
            many engine steps after it starts (>= 0). A fixed number of steps stands in for the transfer time, so
            runs are repeatable.
        disk_path: folder for a disk copy of every block (shared by engine instances); ``None``: memory only.
        cpu_capacity_blocks: blocks kept in memory at most (LRU); ``None``: unlimited.
        store: an existing ``KVBlockStore`` to share (then ``disk_path`` and ``cpu_capacity_blocks`` must be
            ``None``).

    Raises:
        ValueError: an invalid argument (see each one above).
    """

    def __init__(
        self,
        block_size: int = 16,
        async_load_delay_steps: int = 1,
        disk_path: Optional[str] = None,
        cpu_capacity_blocks: Optional[int] = None,
        store: Optional[KVBlockStore] = None,
    ) -> None:
        super().__init__()
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        if not isinstance(async_load_delay_steps, int) or async_load_delay_steps < 0:
            raise ValueError(f"async_load_delay_steps must be an int >= 0, got {async_load_delay_steps!r}")
        if store is not None and (disk_path is not None or cpu_capacity_blocks is not None):
            raise ValueError("pass either store or disk_path/cpu_capacity_blocks, not both")
        self.block_size = block_size
        self.async_load_delay_steps = async_load_delay_steps
        self.store = store if store is not None else KVBlockStore(disk_path, cpu_capacity_blocks)
        self.stats = OffloadStats()
        # scheduler side, per request (dropped in request_finished)
        self._requests: Dict[str, "Request"] = {}
        self._block_ids: Dict[str, List[int]] = {}
        # worker side
        self._kv_caches: Optional[List[torch.Tensor]] = None
        self._block_shape: Optional[Tuple[int, ...]] = None
        self._save_buffers: Dict[int, torch.Tensor] = {}
        self._inflight: Dict[str, Tuple[Future, int]] = {}
        self._worker_step = 0
        self._executor: Optional[ThreadPoolExecutor] = None

    # ---- scheduler side -------------------------------------------------------------------------------------
    def matched_blocks(self, request: "Request", num_computed_tokens: int) -> Tuple[int, int]:
        """``(first, end)``: the block indices ``first <= j < end`` of ``request`` that the store holds, after the
        ``num_computed_tokens`` a local prefix-cache hit gave. ``first == end`` when the store has none, or when
        ``num_computed_tokens`` is not a multiple of ``block_size`` (whole blocks only extend a block-aligned
        prefix). Never the block holding the last token: its logits must be computed. Records nothing."""
        if num_computed_tokens % self.block_size:
            return 0, 0
        first = num_computed_tokens // self.block_size
        limit = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))
        end = first
        while end < limit and self.store.contains(request.block_hashes[end]):
            end += 1
        return first, end

    def update_state_after_alloc(self, request: "Request", blocks: List["KVCacheBlock"], num_external_tokens: int) -> None:
        """Remember the request and its whole block table (the saves need them). Plans no load."""
        self._requests[request.request_id] = request
        self._block_ids[request.request_id] = [b.block_id for b in blocks]

    def _mirror_block_tables(self, so: "SchedulerOutput") -> Dict[str, int]:
        # Keep each request's block table as the model runner does (the same block_updates); returns
        # num_computed_tokens before the step.
        before: Dict[str, int] = {}
        for rid, blocks, replace, ncomp in block_updates(so):
            if replace:
                self._block_ids[rid] = blocks
            else:
                self._block_ids.setdefault(rid, []).extend(blocks)
            before[rid] = ncomp
        return before

    def _plan_saves(self, so: "SchedulerOutput", before: Dict[str, int]) -> List[BlockTransfer]:
        saves: List[BlockTransfer] = []
        planned: Set[BlockHash] = set()
        for rid, n in so.num_scheduled_tokens.items():
            request = self._requests.get(rid)
            if request is None:
                raise RuntimeError(
                    f"{type(self).__name__}.build_connector_meta: request {rid!r} is scheduled but the connector "
                    f"never saw its blocks: update_state_after_alloc must call "
                    f"super().update_state_after_alloc(request, blocks, num_external_tokens) (the bookkeeping the "
                    f"saves need)"
                )
            first = before[rid] // self.block_size
            end = min((before[rid] + n) // self.block_size, len(request.block_hashes))
            ids, hashes = [], []
            for j in range(first, end):  # blocks that become full in this step
                h = request.block_hashes[j]
                if h in planned or self.store.contains(h):
                    continue
                planned.add(h)
                ids.append(self._block_ids[rid][j])
                hashes.append(h)
            if ids:
                saves.append(BlockTransfer(rid, ids, hashes))
        return saves

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> OffloadConnectorMetadata:
        """A metadata with this step's saves and no load (a subclass adds its loads). Runs once per
        ``schedule()``, also when nothing was scheduled. Does not modify ``scheduler_output``.

        Raises:
            RuntimeError: a scheduled request that ``update_state_after_alloc`` never recorded.
        """
        meta = OffloadConnectorMetadata()
        before = self._mirror_block_tables(scheduler_output)
        meta.saves = self._plan_saves(scheduler_output, before)
        return meta

    def request_finished(self, request: "Request", block_ids: List[int]) -> Tuple[bool, Optional[dict]]:
        """Drop the request's state. An asynchronous load still running is waited for first: the blocks are
        freed right after this call and must not be written into once someone else owns them."""
        rid = request.request_id
        pending = self._inflight.pop(rid, None)
        if pending is not None:
            pending[0].result()
        self._requests.pop(rid, None)
        self._block_ids.pop(rid, None)
        return False, None

    # ---- worker side ----------------------------------------------------------------------------------------
    def _check_layout(self, kv_caches: List[torch.Tensor]) -> None:
        if self._kv_caches is kv_caches:
            return
        shape = tuple(kv_caches[0].shape)  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        if shape[2] != self.block_size:
            raise ValueError(
                f"OffloadConnector(block_size={self.block_size}) but the engine's KV cache has block_size={shape[2]}"
            )
        self._kv_caches = kv_caches
        self._block_shape = (len(kv_caches), 2) + shape[2:]

    def _fetch(self, transfer: BlockTransfer) -> List[Optional[torch.Tensor]]:
        # Memory hits are taken now, on the calling thread; disk-only blocks are read by whoever copies.
        return [self.store.get_cpu(h) for h in transfer.block_hashes]

    def _copy_in(self, transfer: BlockTransfer, blocks: List[Optional[torch.Tensor]]) -> None:
        caches = self._kv_caches
        dtype = caches[0].dtype
        full = [b if b is not None else self.store.read_disk(h, self._block_shape, dtype)
                for b, h in zip(blocks, transfer.block_hashes)]
        if not full:
            return
        x = torch.stack(full)  # [n, layers, 2, block_size, kv heads, head dim]
        ids = torch.tensor(transfer.block_ids, dtype=torch.long, device=caches[0].device)
        with torch.no_grad():
            for layer, cache in enumerate(caches):
                cache[:, ids] = x[:, layer].transpose(0, 1).to(cache.device)

    def start_load_kv(self, kv_caches: List[torch.Tensor]) -> None:
        """Copy this step's synchronous loads into ``kv_caches`` (one ``[2, num_blocks, block_size, kv_heads,
        head_dim]`` tensor per layer) and start the asynchronous ones on a background thread."""
        self._check_layout(kv_caches)
        meta = self._get_connector_metadata()
        if meta is None:
            return
        for t in meta.loads:
            self._copy_in(t, self._fetch(t))
            _add(self.stats.num_loads, t.req_id, 1)
            _add(self.stats.num_loaded_blocks, t.req_id, len(t.block_ids))
        for t in meta.async_loads:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minivllm-kv-load")
            future = self._executor.submit(self._copy_in, t, self._fetch(t))
            self._inflight[t.req_id] = (future, self._worker_step + self.async_load_delay_steps)
            _add(self.stats.num_loads, t.req_id, 1)
            _add(self.stats.num_loaded_blocks, t.req_id, len(t.block_ids))

    def save_kv_layer(self, layer_idx: int, kv_cache: torch.Tensor, attn_metadata: Any) -> None:
        """Copy this layer's part of every block to save to the CPU (the block may be reused after the step)."""
        meta = self._get_connector_metadata()
        if meta is None or not meta.saves:
            return
        ids = torch.tensor([i for t in meta.saves for i in t.block_ids], dtype=torch.long, device=kv_cache.device)
        self._save_buffers[layer_idx] = kv_cache[:, ids].to("cpu")  # [2, n, block_size, kv heads, head dim]

    def wait_for_save(self) -> None:
        """Put this step's saved blocks into the store, one ``[layers, 2, block_size, kv_heads, head_dim]``
        tensor per block hash."""
        meta = self._get_connector_metadata()
        if meta is None or not meta.saves:
            return
        num_layers = len(self._save_buffers)
        x = torch.stack([self._save_buffers[layer] for layer in range(num_layers)])  # [layers, 2, n, ...]
        self._save_buffers = {}
        i = 0
        for t in meta.saves:
            for h in t.block_hashes:
                self.store.put(h, x[:, :, i].clone())
                i += 1
            _add(self.stats.num_saved_blocks, t.req_id, len(t.block_ids))

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        """``(None, finished_recving)``: asynchronous loads due by this step, waited for and reported once."""
        done: Set[str] = set()
        for rid, (future, due) in list(self._inflight.items()):
            if due <= self._worker_step:
                future.result()  # re-raises a failed copy here, in the engine's thread
                del self._inflight[rid]
                done.add(rid)
        self._worker_step += 1
        return None, (done or None)


class OffloadConnector(OffloadConnectorBase):
    """Saves every full KV block once, keyed by its prefix hash, and loads matching prefixes back.

    Scheduler side (state kept per step is reset in ``build_connector_meta``; state kept per request is dropped
    in ``request_finished``); the saves, the bookkeeping and the worker side are ``OffloadConnectorBase``'s:

    * ``get_num_new_matched_tokens`` counts the blocks after the local prefix-cache hit that the store holds. It
      only *answers*: it is asked again every step a request waits, so it records nothing but this step's
      answer (``_lookups``, cleared every step).
    * ``update_state_after_alloc`` is where a load is decided: the blocks now exist, so the block ids are known.
    * ``build_connector_meta`` emits this step's loads and the saves of every block that becomes full in this
      step and is not in the store yet, then clears the per-step state.

    Worker side: ``start_load_kv`` copies store -> paged cache (or starts a background copy for asynchronous
    loads), ``save_kv_layer`` copies each layer's newly full blocks to the CPU, ``wait_for_save`` puts them in
    the store, ``get_finished`` reports asynchronous loads that completed.

    Args:
        load_mode: ``"sync"`` (load before the forward pass of the step that admits the request) or ``"async"``
            (the request waits in ``WAITING_FOR_REMOTE_KVS``; the copy runs on a background thread).
        block_size, async_load_delay_steps, disk_path, cpu_capacity_blocks, store: as ``OffloadConnectorBase``.

    Raises:
        ValueError: an invalid argument (``load_mode``, or one of the base's).
    """

    def __init__(
        self,
        block_size: int = 16,
        load_mode: str = "sync",
        async_load_delay_steps: int = 1,
        disk_path: Optional[str] = None,
        cpu_capacity_blocks: Optional[int] = None,
        store: Optional[KVBlockStore] = None,
    ) -> None:
        if load_mode not in ("sync", "async"):
            raise ValueError(f"load_mode must be 'sync' or 'async', got {load_mode!r}")
        super().__init__(block_size, async_load_delay_steps, disk_path, cpu_capacity_blocks, store)
        self.load_mode = load_mode
        # scheduler side, per step (cleared in build_connector_meta)
        self._lookups: Dict[str, Tuple[int, int]] = {}  # req -> (first, end) block index of this step's match
        self._reqs_to_load: Dict[str, Tuple[BlockTransfer, bool]] = {}
        # scheduler side, per request (dropped in request_finished)
        self._loading: Set[str] = set()
        self._reported_recving: Set[str] = set()

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        """Tokens after ``num_computed_tokens`` (the local prefix-cache hit) that the store can supply.

        Returns ``(tokens, is_async)``; ``tokens`` is a multiple of ``block_size``, ``is_async`` is True only for
        ``load_mode="async"`` and a non-zero match.
        """
        first, end = self.matched_blocks(request, num_computed_tokens)
        if num_computed_tokens % self.block_size == 0:
            self._lookups[request.request_id] = (first, end)
        n = (end - first) * self.block_size
        return n, n > 0 and self.load_mode == "async"

    def update_state_after_alloc(self, request: "Request", blocks: List["KVCacheBlock"], num_external_tokens: int) -> None:
        """Remember the request and its block table; if ``num_external_tokens > 0``, plan the load now.

        Raises:
            RuntimeError: ``num_external_tokens`` differs from what ``get_num_new_matched_tokens`` answered in
                this step (the scheduler and the connector disagree).
        """
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        rid = request.request_id
        lookup = self._lookups.pop(rid, None)
        if num_external_tokens == 0:
            return
        if lookup is None or (lookup[1] - lookup[0]) * self.block_size != num_external_tokens:
            raise RuntimeError(
                f"update_state_after_alloc({rid!r}, num_external_tokens={num_external_tokens}) does not match this "
                f"step's get_num_new_matched_tokens answer {lookup}"
            )
        first, end = lookup
        transfer = BlockTransfer(rid, self._block_ids[rid][first:end], list(request.block_hashes[first:end]))
        is_async = self.load_mode == "async"
        self._reqs_to_load[rid] = (transfer, is_async)
        if is_async:
            self._loading.add(rid)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> OffloadConnectorMetadata:
        """This step's loads (decided in ``update_state_after_alloc``) and saves; then reset the per-step state.

        Runs once per ``schedule()``, also when nothing was scheduled. Does not modify ``scheduler_output``.
        """
        meta = super().build_connector_meta(scheduler_output)
        for transfer, is_async in self._reqs_to_load.values():
            (meta.async_loads if is_async else meta.loads).append(transfer)
        self._loading -= self._reported_recving  # what the worker reported last step (vLLM: update_connector_output)
        self._reported_recving = set()
        meta.loads_in_flight = sorted(self._loading)
        self._reqs_to_load.clear()
        self._lookups.clear()
        return meta

    def request_finished(self, request: "Request", block_ids: List[int]) -> Tuple[bool, Optional[dict]]:
        """Drop the request's state, the load state included (see ``OffloadConnectorBase.request_finished``)."""
        super().request_finished(request, block_ids)
        rid = request.request_id
        for d in (self._lookups, self._reqs_to_load):
            d.pop(rid, None)
        self._loading.discard(rid)
        return False, None

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        """``(None, finished_recving)``: asynchronous loads due by this step, waited for and reported once."""
        sending, recving = super().get_finished(finished_req_ids)
        self._reported_recving |= recving or set()
        return sending, recving
