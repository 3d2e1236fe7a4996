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
import re
import textwrap
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from minivllm.bench.vllm_check import minivllm_replay
from minivllm.bench.vllm_check.compare import STEP_FIELDS
from minivllm.bench.vllm_check.driver import StillRunning
from minivllm.i18n import N_, _, ljust, text_width

# The fields of a step record compared here, in the order a learner reads them (what was scheduled first).
COMPARED_FIELDS = ("num_scheduled_tokens", "new", "resumed", "cached", "preempted", "num_computed_at_admission",
                   "waiting", "running", "num_free_blocks", "new_block_ids", "cached_new_block_ids", "finished")
assert set(COMPARED_FIELDS) - {"new_block_ids", "cached_new_block_ids"} <= set(STEP_FIELDS)

# What each compared field means, printed under a side-by-side step (the learner reads the grader's words; English
# here, translated where printed).
FIELD_LEGEND = N_(
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


_HIDDEN_NAME = re.compile(r"^hidden( priority)? (\d+)\.(\d+)$")
_STEP_NAME = re.compile(r"^(.*), step (\d+)$")


def display_name(name: str) -> str:
    """A workload's or case's ``name`` as the learner reads it, in the current language.

    The name stays the key (English, what the tests and the caches compare); only what is printed is translated:
    a name marked with ``N_`` where it is defined is looked up in the catalog, ``"hidden 606.3"`` and
    ``"hidden priority 608.1"`` (the random workloads) and ``"<case>, step N"`` (``flattened_batch``'s recorded
    steps) are rebuilt from their translated patterns. An unknown name is returned unchanged.
    """
    m = _STEP_NAME.match(name)
    if m:
        return _("{case}, step {step}").format(case=display_name(m.group(1)), step=m.group(2))
    m = _HIDDEN_NAME.match(name)
    if m:
        pattern = _("hidden priority {seed}.{k}") if m.group(1) else _("hidden {seed}.{k}")
        return pattern.format(seed=m.group(2), k=m.group(3))
    return _(name) if name else name  # gettext("") would return the catalog's header


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
    return _("{name} ({settings}; requests prompt+output@arrival step: {requests})").format(
        name=repr(display_name(w["name"])), settings=kw, requests=reqs)


def run_steps(w: Dict[str, Any], scheduler_cls: Optional[type] = None, with_connector: bool = False,
              mode: str = "v1-sync-scripted") -> List[Dict[str, Any]]:
    """The step records of workload ``w`` run with ``scheduler_cls`` (``None``: the reference ``Scheduler``).

    Without ``with_connector`` the engine has no KV connector (the scheduling lessons 04-07 have none).
    Raises whatever the scheduler raises, and ``RuntimeError`` (the replay's ``driver.StillRunning``, reworded in
    the learner's language) when requests are still unfinished after ``driver.MAX_STEPS`` steps.
    """
    over: Dict[str, Any] = dict(w.get("extra_engine_kwargs", {}))
    if scheduler_cls is not None:
        over["scheduler_cls"] = scheduler_cls
    if not with_connector:
        over["kv_connector"] = None
    try:
        return minivllm_replay.replay_scripted(w, mode, engine_overrides=over)["steps"]
    except StillRunning as e:
        message = _("{name}: still running after {n} steps").format(name=_(e.name), n=e.max_steps)
        raise RuntimeError(message) from None


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
        if self.request:
            head = _("first difference: step {step}, field {field}, request {request}").format(
                step=self.step, field=self.field, request=self.request)
        else:
            head = _("first difference: step {step}, field {field}").format(step=self.step, field=self.field)
        lines = [head, _("    expected: {value}").format(value=json.dumps(self.expected)),
                 _("    yours:    {value}").format(value=json.dumps(self.got))]
        if expected_step is not None or got_step is not None:
            lines.append(_("  step {step} side by side:").format(step=self.step))
            lines.append("    " + ljust(_("field"), 27) + ljust(_("expected (reference)"), 44) + _("yours"))
            for f in COMPARED_FIELDS:
                a = _view(expected_step, f)
                b = _view(got_step, f)
                mark = "≠ " if a != b else "  "
                lines.append(f"  {mark}{f:<27}{json.dumps(a):<44}{json.dumps(b)}")
            lines.append(_fill(_(FIELD_LEGEND), 116, "  (", "   ") + ")")
        return "\n".join(lines)


def _fill(text: str, width: int, initial_indent: str, subsequent_indent: str) -> str:
    """``textwrap.fill`` for English text; for text with wide (Chinese) characters, lines of at most ``width``
    columns (a Chinese character counts two) that break between Chinese characters or at spaces, never inside
    an English word or a code name."""
    if text.isascii():
        return textwrap.fill(text, width, initial_indent=initial_indent, subsequent_indent=subsequent_indent)
    tokens = re.findall(r"[\x21-\x7e]+|\s+|.", text)  # ASCII words whole, runs of spaces, one character otherwise
    lines: List[str] = []
    line = initial_indent
    for tok in tokens:
        if line.strip() and text_width(line) + text_width(tok) > width:
            lines.append(line.rstrip())
            line = subsequent_indent
            if tok.isspace():
                continue
        line += tok
    lines.append(line.rstrip())
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
    from minivllm.course.learner.parts import NotWritten, PartFailed, not_written_message

    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        raise PartFailed(_("{part}: expected a subclass of Scheduler, got {value}").format(part=part_name,
                                                                                          value=repr(cls)))
    base_names = {c for c in Scheduler.__mro__}
    own = {k for c in cls.__mro__ if c not in base_names for k, v in vars(c).items()
           if callable(v) and not k.startswith("__")}
    missing = [m for m in methods if m not in own]
    if missing:
        raise PartFailed(_("{part}: your class must define {missing} (it overrides {own})").format(
            part=part_name, missing=", ".join(missing), own=sorted(own)))
    stray = sorted(m for m in own if m.startswith("_") and hasattr(Scheduler, m) and m not in methods)
    if stray:
        raise PartFailed(_("{part}: override only {methods}; your class also overrides {stray}, another part's "
                           "method (your engine combines every lesson's class)").format(
            part=part_name, methods=", ".join(methods), stray=", ".join(stray)))
    n = 0
    for w in list(workloads) + list(hidden):
        expected = run_steps(w, None, with_connector)
        try:
            got = run_steps(w, cls, with_connector)
        except NotImplementedError:
            raise NotWritten(not_written_message(cls.__name__)) from None
        except Exception as e:  # noqa: BLE001 - the learner's error is reported with its workload
            raise PartFailed(_("{part}: your {cls} raised {error}: {message}").format(
                part=part_name, cls=cls.__name__, error=type(e).__name__, message=e) + _explain(e) + "\n"
                + _("  on workload {workload}").format(workload=describe(w))) from None
        d = first_difference(expected, got, fields)
        if d is not None:
            e_step = expected[d.step] if d.step < len(expected) else None
            g_step = got[d.step] if d.step < len(got) else None
            meaning = explain(d, e_step, g_step) if explain is not None else ""
            raise PartFailed(_("on workload {workload}").format(workload=describe(w)) + f"\n{d.format(e_step, g_step)}"
                             + (f"\n{meaning}" if meaning else ""))
        n += 1
    return n


def _explain(e: BaseException) -> str:
    """A sentence for an engine error that a learner's part causes elsewhere (the traceback ends in the engine's
    code, not in the learner's)."""
    frames = [f.name for f in traceback.extract_tb(e.__traceback__)]
    if isinstance(e, KeyError) and ("_make_cached_request_data" in frames or "_build_scheduler_output" in frames):
        return "\n" + _("  request {request} was scheduled (it is in step.running_scheduled, step.new_reqs or "
                        "step.resumed_reqs) but has no entry in step.new_block_ids: record the block ids sent for "
                        "it").format(request=repr(e.args[0]))
    return ""
