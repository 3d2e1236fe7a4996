"""Lesson 08's part: the fixed connector (``FixedConnector``), plugged into the engine as ``kv_connector=``.

The learner writes the load decision of an offload connector, the three scheduler-side methods that
``BuggyOffloadConnector`` gets wrong, on ``OffloadConnectorBase`` (the store, the saves, the bookkeeping and the
worker side; no load decision to inherit):

* ``get_num_new_matched_tokens`` answers (``self.matched_blocks``) and records no load: it is only a question,
  asked again every step a request waits;
* ``update_state_after_alloc`` records the load, once the blocks exist and only if ``num_external_tokens > 0``;
* ``build_connector_meta`` emits this step's loads next to the base's saves and clears the per-step records
  (vLLM 0.32 ``KVConnectorBase_V1.build_connector_meta``: "calling this function will reset the state of the
  connector"; ``ExampleConnector``,
  https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py#L85,
  fills ``_requests_need_load`` in ``update_state_after_alloc`` and clears it at the end of
  ``build_connector_meta``, L328 on).

minivllm differs from vLLM in one place here: vLLM has no base without a load decision (its
``OffloadingConnector`` splits by role, into ``OffloadingConnectorScheduler`` and ``OffloadingConnectorWorker``);
``OffloadConnectorBase`` exists so that the exercise starts from a base with no correct load decision to borrow.

The checker runs the learner's connector inside the engine (``TracedLLMEngine(kv_connector=...)``, tiny model, fp32,
greedy) on notebook 08's three scenarios and, with ``hidden=True``, on three it never shows, next to the reference
``OffloadConnector`` on the same workload and the same stored blocks, and compares step by step: what each
``get_num_new_matched_tokens`` answered, each ``update_state_after_alloc``, the tokens scheduled, the blocks each
metadata loads (block ids) and saves; then the worker's loads per request and every output token. The first
difference is named with its step, field and request, both steps side by side, and what that difference means.

The traps are closed: a class that subclasses ``OffloadConnector``, holds one of its functions, or calls its
load-decision methods at run time (``OffloadConnector.update_state_after_alloc(self, ...)``, an inner
``OffloadConnector``) fails as "not your fix"; a class that inherits ``BuggyOffloadConnector``'s methods, or
reaches them with ``super()``, gets the bug it reached named; an error in the learner's code is reported with
the scenario, the step and the learner's line, never as a bare ``KeyError``.
"""

from __future__ import annotations

import json
import traceback
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

from minivllm.i18n import ljust
from minivllm.course.learner.compare import display_name
from minivllm.course.learner.parts import NotWritten, Part, PartFailed, not_written_message, register
from minivllm.i18n import N_, _

LOAD_METHODS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta")
#: The fields of one step compared, in the order the engine produces them.
STEP_FIELDS = ("asked", "allocated", "scheduled", "loads", "async loads", "saves")

PROMPT = list(range(1, 41))
B_PROMPT = list(range(100, 112))

#: Notebook 08's scenarios (section 7): ``prefill`` runs first with an ``OffloadConnector`` to fill the store the
#: checked connector starts with; then ``prompts`` run with the checked connector (and, apart, the reference).
SCENARIOS: List[Dict[str, Any]] = [
    dict(name=N_("1: B shares two blocks with a saved prompt"), block_size=16,
         prefill=({"A": PROMPT}, 10), prompts={"B": PROMPT, "C": [7] * 20}, max_tokens=10, engine={}),
    dict(name=N_("2: B waits for blocks (8 blocks of 4)"), block_size=4,
         prefill=({"B": B_PROMPT}, 16), prompts={"A": list(range(1, 25)), "B": B_PROMPT}, max_tokens=4,
         engine=dict(num_gpu_blocks=8)),
    dict(name=N_("3: C is preempted twice (10 blocks of 4)"), block_size=4, prefill=None,
         prompts={r: list(range(20 * i + 1, 20 * i + 13)) for i, r in enumerate("ABC")}, max_tokens=16,
         engine=dict(num_gpu_blocks=10)),
]

