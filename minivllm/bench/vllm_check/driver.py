"""The one loop that drives a scenario, shared by the vLLM side and the minivllm side of the live check.

Standard library only: ``vllm_recorder.py`` imports this file inside the vLLM environment, and
``minivllm_replay.py`` imports it in the course's environment, so both engines are stepped by the same code and
recorded into the same step format. Each side supplies an *adapter* (see ``run_live`` / ``run_scripted``).

A step record (one per ``schedule()`` call) holds:

* ``num_scheduled_tokens``: ``{req_id: tokens}`` in the order of the ``SchedulerOutput``;
* ``new`` / ``cached`` / ``resumed``: ids in ``scheduled_new_reqs`` / ``scheduled_cached_reqs`` (minus resumed) /
  ``resumed_req_ids`` (Model Runner V2 hands a resumed request over as new, so under V2 it is in ``new``);
* ``num_computed_at_admission``: ``{req_id: num_computed_tokens}`` of every new or resumed request, i.e. its
  prefix-cache hit in tokens;
* ``preempted``: ids preempted in this ``schedule()``, in preemption order (the order they were pushed to the
  front of the waiting queue, so ``waiting`` lists the last victim first);
* ``finished_req_ids``: the ``SchedulerOutput``'s ``finished_req_ids`` (finished since the previous schedule);
* ``waiting`` / ``running``: queue order after ``schedule()``;
* ``num_free_blocks``: free blocks right after ``schedule()``, the engine's raw number (vLLM's pool holds one more
  block, its null block, which is never free; the scenarios give vLLM ``num_usable_blocks + 1`` blocks so the
  raw numbers are comparable);
* ``sampled``: ``{req_id: [tokens]}`` the model runner returned for this step (``[]`` for a partial prefill);
* ``finished``: ``{req_id: finish_reason}`` of requests that finished when this step's output was processed;
* ``connector_calls``: the KV-connector hook calls from this ``schedule()`` up to the next one, in order
  (the calls made once per layer, ``wait_for_layer_load`` and ``save_kv_layer``, as one record
  ``{"call": "layer_hooks", "per_layer": [hook names], "num_layers": N}``).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Dict, List, Optional

MAX_STEPS = 400  # every scenario ends in well under 100 steps; a runaway loop is a bug on one side


class StillRunning(RuntimeError):
    """A scenario still had unfinished requests after ``MAX_STEPS`` steps (a scheduler that never admits or never
    finishes a request). ``name`` and ``max_steps`` let a caller word the message in the learner's language."""

    def __init__(self, name: str, max_steps: int) -> None:
        super().__init__(f"{name}: still running after {max_steps} steps")
        self.name, self.max_steps = name, max_steps

LAYER_HOOKS = ("save_kv_layer", "wait_for_layer_load")
SCHEDULER_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                   "request_finished")


def _arrivals(scenario: Dict[str, Any], step: int, added: set) -> List[Dict[str, Any]]:
    out = []
    for spec in scenario["requests"]:
        if spec["id"] not in added and spec.get("arrive_at_step", 0) <= step:
            added.add(spec["id"])
            out.append(spec)
    return out


class StepLog:
    """Collects step records and slices the connector's event list between consecutive ``schedule()`` calls.

    Args:
        events: the list the recording connector appends to (shared with it); may be ``None`` without one.
    """

    def __init__(self, events: Optional[List[Dict[str, Any]]] = None) -> None:
        self.events = events if events is not None else []
        self.steps: List[Dict[str, Any]] = []
        self._marks: List[int] = []

    def mark_schedule_start(self) -> None:
        self._marks.append(len(self.events))

    def add(self, record: Dict[str, Any]) -> int:
        record = dict(record)
        record["step"] = len(self.steps)
        record.setdefault("sampled", {})
        record.setdefault("finished", {})
        self.steps.append(record)
        return record["step"]

    def finish(self) -> List[Dict[str, Any]]:
        """Attach each step's connector calls (events from its ``schedule()`` start to the next one's)."""
        bounds = self._marks + [len(self.events)]
        for i, rec in enumerate(self.steps):
            calls = []
            for ev in self.events[bounds[i]:bounds[i + 1]]:
                if ev.get("kind") != "connector":
                    continue
                if ev["call"] in LAYER_HOOKS:  # called once per layer: one record for the run of layers
                    if not calls or calls[-1]["call"] != "layer_hooks":
                        calls.append({"call": "layer_hooks", "side": ev["side"], "per_layer": [], "num_layers": 0})
                    rec_l = calls[-1]
                    if ev["call"] not in rec_l["per_layer"]:
                        rec_l["per_layer"].append(ev["call"])
                    if ev["call"] == "save_kv_layer":
                        rec_l["num_layers"] += 1
                    continue
                calls.append({k: v for k, v in ev.items() if k != "kind"})
            rec["connector_calls"] = calls
        return self.steps


