"""Lesson 05's parts (notebook ``05_chunked_prefill.ipynb``; see ``minivllm.course.learner.parts``).

* ``chunk_sizing`` (kind ``"scheduler"``): a ``Scheduler`` subclass, ``ChunkSizing``, that overrides the three
  methods deciding how many tokens a request computes in a step: ``_long_prefill_token_threshold`` (the step's
  cap, with vLLM 0.32's lone-request rule), ``_num_new_tokens_running`` (a running request's chunk or decode token)
  and ``_num_new_tokens_waiting`` (a waiting request's first chunk, ``None`` when chunked prefill is off and it
  does not fit). Checked step by step against the reference ``Scheduler`` (``compare.check_scheduler_part``) on
  the notebook's workloads and on hidden ones (thresholds, chunked prefill off, a lone request, resumed requests
  with output tokens, prefix-cache hits).
* ``flattened_batch`` (kind ``"runner"``): a function, ``flatten_batch``, that builds one step's flattened batch
  as the model runner's ``_prepare_inputs`` does (vLLM ``GPUModelRunner._prepare_inputs``): ``query_start_loc``,
  ``positions``, ``slot_mapping`` and ``logits_indices``. Checked against the runner's own batches, recorded from
  engine runs (``TracedLLMEngine(record_inputs=True)``), then run inside the engine by ``use_flatten_batch``, an
  instance hook on the engine's model runner (the engine itself imports nothing of the course).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from minivllm.course.learner import compare
from minivllm.course.learner.parts import NotWritten, Part, PartFailed, not_written_message, register
from minivllm.i18n import N_, _
from minivllm.core.sched.scheduler import Scheduler

# ---------------------------------------------------------------------------------------------------------------
# Part 1: chunk sizing


class ReferenceChunkSizing(Scheduler):
    """The reference for ``chunk_sizing``: the package's ``Scheduler`` itself (overrides nothing)."""


CHUNK_SIZING_METHODS = ("_long_prefill_token_threshold", "_num_new_tokens_running", "_num_new_tokens_waiting")


def chunk_sizing_workloads() -> List[Dict[str, Any]]:
    """The notebook's workloads for ``chunk_sizing`` (the notebook prints them with ``compare.describe``).

    1. One 160-token prompt at a budget of 64 (section 2's schedule, block size 16): chunks 64, 64, 32.
    2. The same prompt with a second request beside it and ``long_prefill_token_threshold=48`` (section 2's cap).
    3. Two decoders and a 90-token prompt arriving at step 2, budget 32 (section 7 in small).
    """
    return [
        compare.workload(N_("160 at 64, alone"), dict(block_size=16, num_usable_blocks=64, max_num_batched_tokens=64,
                                                  max_model_len=512), [("A", 160, 3)]),
        compare.workload(N_("threshold 48 with a neighbour"),
                         dict(block_size=16, num_usable_blocks=64, max_num_batched_tokens=64, max_model_len=512,
                              long_prefill_token_threshold=48), [("A", 160, 2), ("B", 20, 2)]),
        compare.workload(N_("two decoders and a late prompt"),
                         dict(block_size=4, num_usable_blocks=64, max_num_batched_tokens=32, max_model_len=256),
                         [("A", 6, 12), ("B", 5, 12), ("C", 90, 3, 2)]),
    ]


def chunk_sizing_hidden() -> List[Dict[str, Any]]:
    """Workloads the notebook never shows: the lone-request rule with a threshold, chunked prefill off (a prompt
    that waits for a step whose budget it fits), resumed requests that recompute their output tokens, a
    prefix-cache hit before the first chunk, a cap under tight blocks, and random ones."""
    hand = [
        compare.workload(N_("hidden: lone request under a threshold"),
                         dict(block_size=4, num_usable_blocks=64, max_num_batched_tokens=32,
                              long_prefill_token_threshold=8), [("A", 40, 2), ("B", 12, 2, 9)]),
        compare.workload(N_("hidden: chunked prefill off, a prompt waits for the budget"),
                         dict(block_size=4, num_usable_blocks=64, max_num_batched_tokens=40, max_model_len=40),
                         [("A", 10, 6), ("B", 12, 6), ("C", 36, 2, 1), ("D", 4, 2, 1)],
                         extra_engine_kwargs={"enable_chunked_prefill": False}),
        compare.workload(N_("hidden: resumed requests recompute their outputs"),
                         dict(block_size=4, num_usable_blocks=10, max_num_batched_tokens=6, max_num_seqs=4,
                              long_prefill_token_threshold=4), [("A", 11, 10), ("B", 10, 16), ("C", 5, 11),
                                                                ("D", 8, 9)]),
        compare.workload(N_("hidden: prefix-cache hit before the first chunk"),
                         dict(block_size=4, num_usable_blocks=48, max_num_batched_tokens=12, max_num_seqs=4,
                              long_prefill_token_threshold=5, enable_prefix_caching=True),
                         [("A", 26, 3), ("B", 30, 3, 5), ("C", 18, 2, 6)], shared_prefix=16),
    ]
    off = compare.random_workloads(506, 2, chunked=False)
    for w in off:
        # Without chunked prefill the engine requires max_model_len <= the budget, which random_workloads leaves
        # at the pool's size; its prompts and outputs fit the budget (prompt <= budget - 12, output <= 12).
        w["engine"]["max_model_len"] = w["engine"]["max_num_batched_tokens"]
    return hand + compare.random_workloads(505, 3, chunked=True) + off