_P = list(range(400, 440))
#: Scenarios the notebook never shows: chunked prefill of two requests loading different lengths of one stored
#: prefix in the same step, preemption without the local prefix cache (every resumption loads from the store),
#: and a request with a match that waits for blocks behind another one.
HIDDEN: List[Dict[str, Any]] = [
    dict(name=N_("hidden 1: two loads of one stored prefix, chunked prefill (budget 16, blocks of 8)"), block_size=8,
         prefill=({"P": _P}, 6), prompts={"X": _P[:32] + [9, 8, 7], "Y": _P[:20] + [3] * 6, "Z": list(range(60, 85))},
         max_tokens=6, engine=dict(max_num_batched_tokens=16)),
    dict(name=N_("hidden 2: preemptions without prefix caching (12 blocks of 4)"), block_size=4,
         prefill=({"P": _P[:20]}, 8), prompts={"A": _P[:16] + [1, 2], "B": list(range(200, 214)),
                                             "C": _P[:12] + [5, 5, 5]},
         max_tokens=14, engine=dict(num_gpu_blocks=12, enable_prefix_caching=False)),
    dict(name=N_("hidden 3: a match that waits behind a long prompt (9 blocks of 4)"), block_size=4,
         prefill=({"Q": list(range(300, 320))}, 4),
         prompts={"L": list(range(1, 29)), "M": list(range(300, 316)) + [4, 4]}, max_tokens=5,
         engine=dict(num_gpu_blocks=9)),
]

HINTS = (
    N_("get_num_new_matched_tokens is only a question: the scheduler asks it again every step a request waits, also "
    "when the request then gets no blocks. Where do you learn that the blocks exist, and when is a step's "
    "record no longer needed?"),
    N_("Keep this step's answer (first, end) from get_num_new_matched_tokens; in update_state_after_alloc, after the "
    "given bookkeeping and only if num_external_tokens > 0, record the load of blocks[first:end] (a BlockTransfer "
    "of their block ids and request.block_hashes[first:end]); in build_connector_meta add the recorded loads to "
    "the base's metadata (meta.loads), then clear both per-step records."),
    "first, end = self.matches[request.request_id]; self.requests_need_load[request.request_id] = BlockTransfer("
    "request.request_id, [b.block_id for b in blocks[first:end]], list(request.block_hashes[first:end])) -- and "
    "in build_connector_meta: meta.loads.extend(self.requests_need_load.values()); "
    "self.requests_need_load.clear(); self.matches.clear()",
)

#: The two bugs, in English (translated where printed).
BUG_1 = N_("bug 1: BuggyOffloadConnector.get_num_new_matched_tokens records the load when the question is asked, "
         "before anyone knows whether the request gets blocks in this step")
BUG_2 = N_("bug 2: BuggyOffloadConnector.build_connector_meta emits every recorded load and never clears the record, "
         "so a load is emitted again in every later step")


# ---- running a connector in the engine ------------------------------------------------------------------------
def _run(prompts: Dict[str, List[int]], max_tokens: int, connector: Any, block_size: int,
         engine: Dict[str, Any]) -> Tuple[Any, Dict[str, List[int]]]:
    from minivllm import SamplingParams
    from minivllm.course.trace import TracedLLMEngine

    kw = {"num_gpu_blocks": 64, **engine}
    eng = TracedLLMEngine("tiny", kv_connector=connector, block_size=block_size, **kw)
    for rid, prompt in prompts.items():
        eng.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    out = eng.run_to_completion(max_steps=400)
    return eng, {rid: list(o.outputs[0].token_ids) for rid, o in out.items()}


def _recorder(inner: Any) -> Any:
    """A ``RecordingConnector`` around ``inner`` (its ``build_connector_meta`` records carry the loads' block ids)."""
    from minivllm.course.recording_connector import RecordingConnector

    return RecordingConnector(inner, record_layers=False)