def run_live(scenario: Dict[str, Any], add_request: Callable[[Dict[str, Any]], None], step: Callable[[], None],
             has_unfinished: Callable[[], bool]) -> int:
    """Step a real engine: before step ``n`` add the requests arriving at ``n``; stop when none is left.

    The adapter's ``step`` runs one engine step (schedule, forward pass, sampling, output processing); the
    adapter's ``schedule`` wrapper records the step. Returns the number of steps.
    """
    added: set = set()
    n = 0
    while len(added) < len(scenario["requests"]) or has_unfinished():
        for spec in _arrivals(scenario, n, added):
            add_request(spec)
        step()
        n += 1
        if n > MAX_STEPS:
            raise StillRunning(scenario["name"], MAX_STEPS)
    return n


class ScriptedSchedulerAdapter:
    """What both schedulers' adapters for ``run_scripted`` share: vLLM's and minivllm's ``Scheduler`` have the same
    ``schedule()`` / ``update_from_output()`` surface and ``ModelRunnerOutput`` fields, so only adding a request,
    asking whether any is unfinished, and which ``ModelRunnerOutput`` class to build differ (the subclasses).

    ``sched`` is the scheduler, instrumented to file its steps (and its finished requests) into the ``StepLog``.
    """

    sched: Any
    model_runner_output_cls: Any

    def schedule(self):
        return self.sched.schedule()

    def scheduled_ids(self, so) -> List[str]:
        return list(so.num_scheduled_tokens)

    def will_sample(self, rid: str) -> bool:
        # Right after schedule(): the step reaches the end of the known sequence (plus the output placeholders
        # of the steps before it under async scheduling), on either side.
        return not self.sched.requests[rid].is_prefill_chunk

    def make_output(self, so, sampled: Dict[str, List[int]]):
        ids = self.scheduled_ids(so)
        return self.model_runner_output_cls(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                            sampled_token_ids=[list(sampled[r]) for r in ids])

    def update(self, so, mro) -> None:
        self.sched.update_from_output(so, mro)
        return None  # the instrumented update_from_output has filed this step's finished requests


def run_scripted(scenario: Dict[str, Any], adapter: Any, depth: int, log: StepLog) -> None:
    """Drive a scheduler with hand-made model-runner outputs, as vLLM's scheduler unit tests do.

    ``depth`` 1 is synchronous scheduling (schedule, then process that step's output). ``depth`` 2 is async
    scheduling: step ``n + 1`` is scheduled before step ``n``'s output is processed (the pattern of vLLM's
    ``tests/v1/core/test_async_scheduler.py``: keep two ``SchedulerOutput``s in flight).

    The hand-made runner samples for a scheduled request exactly when its step reaches the end of its known
    sequence (``adapter.will_sample``: the scheduler's own ``request.is_prefill_chunk`` right after
    ``schedule()``), and returns the request's next scripted token (``spec["script"][k]`` for its ``k``-th
    sample; token 9 once the script is used up, which only a request scheduled past its stop can reach).

    Adapter methods: ``add_request(spec)``, ``schedule() -> so`` (recording into ``log``), ``will_sample(req_id)``,
    ``make_output(so, sampled: {req_id: [tok]}) -> model_runner_output``, ``update(so, mro) -> {req_id: reason}``,
    ``has_unfinished() -> bool``, ``scheduled_ids(so) -> [req_id]``.
    """
    specs = {s["id"]: s for s in scenario["requests"]}
    num_sampled = {rid: 0 for rid in specs}
    added: set = set()
    inflight: deque = deque()
    n = 0
    while True:
        while len(inflight) < depth and (len(added) < len(specs) or adapter.has_unfinished()):
            for spec in _arrivals(scenario, n, added):
                adapter.add_request(spec)
            so = adapter.schedule()
            sampled: Dict[str, List[int]] = {}
            for rid in adapter.scheduled_ids(so):
                if adapter.will_sample(rid):
                    k = num_sampled[rid]
                    script = specs[rid]["script"]
                    sampled[rid] = [script[k] if k < len(script) else 9]
                    num_sampled[rid] += 1
                else:
                    sampled[rid] = []
            log.steps[n]["sampled"] = sampled
            inflight.append((n, so, adapter.make_output(so, sampled)))
            n += 1
            if n > MAX_STEPS:
                raise StillRunning(scenario["name"], MAX_STEPS)
        if not inflight:
            break
        i, so, mro = inflight.popleft()
        finished = adapter.update(so, mro)
        if finished is not None:  # None: the adapter's own wrapper has filed this step's finished requests
            log.steps[i]["finished"] = finished