def _chunk_meaning(d: Any, expected: Optional[Dict[str, Any]], got: Optional[Dict[str, Any]]) -> str:
    """A line saying what a chunk-sizing difference usually means (``compare.check_scheduler_part``'s explain)."""
    if d.field != "num_scheduled_tokens" or expected is None or got is None or d.request is None:
        return ""
    if (got.get("num_scheduled_tokens") or {}).get(d.request) == 0:
        return _("  {request} was admitted with 0 tokens: with chunked prefill off, a request that does not fit "
                 "returns None from _num_new_tokens_waiting (the waiting loop stops), not 0").format(request=d.request)
    if d.request in (expected.get("resumed") or []):
        return _("  {request} was resumed after a preemption: its chunk counts from request.num_tokens (its "
                 "outputs included), not from the prompt").format(request=d.request)
    return ""


def check_chunk_sizing(cls: Any, hidden: bool = True) -> int:
    """The ``chunk_sizing`` checker: ``cls`` overrides the three chunk-sizing methods and no other part's, and
    schedules every workload (hidden ones too with ``hidden``) exactly as the reference ``Scheduler``."""
    return compare.check_scheduler_part("chunk_sizing", cls, CHUNK_SIZING_METHODS, chunk_sizing_workloads(),
                                        chunk_sizing_hidden() if hidden else (), explain=_chunk_meaning)


register(Part(
    name="chunk_sizing",
    lesson="05",
    symbol="ChunkSizing",
    kind="scheduler",
    seam="scheduler_cls: Scheduler._long_prefill_token_threshold, _num_new_tokens_running, _num_new_tokens_waiting",
    writes=N_("the step's cap (lone-request rule) and each request's chunk, running and waiting"),
    check=check_chunk_sizing,
    hints=(
        N_("A chunk is what the request still wants, capped twice: by the step's long_prefill_token_threshold "
        "(when it is > 0) and by the budget left (step.token_budget). The cap itself is 0 when the request is "
        "alone."),
        N_("_long_prefill_token_threshold: 0 when len(self.running) + len(self.waiting) <= 1, else the configured "
        "value. Running: wanted = num_tokens + placeholders - num_computed_tokens. Waiting: wanted = num_tokens - "
        "num_computed_tokens (num_tokens, not the prompt: a resumed request recomputes its outputs too); without "
        "chunked prefill a prompt that does not fit the budget left is not cut: return None."),
        "if 0 < step.long_prefill_token_threshold < n: n = step.long_prefill_token_threshold\n"
        "if not self.config.enable_chunked_prefill and n > step.token_budget: return None\n"
        "return min(n, step.token_budget)",
    ),
    reference=ReferenceChunkSizing,
))


# ---------------------------------------------------------------------------------------------------------------
# Part 2: one step's flattened batch

BATCH_FIELDS = ("query_start_loc", "positions", "slot_mapping", "logits_indices")