def _clone_store(store: Any) -> Any:
    from minivllm.distributed.kv_transfer import KVBlockStore

    s = KVBlockStore()
    s._cpu = OrderedDict(store._cpu)  # blocks are never written in place (put replaces), so sharing them is safe
    return s


def step_records(engine: Any) -> List[Dict[str, Any]]:
    """One dict per step of a run recorded with ``_recorder``: ``STEP_FIELDS`` as plain, comparable values."""
    out = []
    for s in engine.trace:
        calls = s.connector_calls
        meta: Dict[str, Any] = next((d for d in calls if d["call"] == "build_connector_meta"), {})
        out.append({
            "asked": [[d["req_id"], d["num_computed_tokens"], d["result"][0], bool(d["result"][1])]
                      for d in calls if d["call"] == "get_num_new_matched_tokens"],
            "allocated": [[d["req_id"], d["num_external_tokens"]] for d in calls
                          if d["call"] == "update_state_after_alloc"],
            "scheduled": dict(s.num_scheduled_tokens),
            "loads": dict(meta.get("load_block_ids", {})),
            "async loads": dict(meta.get("meta", {}).get("load_async", {})),
            "saves": dict(meta.get("meta", {}).get("save", {})),
            "waiting": list(s.waiting),
        })
    return out


_REFERENCE: Dict[str, Dict[str, Any]] = {}


def _reference(sc: Dict[str, Any]) -> Dict[str, Any]:
    """The stored blocks after the scenario's prefill run, and the reference connector's run (cached: both are
    deterministic)."""
    from minivllm.distributed.kv_transfer import KVBlockStore, OffloadConnector

    if sc["name"] not in _REFERENCE:
        store = KVBlockStore()
        if sc["prefill"] is not None:
            prompts, n = sc["prefill"]
            _run(prompts, n, OffloadConnector(sc["block_size"], store=store), sc["block_size"], {})
        ref = OffloadConnector(sc["block_size"], store=_clone_store(store))
        eng, out = _run(sc["prompts"], sc["max_tokens"], _recorder(ref), sc["block_size"], sc["engine"])
        _REFERENCE[sc["name"]] = {"store": store, "steps": step_records(eng), "out": out,
                                  "loads": dict(ref.stats.num_loads)}
    return _REFERENCE[sc["name"]]


# ---- the traps ------------------------------------------------------------------------------------------------
class _Borrowed(BaseException):
    """Raised by OffloadConnector's load-decision methods while the learner's connector runs (a BaseException, so
    that no ``except Exception`` in the learner's code swallows it)."""


@contextmanager
def _guard(reached: Set[str], borrowed: List[str]) -> Iterator[None]:
    """While the learner's connector runs: ``OffloadConnector``'s load-decision methods raise ``_Borrowed`` (and
    note it in ``borrowed``); ``BuggyOffloadConnector``'s run as usual and note themselves in ``reached``."""
    from minivllm.course.buggy_connector import BuggyOffloadConnector
    from minivllm.distributed.kv_transfer import OffloadConnector

    saved: List[Tuple[type, str, Any]] = []

    def refuse(name):
        def method(self, *args, **kwargs):
            borrowed.append(name)
            raise _Borrowed(name)
        return method

    def note(name, f):
        def method(self, *args, **kwargs):
            reached.add(name)
            return f(self, *args, **kwargs)
        return method

    for name in LOAD_METHODS:
        saved.append((OffloadConnector, name, OffloadConnector.__dict__[name]))
        setattr(OffloadConnector, name, refuse(name))
        saved.append((BuggyOffloadConnector, name, BuggyOffloadConnector.__dict__[name]))
        setattr(BuggyOffloadConnector, name, note(name, BuggyOffloadConnector.__dict__[name]))
    try:
        yield
    finally:
        for cls, name, f in saved:
            setattr(cls, name, f)


