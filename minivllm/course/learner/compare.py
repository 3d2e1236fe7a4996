"""Run a learner's ``scheduler_cls`` and the reference ``Scheduler`` on the same workload, step by step, and name
the first difference: step, request, field, expected and actual side by side.

A workload is a scenario in the live vLLM check's format (``minivllm/bench/vllm_check/scenarios.json``): engine
settings, requests with their arrival step, prompt token ids and scripted output tokens. Both schedulers run in
the engine built by ``minivllm_replay.replay_scripted`` (the tiny random-weight model is built but never runs: the
output tokens are the scenario's script, as on vLLM's side of the check), so what is compared is exactly what the
live check compares with vLLM: each step's ``num_scheduled_tokens``, new / cached / resumed / preempted requests,
their prefix-cache hit at admission, the queues after ``schedule()``, the free blocks and each admitted request's
block table.
"""

from __future__ import annotations

import json
import random
import textwrap
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from minivllm.bench.vllm_check import minivllm_replay
from minivllm.bench.vllm_check.compare import STEP_FIELDS

# The fields of a step record compared here, in the order a learner reads them (what was scheduled first).
COMPARED_FIELDS = ("num_scheduled_tokens", "new", "resumed", "cached", "preempted", "num_computed_at_admission",
                   "waiting", "running", "num_free_blocks", "new_block_ids", "cached_new_block_ids", "finished")
assert set(COMPARED_FIELDS) - {"new_block_ids", "cached_new_block_ids"} <= set(STEP_FIELDS)

# What each compared field means, printed under a side-by-side step (the learner reads the grader's words).
FIELD_LEGEND = (
    "cached = running requests scheduled in this step (vLLM's CachedRequestData), not the prefix cache; "
    "num_computed_at_admission = tokens already computed (the prefix-cache hit) of each new or resumed request; "
    "new_block_ids = the block table sent for each new request; cached_new_block_ids = the blocks sent for each "
    "cached request: those allocated in this step, or a resumed request's whole table"
)


def workload(name: str, engine: Dict[str, Any], requests: Sequence[tuple], shows: str = "",
             extra_engine_kwargs: Optional[Dict[str, Any]] = None, shared_prefix: int = 0) -> Dict[str, Any]:
    """A scenario from short request tuples ``(id, prompt_len, max_tokens[, arrive_at_step])``.

    Prompts are distinct token ids per request (no two share a block) except for their first ``shared_prefix``
    tokens, which every request shares (for prefix-cache workloads). ``engine`` takes the scenario's keys
    (``block_size``, ``num_usable_blocks``, ``max_num_batched_tokens``, ``max_num_seqs``, ``max_model_len``,
    ``long_prefill_token_threshold``, ``enable_prefix_caching``); missing ones get the defaults below.
    ``extra_engine_kwargs`` go to the engine beyond them (``scheduler_reserve_full_isl``, ``enable_chunked_prefill``,
    ``scheduling_policy``, ``watermark``). The output tokens are scripted (never EOS), so every request runs to ``max_tokens``.
    """
    eng = dict(block_size=4, num_usable_blocks=32, max_num_batched_tokens=64, max_num_seqs=16, max_model_len=256,
               long_prefill_token_threshold=0, enable_prefix_caching=False)
    eng.update(engine)
    shared = [400 + j for j in range(shared_prefix)]
    reqs = []
    for i, r in enumerate(requests):
        rid, n, m = r[0], r[1], r[2]
        arrive = r[3] if len(r) > 3 else 0
        own = [3 + (37 * i + 11 * j) % 390 for j in range(max(0, n - shared_prefix))]
        reqs.append({"id": rid, "arrive_at_step": arrive, "prompt_token_ids": (shared + own)[:n],
                     "sampling": {"max_tokens": m, "ignore_eos": True, "temperature": 0.0},
                     "script": [5 + (i + k) % 300 for k in range(m)]})
    return {"name": name, "shows": shows, "engine": eng, "requests": reqs, "eos_token_id": 2,
            "extra_engine_kwargs": dict(extra_engine_kwargs or {})}