def reference_flatten_batch(num_scheduled_tokens: Dict[str, int], num_computed_tokens: Dict[str, int],
                            block_tables: Dict[str, Sequence[int]], block_size: int) -> Dict[str, List[int]]:
    """One step's flattened batch, in the learner's form (the reference of ``flattened_batch``).

    Args:
        num_scheduled_tokens: request id -> tokens it computes in this step, in batch order (the
            ``SchedulerOutput``'s ``num_scheduled_tokens``).
        num_computed_tokens: request id -> tokens already in the KV cache before this step (its context).
        block_tables: request id -> its KV block ids, in position order.
        block_size: tokens per KV block.

    Returns:
        ``query_start_loc`` ``[R + 1]`` (where each request's rows start, then the total ``T``), ``positions``
        ``[T]`` (``num_computed_tokens + 0, 1, ...`` per request), ``slot_mapping`` ``[T]`` (``block_table[p //
        block_size] * block_size + p % block_size``) and ``logits_indices`` ``[R]`` (each request's last row),
        lists of ints. The package builds the same arrays with numpy in ``ModelRunnerBase._prepare_inputs``.
    """
    from minivllm.worker.block_table import compute_slot_mapping

    qsl, positions, slots = [0], [], []
    for rid, n in num_scheduled_tokens.items():
        pos = list(range(num_computed_tokens[rid], num_computed_tokens[rid] + n))
        positions += pos
        slots += compute_slot_mapping(list(block_tables[rid]), pos, block_size)
        qsl.append(qsl[-1] + n)
    return {"query_start_loc": qsl, "positions": positions, "slot_mapping": slots,
            "logits_indices": [q - 1 for q in qsl[1:]]}


class BatchCase:
    """One recorded step of an engine run: the runner's inputs and its flattened batch.

    Attributes:
        name: the run and step, e.g. ``"160 at 64, step 1"``.
        args: ``(num_scheduled_tokens, num_computed_tokens, block_tables, block_size)``, the learner's arguments.
        expected: the runner's ``query_start_loc``, ``positions``, ``slot_mapping``, ``logits_indices``.
    """

    def __init__(self, name: str, args: Tuple[Dict[str, int], Dict[str, int], Dict[str, List[int]], int],
                 expected: Dict[str, List[int]]) -> None:
        self.name, self.args, self.expected = name, args, expected


def cases_from_trace(name: str, trace: Any, block_size: int) -> List[BatchCase]:
    """The steps of a ``SchedulerTrace`` recorded with ``record_inputs`` that ran the model, as ``BatchCase``s.

    The block table of each request is its row of the runner's table (``StepInputs.block_table``, padded with
    the scratch block), cut to the blocks the scheduler had given it (``StepRecord.requests``)."""
    cases = []
    for s in trace.steps:
        x = s.inputs
        if not x:
            continue
        qsl = x["query_start_loc"]
        sched = {rid: qsl[i + 1] - qsl[i] for i, rid in enumerate(x["req_ids"])}
        computed = {rid: x["num_computed_tokens"][i] for i, rid in enumerate(x["req_ids"])}
        tables = {rid: x["block_table"][i][:len(s.requests[rid].block_ids)] for i, rid in enumerate(x["req_ids"])}
        expected = {f: list(x[f]) for f in BATCH_FIELDS}
        cases.append(BatchCase(f"{name}, step {s.step}", (sched, computed, tables, block_size), expected))
    return cases


def _traced_run(block_size: int, budget: int, requests: Sequence[tuple], **engine_kwargs: Any) -> Any:
    """A tiny-model ``TracedLLMEngine`` run recording its inputs; ``requests``: ``(id, prompt_len, max_tokens
    [, arrive_at_step[, first_token]])``, greedy, EOS ignored. Returns the trace."""
    from minivllm import SamplingParams
    from minivllm.course.trace import TracedLLMEngine

    engine_kwargs.setdefault("enable_prefix_caching", False)
    eng = TracedLLMEngine("tiny", block_size=block_size, max_num_batched_tokens=budget, record_inputs=True,
                          **engine_kwargs)
    pending = sorted(requests, key=lambda r: r[3] if len(r) > 3 else 0)
    step = 0
    while pending or eng.has_unfinished_requests():
        while pending and (pending[0][3] if len(pending[0]) > 3 else 0) <= step:
            r = pending.pop(0)
            first = r[4] if len(r) > 4 else 3 + 7 * ord(r[0][0]) % 50
            eng.add_request(r[0], [first + j % 400 for j in range(r[1])],
                            SamplingParams(temperature=0, max_tokens=r[2], ignore_eos=True))
        eng.step()
        step += 1
    return eng.trace