def _static_checks(cls: Any) -> None:
    """Refuse a class that is not the learner's own load decision, before anything runs."""
    from minivllm.course.buggy_connector import BuggyOffloadConnector
    from minivllm.distributed.kv_transfer import KVConnectorBase, OffloadConnector, OffloadConnectorBase

    name = getattr(cls, "__name__", repr(cls))
    if not isinstance(cls, type):
        raise PartFailed(_("fixed_connector: FixedConnector must be a class (a subclass of OffloadConnectorBase), "
                           "got {value}").format(value=repr(cls)))
    if cls is BuggyOffloadConnector:
        raise PartFailed(_("fixed_connector: this is BuggyOffloadConnector itself, with {bug_1}, and {bug_2}. Write "
                           "FixedConnector on OffloadConnectorBase.").format(bug_1=_(BUG_1), bug_2=_(BUG_2)))
    if issubclass(cls, OffloadConnector):
        raise PartFailed(_(
            "fixed_connector: {name} subclasses OffloadConnector, the package's working connector: it inherits the "
            "load decision instead of fixing it. Subclass OffloadConnectorBase (the store, the saves and the worker "
            "side, no load decision) and write the three methods yourself.").format(name=name))
    if not issubclass(cls, KVConnectorBase) or not issubclass(cls, OffloadConnectorBase):
        raise PartFailed(_("fixed_connector: {name} must subclass OffloadConnectorBase (from "
                           "minivllm.distributed.kv_transfer), got the bases {bases}").format(
            name=name, bases=[b.__name__ for b in cls.__mro__[1:]]))
    theirs = {f.__code__: n for n, f in vars(OffloadConnector).items() if hasattr(f, "__code__")}
    given = (OffloadConnectorBase, KVConnectorBase, BuggyOffloadConnector, object)
    for klass in cls.__mro__:
        if klass in given:
            continue
        for attr, f in vars(klass).items():
            code = getattr(getattr(f, "__func__", f), "__code__", None)
            if code in theirs:
                raise PartFailed(_(
                    "fixed_connector: {name}.{attr} is OffloadConnector.{method}, the package's working code, not "
                    "your fix: write it yourself.").format(name=name, attr=attr, method=theirs[code]))
    for m in LOAD_METHODS:
        owner = next(k for k in cls.__mro__ if m in vars(k))
        if owner is BuggyOffloadConnector and m != "update_state_after_alloc":
            bug = BUG_1 if m == "get_num_new_matched_tokens" else BUG_2
            raise PartFailed(_("fixed_connector: {name} inherits {method} from BuggyOffloadConnector, so it keeps "
                               "{bug}. Define {method} in {name}.").format(name=name, method=m, bug=_(bug)))


def _learner_line(tb: Any, cls: type) -> str:
    """``file, line N, in method: code`` of the deepest frame of the learner's code in a traceback."""
    frames = traceback.extract_tb(tb)
    codes = set()
    for klass in cls.__mro__:
        for f in vars(klass).values():
            c = getattr(getattr(f, "__func__", f), "__code__", None)
            if c is not None:
                codes.add((c.co_filename, c.co_name))
    mine = [fr for fr in frames if (fr.filename, fr.name) in codes and "/minivllm/" not in fr.filename]
    if not mine:
        mine = [fr for fr in frames if "/minivllm/" not in fr.filename and "site-packages" not in fr.filename]
    if not mine:
        return ""
    fr = mine[-1]
    code = f": {fr.line.strip()}" if fr.line and fr.line.strip() else ""
    return "\n" + _("  in your code: {file}, line {line}, in {function}{code}").format(
        file=fr.filename, line=fr.lineno, function=fr.name, code=code)


def _reached_note(reached: Set[str]) -> str:
    if not reached:
        return ""
    lines = []
    if "get_num_new_matched_tokens" in reached:
        lines.append(_("your class reached BuggyOffloadConnector.get_num_new_matched_tokens (through super()): "
                       "{bug}").format(bug=_(BUG_1)))
    if "build_connector_meta" in reached:
        lines.append(_("your class reached BuggyOffloadConnector.build_connector_meta (through super()): {bug} "
                       "unless your code clears requests_need_load after it").format(bug=_(BUG_2)))
    return "".join("\n  " + _("note: {text}").format(text=x) for x in lines)


