"""A connector wrapper that records every call, so the engine trace shows what a connector saw, step by step.

``LLMEngine.step`` hands each step's calls to ``StepRecord.connector_calls`` (``take_step_calls``): the calls made
inside ``schedule()`` belong to the record of the step that schedule() starts. Calls made between two steps
(``request_finished`` of a request aborted with ``abort_request``) are filed under the next step.
vLLM has no such wrapper; its ``KVConnectorStats`` / ``KVConnectorLogging`` count transfers, not calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

from minivllm.distributed.kv_transfer.base import KVConnectorBase, KVConnectorMetadata
from minivllm.i18n import L_, N_

if TYPE_CHECKING:
    import torch

    from minivllm.core.kv_cache_utils import KVCacheBlock
    from minivllm.core.sched.output import SchedulerOutput
    from minivllm.request import Request

SCHEDULER_CALLS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "request_finished")
WORKER_CALLS = ("bind_connector_metadata", "start_load_kv", "save_kv_layer", "wait_for_save", "get_finished",
                "clear_connector_metadata")


# What each call is for, as notebook 08's table shows it: the first sentence of its KVConnectorBase docstring (the
# notebook reads the docstring; tests/course/test_i18n.py checks these are the same). Marked for the catalog, so
# that the Chinese edition shows the table in Chinese.
CALL_PURPOSE = {
    "get_num_new_matched_tokens": N_("How many prompt tokens *beyond* `num_computed_tokens` (the local prefix-cache hit) the external store can supply, and whether they are loaded asynchronously"),
    "update_state_after_alloc": N_("Blocks for `request` were allocated: `blocks` is its whole block table"),
    "build_connector_meta": N_("Once per `schedule()`: package this step's loads and saves and *reset the per-step state*"),
    "request_finished": N_("A request finished; its blocks are freed right after"),
    "bind_connector_metadata": N_("Before the step runs: hand this step's metadata (from `build_connector_meta`) to the worker side"),
    "start_load_kv": N_("Before the forward pass: copy this step's external KV into the paged cache"),
    "save_kv_layer": N_("After layer `layer_idx` wrote this step's K/V into `kv_cache`: save what the metadata asks for"),
    "wait_for_save": N_("Block until every save of this step is done (the blocks may be reused next step)"),
    "get_finished": N_("`(finished_sending, finished_recving)` request ids since the last call (async transfers).  `finished_recving` may name only requests in `WAITING_FOR_REMOTE_KVS` (or already finished ones); `finished_sending` only finished ones"),
    "clear_connector_metadata": N_("After the step: forget this step's metadata, so nothing acts on it twice"),
}


def _describe(meta: Any) -> Dict[str, Any]:
    return meta.describe() if isinstance(meta, KVConnectorMetadata) else {}


class RecordingConnector(KVConnectorBase):
    """Wraps a connector; forwards every call and appends a dict describing it to ``calls``.

    Each record has ``"call"`` (the method name), ``"side"`` (``"scheduler"`` or ``"worker"``), ``"step"``
    (set when the engine takes the step's calls) and the arguments that matter, as plain values:

    * ``get_num_new_matched_tokens``: ``req_id``, ``num_computed_tokens``, ``result`` ``(tokens, is_async)``;
    * ``update_state_after_alloc``: ``req_id``, ``block_ids`` (the whole block table), ``num_external_tokens``;
    * ``build_connector_meta``: ``new`` / ``cached`` / ``resumed`` request ids of the ``SchedulerOutput``,
      ``num_scheduled_tokens``, ``meta`` (the returned metadata's ``describe()``) and ``load_block_ids`` (the
      block ids of each synchronous load, for a metadata with ``loads`` such as ``OffloadConnectorMetadata``);
    * ``request_finished``: ``req_id``, ``block_ids``;
    * ``save_kv_layer``: ``layer``; ``get_finished``: ``finished_sending``, ``finished_recving`` (sorted lists).

    Attributes not defined here (``stats``, ``store``, ...) are read from the wrapped connector.

    Args:
        inner: the connector to wrap.
        record_layers: also record ``save_kv_layer`` (one record per layer per step).
    """

    def __init__(self, inner: KVConnectorBase, record_layers: bool = True) -> None:
        if not isinstance(inner, KVConnectorBase):
            raise ValueError(f"inner must be a KVConnectorBase, got {type(inner).__name__}")
        super().__init__()
        self.inner = inner
        self.record_layers = record_layers
        self.calls: List[Dict[str, Any]] = []
        self._pending: List[Dict[str, Any]] = []
        self._num_steps = 0

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes this wrapper lacks.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _rec(self, call: str, **info: Any) -> None:
        side = "scheduler" if call in SCHEDULER_CALLS else "worker"
        d = {"call": call, "side": side, "step": None, **info}
        self.calls.append(d)
        self._pending.append(d)

    def take_step_calls(self) -> List[Dict[str, Any]]:
        """The calls since the last take, stamped with the step index (the engine calls this once per step)."""
        out, self._pending = self._pending, []
        for d in out:
            d["step"] = self._num_steps
        self._num_steps += 1
        return out

    # ---- scheduler side -------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        result = self.inner.get_num_new_matched_tokens(request, num_computed_tokens)
        self._rec("get_num_new_matched_tokens", req_id=request.request_id, num_computed_tokens=num_computed_tokens,
                  result=tuple(result))
        return result

    def update_state_after_alloc(self, request: "Request", blocks: List["KVCacheBlock"], num_external_tokens: int) -> None:
        self._rec("update_state_after_alloc", req_id=request.request_id, block_ids=[b.block_id for b in blocks],
                  num_external_tokens=num_external_tokens)
        self.inner.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = self.inner.build_connector_meta(scheduler_output)
        c = scheduler_output.scheduled_cached_reqs
        self._rec(
            "build_connector_meta",
            new=[r.req_id for r in scheduler_output.scheduled_new_reqs],
            cached=[r for r in c.req_ids if r not in c.resumed_req_ids],
            resumed=[r for r in c.req_ids if r in c.resumed_req_ids],
            num_scheduled_tokens=dict(scheduler_output.num_scheduled_tokens),
            meta=_describe(meta),
            load_block_ids={t.req_id: list(t.block_ids) for t in getattr(meta, "loads", None) or []},
        )
        return meta

    def request_finished(self, request: "Request", block_ids: List[int]) -> Tuple[bool, Optional[dict]]:
        self._rec("request_finished", req_id=request.request_id, block_ids=list(block_ids))
        return self.inner.request_finished(request, block_ids)

    # ---- worker side ----------------------------------------------------------------------------------------
    def bind_connector_metadata(self, metadata: Optional[KVConnectorMetadata]) -> None:
        self._rec("bind_connector_metadata")
        self.inner.bind_connector_metadata(metadata)

    def clear_connector_metadata(self) -> None:
        self._rec("clear_connector_metadata")
        self.inner.clear_connector_metadata()

    def start_load_kv(self, kv_caches: List["torch.Tensor"]) -> None:
        self._rec("start_load_kv")
        self.inner.start_load_kv(kv_caches)

    def save_kv_layer(self, layer_idx: int, kv_cache: "torch.Tensor", attn_metadata: Any) -> None:
        if self.record_layers:
            self._rec("save_kv_layer", layer=layer_idx)
        self.inner.save_kv_layer(layer_idx, kv_cache, attn_metadata)

    def wait_for_save(self) -> None:
        self._rec("wait_for_save")
        self.inner.wait_for_save()

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        sending, recving = self.inner.get_finished(finished_req_ids)
        self._rec("get_finished", finished_sending=sorted(sending or ()), finished_recving=sorted(recving or ()))
        return sending, recving


# ---- tables -------------------------------------------------------------------------------------------------
_SHORT = {
    "get_num_new_matched_tokens": "match",
    "update_state_after_alloc": "alloc",
    "build_connector_meta": "meta",
    "request_finished": "finished",
    "bind_connector_metadata": "bind",
    "start_load_kv": "load",
    "save_kv_layer": "save_layer",
    "wait_for_save": "wait_save",
    "get_finished": "get_finished",
    "clear_connector_metadata": "clear",
}


def format_call(d: Dict[str, Any]) -> str:
    """One recorded call as a short string.

    Examples: ``match(A, 0)->(32, sync)`` (asked with 0 local tokens, the store has 32 more);
    ``alloc(A, ext=32)``; ``meta(new A=8)[load A:2 | save A:1]`` (the ``SchedulerOutput`` it saw, then what it
    emitted: blocks to load or save per request).
    """
    c = d["call"]
    if c == "get_num_new_matched_tokens":
        n, is_async = d["result"]
        return f"match({d['req_id']}, {d['num_computed_tokens']})->({n}, {'async' if is_async else 'sync'})"
    if c == "update_state_after_alloc":
        return f"alloc({d['req_id']}, ext={d['num_external_tokens']})"
    if c == "build_connector_meta":
        m = d["meta"]
        n = d["num_scheduled_tokens"]
        seen = [f"{kind} {r}={n[r]}" for kind in ("new", "cached", "resumed") for r in d[kind]]
        parts = []
        for key in ("load", "load_async", "save"):
            if m.get(key):
                parts.append(f"{key} " + " ".join(f"{r}:{n}" for r, n in m[key].items()))
        if m.get("in_flight"):
            parts.append("in_flight " + " ".join(m["in_flight"]))
        return "meta(" + ", ".join(seen) + ")[" + " | ".join(parts) + "]"
    if c == "request_finished":
        return f"finished({d['req_id']})"
    if c == "get_finished" and d["finished_recving"]:
        return f"get_finished->recving {' '.join(d['finished_recving'])}"
    return _SHORT[c]


def connector_rows(trace) -> List[Dict[str, Any]]:
    """One row per step of a ``SchedulerTrace``: the scheduler-side and worker-side calls, shortened.

    ``save_kv_layer`` records are folded into ``save_layer×N``.
    """
    rows = []
    for s in trace.steps:
        sched, worker = [], []
        layers = 0
        for d in s.connector_calls:
            if d["call"] == "save_kv_layer":
                layers += 1
                continue
            if d["call"] == "wait_for_save" and layers:
                worker.append(f"save_layer×{layers}")
                layers = 0
            (sched if d["side"] == "scheduler" else worker).append(format_call(d))
        rows.append({L_("step"): s.step, L_("scheduler side"): " · ".join(sched), L_("worker side"): " · ".join(worker)})
    return rows