@functools.lru_cache(maxsize=1)
def notebook_batch_cases() -> Tuple[BatchCase, ...]:
    """The notebook's steps, on the tiny model (the schedule, and so the batch, does not depend on the weights):
    section 3's 160-token prompt at a budget of 64, and section 7's two decoders with a long prompt arriving in
    step 4 (37- and 38-token prompts, 354 tokens, block size 16)."""
    cases = cases_from_trace(N_("160 at 64"), _traced_run(16, 64, [("rhine", 160, 2)], num_gpu_blocks=64), 16)
    mix = _traced_run(16, 64, [("fr", 37, 16), ("sea", 38, 16), ("long", 354, 2, 4)], num_gpu_blocks=64)
    return tuple(cases + cases_from_trace(N_("two decoders and a long prompt"), mix, 16))


@functools.lru_cache(maxsize=1)
def hidden_batch_cases() -> Tuple[BatchCase, ...]:
    """Steps the notebook never shows: block size 4 with requests finishing and arriving (blocks out of order),
    a preempted request resuming, prefix-cache hits (context before a request's first chunk), and a request
    alone in a step after others."""
    out: List[BatchCase] = []
    out += cases_from_trace(N_("hidden: many requests, block size 4"),
                            _traced_run(4, 24, [("A", 9, 5), ("B", 3, 7), ("C", 30, 2, 1), ("D", 5, 4, 3),
                                                ("E", 14, 3, 6)], num_gpu_blocks=64), 4)
    out += cases_from_trace(N_("hidden: preemption and resume"),
                            _traced_run(4, 16, [("A", 11, 10), ("B", 10, 16), ("C", 5, 11), ("D", 8, 9)],
                                        num_gpu_blocks=10), 4)
    out += cases_from_trace(N_("hidden: prefix-cache hits"),
                            _traced_run(4, 20, [("A", 22, 3, 0, 11), ("B", 27, 3, 4, 11), ("C", 18, 2, 5, 11)],
                                        num_gpu_blocks=48, enable_prefix_caching=True), 4)
    return tuple(out)


def _as_list(v: Any, field: str, case: BatchCase) -> List[int]:
    try:
        return [int(x) for x in np.asarray(v if not isinstance(v, torch.Tensor) else v.cpu()).reshape(-1)]
    except Exception as e:  # noqa: BLE001 - any unusable value is the learner's to fix
        raise PartFailed(_("flattened_batch: on {case}, {field} is not a sequence of ints ({type}: {error})").format(
            case=compare.display_name(case.name), field=field, type=type(v).__name__, error=e)) from None


def _where(field: str, i: int, expected: Dict[str, List[int]], rids: List[str]) -> str:
    """The request (and its row) that row/entry ``i`` of ``field`` belongs to, from the expected batch."""
    qsl = expected["query_start_loc"]
    if field in ("positions", "slot_mapping"):
        r = int(np.searchsorted(qsl, i, side="right")) - 1
        if 0 <= r < len(rids):
            return _("request {request}, its row {row} (batch row {i})").format(request=rids[r], row=i - qsl[r], i=i)
    if field == "logits_indices" and i < len(rids):
        return _("request {request}").format(request=rids[i])
    if field == "query_start_loc":
        if i < len(rids):
            return _("entry {i} (where request {request} starts)").format(i=i, request=rids[i])
        return _("entry {i} (the total)").format(i=i)
    return _("entry {i}").format(i=i)


# What a difference in each field usually means, appended to the first difference (a fresh learner's read: the
# hints are the same for every failure, these lines are not). English; translated where printed.
_BATCH_MEANING = {
    "query_start_loc": N_("query_start_loc is [0, then each request's end], the cumulative sum of "
                          "num_scheduled_tokens in the dict's order (the batch order: do not sort the requests)"),
    "positions": N_("a request's rows sit at positions num_computed_tokens, num_computed_tokens + 1, ..."),
    "slot_mapping": N_("a token's slot is block_table[position // block_size] * block_size + position % block_size, "
                       "from its position (not its batch row)"),
    "logits_indices": N_("logits_indices holds each request's last row: query_start_loc[i + 1] - 1"),
}