# ---- comparing ------------------------------------------------------------------------------------------------
def _first_difference(expected: List[Dict[str, Any]], got: List[Dict[str, Any]]) -> Optional[Tuple[int, str]]:
    for k in range(max(len(expected), len(got))):
        if k >= len(expected) or k >= len(got):
            return k, "steps"
        for f in STEP_FIELDS:
            if expected[k][f] != got[k][f]:
                return k, f
    return None


def _request_of(a: Any, b: Any) -> Optional[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return next((str(r) for r in list(a) + list(b) if a.get(r) != b.get(r)), None)
    if isinstance(a, list) and isinstance(b, list):
        for x, y in zip(a, b):
            if x != y:
                return str((x or y)[0])
        longer = a if len(a) > len(b) else b
        if len(a) != len(b):
            return str(longer[min(len(a), len(b))][0])
    return None


def _why(field: str, rid: Optional[str], k: int, expected: List[Dict[str, Any]],
         got: List[Dict[str, Any]]) -> str:
    """What a difference in ``field`` at step ``k`` about request ``rid`` means, in the lesson's words."""
    if field == "steps":
        return _("the run took a different number of steps: an earlier load or answer changed what was scheduled")
    e, g = expected[k], got[k]
    if field == "asked":
        return _("get_num_new_matched_tokens answered differently: count the blocks the store holds from block "
                "num_computed_tokens // block_size on (self.matched_blocks(request, num_computed_tokens)), "
                "synchronously (is_async False)")
    if field == "allocated":
        return _("update_state_after_alloc was called differently: an earlier answer of yours changed the schedule")
    if field == "scheduled":
        return _("the scheduler gave different tokens: an earlier answer of yours changed what it admitted")
    if field in ("loads", "async loads") and rid is not None:
        allocated_now = [r for r, n in g["allocated"] if r == rid]
        ext_now = [n for r, n in g["allocated"] if r == rid]
        if rid in g[field] and rid not in e[field]:
            earlier = [j for j in range(k) if rid in got[j]["loads"]]
            if not allocated_now:
                where = _("its load was already emitted in step {step}: the record was not cleared "
                          "(build_connector_meta must reset the per-step state)").format(step=earlier[-1]) if earlier \
                    else _("it got no blocks in this step (it is still waiting): the load was recorded when the "
                           "question was asked, not in update_state_after_alloc")
                return _("your metadata loads {request} in step {step}, but {where}").format(request=rid, step=k,
                                                                                             where=where)
            if ext_now and ext_now[0] == 0:
                return _("update_state_after_alloc({request}, num_external_tokens=0) was called in this step: record "
                         "a load only if num_external_tokens > 0").format(request=rid)
            return _("your metadata loads {request} in step {step} where the reference loads nothing").format(
                request=rid, step=k)
        if rid in e[field] and rid not in g[field]:
            return _("update_state_after_alloc({request}, num_external_tokens={n}) was called in this step, but your "
                     "metadata has no load of {request}: record the load there and emit it in this step's "
                     "build_connector_meta").format(request=rid, n=ext_now[0] if ext_now else "?")
        return _("the load of {request} goes into other blocks: the blocks to fill are blocks[first:end] of the "
                 "block table update_state_after_alloc receives (this step's, not an older one), with first = "
                 "num_computed_tokens // block_size").format(request=rid)
    if field == "saves":
        return _("the saves differ: they are OffloadConnectorBase's (meta = super().build_connector_meta(...)), keep "
                "that call, and call super().update_state_after_alloc(...) for the bookkeeping they need")
    return ""


def _side_by_side(k: int, expected: List[Dict[str, Any]], got: List[Dict[str, Any]]) -> str:
    lines = [_("  step {step} side by side:").format(step=k),
             "    " + ljust(_("field"), 14) + ljust(_("expected (OffloadConnector)"), 48) + _("yours")]
    for f in STEP_FIELDS:
        a = expected[k][f] if k < len(expected) else "(no step)"
        b = got[k][f] if k < len(got) else "(no step)"
        mark = "≠ " if a != b else "  "
        lines.append(f"  {mark}{f:<14}{json.dumps(a):<48}{json.dumps(b)}")
    return "\n".join(lines)


def _run_learner(cls: type, sc: Dict[str, Any], ref: Dict[str, Any]) -> Tuple[Any, Any, Dict[str, List[int]]]:
    """Build the learner's connector on a copy of the scenario's stored blocks and run it in the engine; errors
    come back as ``NotWritten`` or ``PartFailed`` with the scenario, the step and the learner's line."""
    name = cls.__name__
    reached: Set[str] = set()
    borrowed: List[str] = []
    try:
        conn = cls(sc["block_size"], store=_clone_store(ref["store"]))
    except NotImplementedError:
        raise NotWritten(not_written_message(f"{name}.__init__")) from None
    except Exception as e:  # noqa: BLE001 - reported with the arguments the checker used
        raise PartFailed(_("fixed_connector: {name}({block_size}, store=...) raised {error}: {message} (the checker "
                           "builds it as OffloadConnectorBase is built: block_size, then store=)").format(
            name=name, block_size=sc["block_size"], error=type(e).__name__, message=e)) from None
    rec = _recorder(conn)
    eng = None
    try:
        with _guard(reached, borrowed):
            from minivllm import SamplingParams
            from minivllm.course.trace import TracedLLMEngine

            eng = TracedLLMEngine("tiny", kv_connector=rec, block_size=sc["block_size"],
                                  **{"num_gpu_blocks": 64, **sc["engine"]})
            for rid, prompt in sc["prompts"].items():
                eng.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=sc["max_tokens"],
                                                            ignore_eos=True))
            res = eng.run_to_completion(max_steps=len(ref["steps"]) + 50)
    except _Borrowed as e:
        raise PartFailed(_(
            "fixed_connector: your {name} called OffloadConnector.{method} (the package's working connector) while it "
            "ran, in scenario {scenario}: that borrows the fix instead of writing it. Write {methods} on "
            "OffloadConnectorBase's helpers (self.matched_blocks, super().update_state_after_alloc, "
            "super().build_connector_meta).").format(name=name, method=e,
                                                     scenario=repr(display_name(sc["name"])),
                                                     methods=", ".join(LOAD_METHODS))) from None
    except NotImplementedError:
        raise NotWritten(not_written_message(name)) from None
    except Exception as e:  # noqa: BLE001 - the learner's error, reported with its scenario, step and line
        step = len(eng.trace) if eng is not None else 0
        if eng is not None:  # a difference in the steps before the error is its cause: name that first
            _raise_difference(sc, ref["steps"], step_records(eng), reached, complete=False,
                              then=_("then your {name} raised {error} in step {step}: {message}").format(
                                  name=name, error=type(e).__name__, step=step, message=e))
        explain = ""
        if isinstance(e, KeyError):
            explain = "\n" + _("  a KeyError on {key}: a record your method expects for that request is not there "
                               "(never made in this step, or already cleared or popped)").format(key=e)
        raise PartFailed(_("fixed_connector: your {name} raised {error}: {message}").format(
            name=name, error=type(e).__name__, message=e) + "\n"
            + _("  in scenario {scenario}, step {step}").format(scenario=repr(display_name(sc["name"])), step=step)
            + f"{_learner_line(e.__traceback__, cls)}{explain}{_reached_note(reached)}") from None
    if borrowed:  # raised inside, and swallowed by the learner's code
        raise PartFailed(_("fixed_connector: your {name} called OffloadConnector.{method} (the package's working "
                           "connector): that borrows the fix instead of writing it.").format(name=name,
                                                                                            method=borrowed[0]))
    out = {rid: list(o.outputs[0].token_ids) for rid, o in res.items()}
    return conn, (eng, reached), out