def random_workloads(seed: int, n: int, prefix_caching: Optional[bool] = None, chunked: bool = True,
                     tight_blocks: bool = True) -> List[Dict[str, Any]]:
    """``n`` random workloads (the hidden cases: the notebook never shows them), reproducible from ``seed``.

    Block size 4, 8 to 24 usable blocks when ``tight_blocks`` (so requests are preempted) else 64, budgets 8 to 48,
    ``max_num_seqs`` 2 to 6, 3 to 6 requests of 2 to 30 prompt tokens arriving over the first steps.
    """
    rng = random.Random(seed)
    out = []
    for k in range(n):
        bs = 4
        blocks = rng.randint(8, 24) if tight_blocks else 64
        budget = rng.choice([8, 12, 16, 24, 32, 48])
        seqs = rng.randint(2, 6)
        caching = rng.random() < 0.5 if prefix_caching is None else prefix_caching
        reqs = [(chr(ord("A") + i), rng.randint(2, 30), rng.randint(1, 12), rng.choice([0, 0, 1, 2, 4]))
                for i in range(rng.randint(3, 6))]
        limit = blocks * bs
        reqs = [(rid, min(n_, limit // 2), m, a) for rid, n_, m, a in reqs]
        thr = rng.choice([0, 0, 8]) if chunked else 0
        extra: Dict[str, Any] = {}
        if not chunked:
            # without chunking the engine requires a budget of at least max_model_len (SchedulerConfig.verify)
            extra["enable_chunked_prefill"] = False
            budget = limit
        if rng.random() < 0.3:
            extra["scheduler_reserve_full_isl"] = False
        out.append(workload(f"hidden {seed}.{k}", dict(block_size=bs, num_usable_blocks=blocks,
                                                       max_num_batched_tokens=budget, max_num_seqs=seqs,
                                                       max_model_len=limit, long_prefill_token_threshold=thr,
                                                       enable_prefix_caching=caching),
                            reqs, extra_engine_kwargs=extra, shared_prefix=8 if caching else 0))
    return out


def describe(w: Dict[str, Any]) -> str:
    """One line: the workload's settings and requests (``id: prompt+output@arrival``)."""
    e = {**w["engine"], **w.get("extra_engine_kwargs", {})}
    keys = ("block_size", "num_usable_blocks", "max_num_batched_tokens", "max_num_seqs",
            "long_prefill_token_threshold", "enable_prefix_caching", "scheduler_reserve_full_isl",
            "enable_chunked_prefill", "scheduling_policy", "watermark")
    kw = ", ".join(f"{k}={e[k]}" for k in keys if k in e)
    reqs = ", ".join(f"{r['id']}: {len(r['prompt_token_ids'])}+{r['sampling']['max_tokens']}"
                     f"@{r.get('arrive_at_step', 0)}" + (f" p{r['priority']}" if "priority" in r else "")
                     for r in w["requests"])
    return f"{w['name']!r} ({kw}; requests prompt+output@arrival step: {reqs})"


def run_steps(w: Dict[str, Any], scheduler_cls: Optional[type] = None, with_connector: bool = False,
              mode: str = "v1-sync-scripted") -> List[Dict[str, Any]]:
    """The step records of workload ``w`` run with ``scheduler_cls`` (``None``: the reference ``Scheduler``).

    Without ``with_connector`` the engine has no KV connector (the scheduling lessons 04-07 have none).
    Raises whatever the scheduler raises.
    """
    over: Dict[str, Any] = dict(w.get("extra_engine_kwargs", {}))
    if scheduler_cls is not None:
        over["scheduler_cls"] = scheduler_cls
    if not with_connector:
        over["kv_connector"] = None
    return minivllm_replay.replay_scripted(w, mode, engine_overrides=over)["steps"]


@dataclass
class Difference:
    """The first place where two runs differ.

    Attributes:
        step: index of the ``schedule()`` call (0-based).
        field: the step record's field (``COMPARED_FIELDS``), or ``"steps"`` when one run has more steps.
        request: the request id the difference is about, when there is one.
        expected, got: the field's value in the reference run and in the learner's.
    """

    step: int
    field: str
    request: Optional[str]
    expected: Any
    got: Any

    def format(self, expected_step: Optional[Dict[str, Any]] = None,
               got_step: Optional[Dict[str, Any]] = None) -> str:
        """The difference in words, then (given both step records) the whole step side by side."""
        who = f", request {self.request}" if self.request else ""
        lines = [f"first difference: step {self.step}, field {self.field}{who}",
                 f"    expected: {json.dumps(self.expected)}", f"    yours:    {json.dumps(self.got)}"]
        if expected_step is not None or got_step is not None:
            lines.append(f"  step {self.step} side by side:")
            lines.append(f"    {'field':<27}{'expected (reference)':<44}yours")
            for f in COMPARED_FIELDS:
                a = _view(expected_step, f)
                b = _view(got_step, f)
                mark = "≠ " if a != b else "  "
                lines.append(f"  {mark}{f:<27}{json.dumps(a):<44}{json.dumps(b)}")
            lines.append(textwrap.fill(FIELD_LEGEND, 116, initial_indent="  (", subsequent_indent="   ") + ")")
        return "\n".join(lines)


def _view(step: Optional[Dict[str, Any]], f: str) -> Any:
    if step is None:
        return "(no step)"
    if f == "new_block_ids":
        return {rid: [b for g in groups for b in g] for rid, groups in (step.get(f) or {}).items()}
    if f == "finished":
        return dict(sorted((step.get(f) or {}).items()))
    return step.get(f)


def first_difference(expected: List[Dict[str, Any]], got: List[Dict[str, Any]],
                     fields: Sequence[str] = COMPARED_FIELDS) -> Optional[Difference]:
    """The first differing step and field of two runs (``None`` when equal on ``fields``)."""
    for i in range(max(len(expected), len(got))):
        if i >= len(expected) or i >= len(got):
            return Difference(i, "steps", None, len(expected), len(got))
        for f in fields:
            a, b = _view(expected[i], f), _view(got[i], f)
            if a == b:
                continue
            return Difference(i, f, _request_of(a, b), a, b)
    return None


def _request_of(a: Any, b: Any) -> Optional[str]:
    """The first request id on which two values of a field disagree."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if a.get(k) != b.get(k):
                return str(k)
    if isinstance(a, list) and isinstance(b, list):
        for x, y in zip(a, b):
            if x != y:
                return str(x)
        longer = a if len(a) > len(b) else b
        if len(a) != len(b):
            return str(longer[min(len(a), len(b))])
    return None


def check_scheduler_part(part_name: str, cls: Any, methods: Sequence[str], workloads: Sequence[Dict[str, Any]],
                         hidden: Sequence[Dict[str, Any]] = (), fields: Sequence[str] = COMPARED_FIELDS,
                         with_connector: bool = False,
                         explain: Optional[Callable[[Difference, Optional[Dict[str, Any]],
                                                     Optional[Dict[str, Any]]], str]] = None) -> int:
    """The checker of a scheduler part: ``cls`` must be a ``Scheduler`` subclass that overrides ``methods`` and
    no other part's method, and schedule every workload exactly as the reference does.

    ``explain(difference, expected_step, your_step)``: a line on what the difference usually means for this part
    (empty when nothing fits), printed under it.

    Returns the number of workloads run. Raises ``parts.NotWritten`` while a method still raises
    ``NotImplementedError``, ``parts.PartFailed`` naming the workload and the first difference (or the exception
    the learner's code raised, with its step).
    """
    from minivllm.core.sched.scheduler import Scheduler
    from minivllm.course.learner.parts import NotWritten, PartFailed

    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        raise PartFailed(f"{part_name}: expected a subclass of Scheduler, got {cls!r}")
    base_names = {c for c in Scheduler.__mro__}
    own = {k for c in cls.__mro__ if c not in base_names for k, v in vars(c).items()
           if callable(v) and not k.startswith("__")}
    missing = [m for m in methods if m not in own]
    if missing:
        raise PartFailed(f"{part_name}: your class must define {', '.join(missing)} (it overrides {sorted(own)})")
    stray = sorted(m for m in own if m.startswith("_") and hasattr(Scheduler, m) and m not in methods)
    if stray:
        raise PartFailed(f"{part_name}: override only {', '.join(methods)}; your class also overrides "
                         f"{', '.join(stray)}, another part's method (your engine combines every lesson's class)")
    n = 0
    for w in list(workloads) + list(hidden):
        expected = run_steps(w, None, with_connector)
        try:
            got = run_steps(w, cls, with_connector)
        except NotImplementedError:
            raise NotWritten(f"{cls.__name__} still raises NotImplementedError") from None
        except Exception as e:  # noqa: BLE001 - the learner's error is reported with its workload
            raise PartFailed(f"{part_name}: your {cls.__name__} raised {type(e).__name__}: {e}{_explain(e)}\n"
                             f"  on workload {describe(w)}") from None
        d = first_difference(expected, got, fields)
        if d is not None:
            e_step = expected[d.step] if d.step < len(expected) else None
            g_step = got[d.step] if d.step < len(got) else None
            meaning = explain(d, e_step, g_step) if explain is not None else ""
            raise PartFailed(f"on workload {describe(w)}\n{d.format(e_step, g_step)}"
                             + (f"\n{meaning}" if meaning else ""))
        n += 1
    return n


def _explain(e: BaseException) -> str:
    """A sentence for an engine error that a learner's part causes elsewhere (the traceback ends in the engine's
    code, not in the learner's)."""
    frames = [f.name for f in traceback.extract_tb(e.__traceback__)]
    if isinstance(e, KeyError) and ("_make_cached_request_data" in frames or "_build_scheduler_output" in frames):
        return (f"\n  request {e.args[0]!r} was scheduled (it is in step.running_scheduled, step.new_reqs or "
                "step.resumed_reqs) but has no entry in step.new_block_ids: record the block ids sent for it")
    return ""