def first_batch_difference(case: BatchCase, got: Dict[str, Any]) -> Optional[str]:
    """The first field, request and row in which ``got`` differs from the runner's batch, in words; ``None``
    when equal."""
    rids = list(case.args[0])
    for f in BATCH_FIELDS:
        if f not in got:
            return _("your result has no {field} (it has {keys})").format(field=repr(f), keys=sorted(got))
        a, b = case.expected[f], _as_list(got[f], f, case)
        if a == b:
            continue
        i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        lo = max(0, i - 3)
        if len(a) != len(b) and i == min(len(a), len(b)):
            head = _("field {field}: {n} entries, the runner has {expected}").format(field=f, n=len(b),
                                                                                    expected=len(a))
        else:
            head = _("field {field}, {where}: expected {expected}, yours {got}").format(
                field=f, where=_where(f, i, case.expected, rids), expected=a[i], got=b[i])
        sched, computed, tables, bs = case.args
        if f in _BATCH_MEANING:
            head += "\n  " + _(_BATCH_MEANING[f])
        span = f"{f}[{lo}:{i + 4}]"
        return (_("first difference: {head}").format(head=head) + "\n"
                + _("    expected {span}: {values}").format(span=span, values=a[lo:i + 4]) + "\n"
                + _("    yours    {span}: {values}").format(span=span, values=b[lo:i + 4]) + "\n"
                + _("  the step's requests (batch order): {requests}; block_size {block_size}").format(
                    requests="; ".join(_("{request}: {n} tokens on top of {computed}, blocks {blocks}").format(
                        request=r, n=sched[r], computed=computed[r], blocks=list(tables[r])) for r in rids),
                    block_size=bs))
    return None


def check_flattened_batch(fn: Any, hidden: bool = True) -> int:
    """The ``flattened_batch`` checker: ``fn(num_scheduled_tokens, num_computed_tokens, block_tables,
    block_size)`` must return the runner's ``query_start_loc``, ``positions``, ``slot_mapping`` and
    ``logits_indices`` on every recorded step (the notebook's, and with ``hidden`` the hidden runs').

    Returns the number of steps checked. Raises ``NotWritten`` while ``fn`` raises ``NotImplementedError``,
    ``PartFailed`` naming the run, step, field, request and row of the first difference."""
    if not callable(fn):
        raise PartFailed(_("flattened_batch: expected a function, got {value}").format(value=repr(fn)))
    cases = list(notebook_batch_cases()) + (list(hidden_batch_cases()) if hidden else [])
    for case in cases:
        args = (dict(case.args[0]), dict(case.args[1]), {k: list(v) for k, v in case.args[2].items()}, case.args[3])
        try:
            got = fn(*args)
        except NotImplementedError:
            raise NotWritten(not_written_message(getattr(fn, '__name__', 'flatten_batch'))) from None
        except Exception as e:  # noqa: BLE001 - reported with its step
            raise PartFailed(_("flattened_batch: your function raised {error}: {message}").format(
                error=type(e).__name__, message=e)
                + "\n" + _("  on {case}").format(case=compare.display_name(case.name))) from None
        if not isinstance(got, dict):
            raise PartFailed(_("flattened_batch: on {case}, expected a dict with keys {keys}, got {type}").format(
                case=compare.display_name(case.name), keys=list(BATCH_FIELDS), type=type(got).__name__))
        d = first_batch_difference(case, got)
        if d is not None:
            raise PartFailed(_("on {case}").format(case=compare.display_name(case.name)) + f"\n{d}")
    return len(cases)


register(Part(
    name="flattened_batch",
    lesson="05",
    symbol="flatten_batch",
    kind="runner",
    seam="model runner: ModelRunnerBase._prepare_inputs (query_start_loc, positions, slot_mapping, logits_indices)",
    writes=N_("one step's query_start_loc, positions, slot_mapping, logits_indices"),
    check=check_flattened_batch,
    hints=(
        N_("Walk the requests in batch order (the order of num_scheduled_tokens). Each one adds n rows; row j of a "
        "request sits at position num_computed_tokens + j, not at j."),
        N_("query_start_loc starts at 0 and adds each request's n; positions of a request are range(c, c + n); the "
        "slot of position p is block_table[p // block_size] * block_size + p % block_size; logits_indices is "
        "each request's LAST row, one before where the next request starts."),
        "for rid, n in num_scheduled_tokens.items():\n"
        "    c, table = num_computed_tokens[rid], block_tables[rid]\n"
        "    positions += range(c, c + n)\n"
        "    slot_mapping += [table[p // block_size] * block_size + p % block_size for p in range(c, c + n)]\n"
        "    query_start_loc.append(query_start_loc[-1] + n)\n"
        "logits_indices = [q - 1 for q in query_start_loc[1:]]",
    ),
    reference=reference_flatten_batch,
))


# ---------------------------------------------------------------------------------------------------------------
# The engine running the learner's flatten_batch