def _raise_difference(sc: Dict[str, Any], expected: List[Dict[str, Any]], got: List[Dict[str, Any]],
                      reached: Set[str], complete: bool = True, then: str = "") -> None:
    """Raise ``PartFailed`` naming the first differing step and field of two runs, if there is one. With
    ``complete=False`` (the learner's run stopped early) only the steps both runs have are compared."""
    if not complete:
        expected, got = expected[:len(got)], got[:len(expected)]
    d = _first_difference(expected, got)
    if d is None:
        return
    k, f = d
    a = expected[k][f] if k < len(expected) and f != "steps" else len(expected)
    b = got[k][f] if k < len(got) and f != "steps" else len(got)
    rid = _request_of(a, b)
    if rid:
        first = _("first difference: step {step}, field {field}, request {request}").format(step=k, field=f,
                                                                                         request=rid)
    else:
        first = _("first difference: step {step}, field {field}").format(step=k, field=f)
    raise PartFailed(
        _("on scenario {scenario}").format(scenario=repr(display_name(sc["name"]))) + "\n" + first + "\n"
        + _("    expected: {value}").format(value=json.dumps(a)) + "\n"
        + _("    yours:    {value}").format(value=json.dumps(b)) + "\n"
        + _("  what it means: {meaning}").format(meaning=_why(f, rid, k, expected, got))
        + f"{_reached_note(reached)}\n{_side_by_side(k, expected, got)}" + (f"\n  ({then})" if then else ""))


def check_fixed_connector(cls: Any, hidden: bool = True) -> int:
    """The checker of part ``fixed_connector`` (see the module docstring). Returns the scenarios run.

    Raises:
        NotWritten: a method still raises ``NotImplementedError``.
        PartFailed: the class is not the learner's own load decision (``OffloadConnector`` subclassed or called,
            a ``BuggyOffloadConnector`` method inherited), raised an error (scenario, step, line), or differs from
            the reference connector (scenario, step, field, request, both steps side by side, what it means).
    """
    _static_checks(cls)
    n = 0
    for sc in SCENARIOS + (HIDDEN if hidden else []):
        ref = _reference(sc)
        conn, (eng, reached), out = _run_learner(cls, sc, ref)
        _raise_difference(sc, ref["steps"], step_records(eng), reached)
        head = _("on scenario {scenario}").format(scenario=repr(display_name(sc["name"])))
        loads = dict(conn.stats.num_loads)
        if loads != ref["loads"]:
            raise PartFailed(f"{head}\n" + _("the worker's loads per request differ: expected {expected}, yours "
                                               "{got}").format(expected=ref["loads"], got=loads)
                             + _reached_note(reached))
        for rid in sorted(ref["out"]):
            if out.get(rid) != ref["out"][rid]:
                i = next((j for j, (x, y) in enumerate(zip(out.get(rid, []), ref["out"][rid])) if x != y), None)
                raise PartFailed(f"{head}\n" + _("request {request}'s output differs from output token {i} on: a load "
                                                   "wrote into blocks that hold another request's KV").format(
                    request=rid, i=i) + _reached_note(reached))
        n += 1
    return n


def _reference_connector() -> type:
    from minivllm.distributed.kv_transfer import OffloadConnector

    return OffloadConnector


register(Part(
    name="fixed_connector", lesson="08", symbol="FixedConnector", kind="connector",
    seam="kv_connector=: get_num_new_matched_tokens, update_state_after_alloc, build_connector_meta",
    writes=N_("the load decision: ask, record at alloc, emit and clear"),
    check=check_fixed_connector, hints=HINTS, reference=_reference_connector(),
))


def engine_kwargs(chosen: Dict[str, Any]) -> Dict[str, Any]:
    """``your_engine``'s hook: the chosen connector class (the learner's ``FixedConnector`` or the reference
    ``OffloadConnector``), built for the engine's block size and plugged in as ``kv_connector``; saves and loads go
    to CPU memory."""
    cls = chosen.get("fixed_connector")
    if cls is None:
        return {}
    return {"kv_connector": cls(block_size=YOUR_ENGINE_BLOCK_SIZE), "block_size": YOUR_ENGINE_BLOCK_SIZE}


YOUR_ENGINE_BLOCK_SIZE = 16  # the engine's default block size (EngineArgs.block_size)