def prepare_inputs_with(runner: Any, so: Any, flatten: Callable[..., Dict[str, Any]]) -> Any:
    """``ModelRunnerBase._prepare_inputs`` with the four arrays built by ``flatten`` (the learner's
    ``flatten_batch``) instead of the runner's own: the model reads those positions, writes K/V at those slots,
    and the LM head sees those rows. Input ids, ``seq_lens`` and the discard mask follow from the learner's
    ``query_start_loc`` (each request's ``n`` tokens after its context), the block table is the runner's.

    Raises:
        ValueError: naming the field, when ``flatten``'s arrays do not fit the step (wrong lengths, a
            ``query_start_loc`` that does not start at 0 or does not add up to the step's tokens).
    """
    from minivllm.attention.backend import CommonAttentionMetadata
    from minivllm.request import is_partial_prefill
    from minivllm.worker.input_batch import ModelInputs

    req_ids = list(so.num_scheduled_tokens)
    states = [runner.requests[r] for r in req_ids]
    batch = runner.input_batch
    tables = {r: batch.block_table.row(batch.req_id_to_index[r]) for r in req_ids}
    computed_d = {r: s.num_computed_tokens for r, s in zip(req_ids, states)}
    out = flatten(dict(so.num_scheduled_tokens), computed_d, tables, runner.block_size)
    arr = {f: np.asarray(out[f], dtype=np.int64).reshape(-1) for f in BATCH_FIELDS}
    total = sum(so.num_scheduled_tokens.values())
    qsl = arr["query_start_loc"]
    if len(qsl) != len(req_ids) + 1 or qsl[0] != 0 or qsl[-1] != total:
        raise ValueError(f"query_start_loc must have {len(req_ids) + 1} entries from 0 to {total}, got {qsl.tolist()}")
    for f, n in (("positions", total), ("slot_mapping", total), ("logits_indices", len(req_ids))):
        if len(arr[f]) != n:
            raise ValueError(f"{f} must have {n} entries, got {len(arr[f])}")
    qlens = np.diff(qsl)
    computed = np.array([computed_d[r] for r in req_ids], dtype=np.int64)
    seq_lens = computed + qlens
    rows = np.array([batch.req_id_to_index[r] for r in req_ids], dtype=np.int64)
    t = lambda a: torch.as_tensor(a).to(runner.device)  # noqa: E731
    cm = CommonAttentionMetadata(
        query_start_loc=t(qsl), seq_lens=t(seq_lens), block_table_tensor=t(batch.block_table.gather(rows)),
        slot_mapping=t(arr["slot_mapping"]), positions=t(arr["positions"]), query_start_loc_cpu=qsl.tolist(),
        seq_lens_cpu_upper_bound=seq_lens.tolist(), num_reqs=len(req_ids),
        num_actual_tokens=total, max_query_len=int(qlens.max()), max_seq_len=int(seq_lens.max()),
    )
    ids = [s.token_ids[c: c + q] for s, c, q in zip(states, computed.tolist(), qlens.tolist())]
    return ModelInputs(
        req_ids=req_ids, states=states,
        input_ids=t(np.concatenate([np.asarray(x, dtype=np.int64) for x in ids])),
        common_attn_metadata=cm, attn_metadata=None, logits_indices=t(arr["logits_indices"]),
        discard=[is_partial_prefill(n, len(s.token_ids)) for n, s in zip(seq_lens.tolist(), states)],
    )


def use_flatten_batch(engine: Any, flatten: Callable[..., Dict[str, Any]]) -> Any:
    """Make ``engine``'s model runner build every step's batch with ``flatten`` (an instance hook on its
    ``_prepare_inputs``; the engine's code is unchanged and imports nothing of the course). Returns ``engine``.

    Raises:
        ValueError: when the engine's runners live in worker processes (``tensor_parallel_size > 1``).
    """
    try:
        runner = engine.model_runner
    except AttributeError as e:
        raise ValueError(f"use_flatten_batch needs an engine whose model runner is in this process: {e}") from None
    runner._prepare_inputs = functools.partial(prepare_inputs_with, runner, flatten=flatten)
    # The decode CUDA graphs bring their own inputs; the learner's batch must be what runs, so run eagerly.
    runner.graph_runner = None
    return engine


def install(engine: Any, chosen: Dict[str, Any]) -> None:
    """``your_engine``'s hook after the engine is built: its model runner builds every step's batch with the chosen
    ``flatten_batch`` (the learner's or the reference's)."""
    flatten = chosen.get("flattened_batch")
    if flatten is not None:
        use_flatten_batch(engine, flatten)
