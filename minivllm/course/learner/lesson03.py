"""Lesson 03's parts: the learner's slot mapping, KV write, KV gather and paged attention, and the attention
backend built from them (issue 26).

The four functions have the signatures of notebook 03's exercise cells (``minivllm.course.exercises.fallback``
holds the package's own, which are the parts' references):

* ``slot_mapping(block_table, positions, block_size) -> list[int]`` (vLLM ``BlockTable.compute_slot_mapping``);
* ``write_kv(kv_cache, k, v, slot_mapping)``, in place (vLLM ``reshape_and_cache_flash``);
* ``gather_kv(kv_cache, block_table, seq_len) -> (k, v)`` (the read half of paged attention);
* ``paged_attention(q, kv_cache, block_table, num_computed) -> out`` (one request's attention through its blocks).

Each checker runs the notebook's cases (``minivllm.course.exercises.paged``, whose hints name known mistakes) and,
with ``hidden=True``, cases the notebook never shows: other block sizes (1 to 32), grouped-query head counts
(MQA, SmolLM2's 9 / 3, MHA), non-contiguous block tables padded as the engine pads them, chunks with context, and
keys and values passed as non-contiguous views, as the model passes them.

``learner_attention_backend(slot_mapping, write_kv, paged_attention)`` turns three of them into an
``AttentionBackend`` (``minivllm.attention.backend``) that the engine takes as ``attention_backend=``: its metadata
builder computes the step's slot mapping with the learner's ``slot_mapping``, one request at a time, from the
request's block-table row and positions; its implementation writes with the learner's ``write_kv`` and attends one
request at a time with the learner's ``paged_attention``. It computes what ``REFERENCE``
(``minivllm/attention/backends/reference.py``) computes; vLLM has no such backend (its ``FlashAttentionImpl``
writes with ``reshape_and_cache_flash`` and reads the blocks inside one kernel for the whole batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Sequence, Tuple, Type, cast

import torch

from minivllm.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from minivllm.attention.backends.reference import reference_paged_attention
from minivllm.attention.paged_attention import write_kv_cache
from minivllm.course.exercises import fallback, paged
from minivllm.course.exercises._harness import (
    ExerciseFailed,
    LearnerRaised,
    _NotWrittenYet,
    call,
    check_cases,
    compare_tensors,
    fail,
    hint_label,
)
from minivllm.course.exercises._reference import one_request_metadata
from minivllm.course.learner.parts import NotWritten, Part, PartFailed, not_written_message, register
from minivllm.i18n import N_, _
from minivllm.worker.block_table import compute_slot_mapping

LESSON = "03"
SEAM = "attention_backend: the learner backend (learner_attention_backend)"


def _legacy(checker: Callable, fn: Any, name: str) -> int:
    """Run one of ``minivllm.course.exercises.paged``'s checkers (the notebook's cases, with their hints) without
    its printing; its "not written yet" becomes ``NotWritten``, its failure ``PartFailed``."""
    try:
        return cast(Any, checker).__wrapped__(fn)  # the undecorated checker: it raises, never prints
    except _NotWrittenYet:
        raise NotWritten(not_written_message(name)) from None
    except PartFailed:
        raise
    except ExerciseFailed as e:
        failed = PartFailed(str(e))
        failed.learner_raised = isinstance(e, LearnerRaised)  # type: ignore[attr-defined]
        raise failed from None


#: Shown with a failed hidden case that matches no known mistake.
HIDDEN_HINT = (N_("the hidden cases use other block sizes, head counts and head sizes: take them from kv_cache.shape and "
               "k.shape (or q.shape), not from the notebook's examples."))


def _hidden(check: Callable[[], int], name: str) -> int:
    """Run hidden cases built with the harness (``call``, ``fail``, ``check_cases``), mapping its signals."""
    try:
        return check()
    except _NotWrittenYet:
        raise NotWritten(not_written_message(name)) from None
    except PartFailed:
        raise
    except ExerciseFailed as e:
        msg = str(e)
        if hint_label() not in msg:
            msg += "\n  " + _("Hint: {hint}").format(hint=_(HIDDEN_HINT))
        raise PartFailed(_("(a hidden case: one the notebook does not show)") + f"\n{msg}") from None


# ---- slot_mapping ---------------------------------------------------------------------------------------------
#: Hidden cases: (description, block_table, positions, block_size). The padded rows end in the scratch block's id
#: (the number of usable blocks), as the model runner pads them (``minivllm/worker/block_table.py``).
SLOT_HIDDEN: List[Tuple[str, List[int], List[int], int]] = [
    (N_("block_table=[5, 2, 7], positions=[0, 1, 2], block_size=1 (one token per block)"), [5, 2, 7], [0, 1, 2], 1),
    (N_("block_table=[6, 1, 9, 3], positions=[11..25] (a chunk after 11 tokens of context), block_size=8"),
     [6, 1, 9, 3], list(range(11, 26)), 8),
    (N_("block_table=[40, 3, 17], positions=[37] (one decode token in the third block), block_size=16"),
     [40, 3, 17], [37], 16),
    (N_("block_table=[2, 9], positions=[0..63] (a whole prompt of two full blocks), block_size=32"),
     [2, 9], list(range(64)), 32),
    (N_("block_table=[6, 1, 3, 24, 24] (a batch row padded with the scratch block 24), positions=[5..9], block_size=4"),
     [6, 1, 3, 24, 24], list(range(5, 10)), 4),
    (N_("block_table=[11, 10, 9, 8], positions=[3..6] (blocks in descending order), block_size=2"),
     [11, 10, 9, 8], list(range(3, 7)), 2),
]


def _slots_of(got: Any, desc: str) -> List[int]:
    try:
        return [int(s) for s in (got.tolist() if isinstance(got, torch.Tensor) else got)]
    except Exception:  # noqa: BLE001 - any non-list answer is reported with its type
        fail("slot_mapping", desc, _("expected a list of ints, got {type}: {value}").format(type=type(got).__name__,
                                                                                            value=repr(got)))
        raise AssertionError("unreachable")  # pragma: no cover - fail raises


def _slot_hint(bt: Sequence[int], pos: Sequence[int], bs: int, got: List[int]) -> Any:
    for wrong, hint in paged._SLOT_MISTAKES:
        try:
            if [wrong(bt, p, i, bs) for i, p in enumerate(pos)] == got:
                return _(hint)
        except IndexError:
            continue
    return None


def _check_slot_hidden(fn: Callable) -> int:
    for desc, bt, pos, bs in SLOT_HIDDEN:
        desc = _(desc)
        got = _slots_of(call(fn, (list(bt), list(pos), bs), "slot_mapping", desc), desc)
        expected = compute_slot_mapping(bt, pos, bs)
        if got != expected:
            where = ""
            if len(got) == len(expected):
                i = next(j for j, (a, b) in enumerate(zip(expected, got)) if a != b)
                where = "\n" + _("    first difference: positions[{i}] = {position} (block {block}, offset "
                                 "{offset}): expected slot {expected}, got {got}").format(
                    i=i, position=pos[i], block=bt[pos[i] // bs], offset=pos[i] % bs, expected=expected[i],
                    got=got[i])
            fail("slot_mapping", desc, _("expected slots {expected}, got {got}").format(expected=expected, got=got)
                 + where, _slot_hint(bt, pos, bs, got))
    return len(SLOT_HIDDEN)


def check_slot_mapping(fn: Any, hidden: bool = True) -> int:
    """The checker of part ``slot_mapping``: ``fn(block_table, positions, block_size) -> slots`` (lists of ints; a
    tensor answer is accepted) equals ``minivllm.worker.block_table.compute_slot_mapping`` on the notebook's 5
    cases and, with ``hidden``, on ``SLOT_HIDDEN``. Returns the number of cases. Raises ``NotWritten`` or
    ``PartFailed`` naming the case, the expected and the actual slots, and the known mistake when it is one."""
    n = _legacy(paged.check_slot_mapping, fn, "slot_mapping")
    if hidden:
        n += _hidden(lambda: _check_slot_hidden(fn), "slot_mapping")
    return n


# ---- write_kv ---------------------------------------------------------------------------------------------------
@dataclass
class _WriteCase:
    desc: str
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    slots: List[int]
    strided: bool = False  # k and v as non-contiguous views (the model splits them out of one projection)


WRITE_HIDDEN = [
    _WriteCase(N_("kv_cache [2, 5 blocks, block_size 8, 1 KV head (MQA), head_dim 4], slot_mapping = the slots of "
               "positions 11..16 through block_table [3, 0, 4]"), 5, 8, 1, 4,
               compute_slot_mapping([3, 0, 4], list(range(11, 17)), 8)),
    _WriteCase(N_("kv_cache [2, 4, block_size 16, 3 KV heads, head_dim 8], slot_mapping=[63] (one decode token, the "
               "last slot of the cache)"), 4, 16, 3, 8, [63]),
    _WriteCase(N_("kv_cache [2, 6, block_size 1, 2 KV heads, head_dim 2], slot_mapping=[4, 0, 5, 2] (one token per "
               "block)"), 6, 1, 2, 2, [4, 0, 5, 2]),
    _WriteCase(N_("kv_cache [2, 6, block_size 4, 3 KV heads, head_dim 8], slot_mapping = the slots of positions 2..9 "
               "through block_table [5, 1, 3]; k and v are non-contiguous views, as the model passes them "
               "(split out of one projection)"), 6, 4, 3, 8, compute_slot_mapping([5, 1, 3], list(range(2, 10)), 4),
               strided=True),
]


def _check_write_hidden(fn: Callable) -> int:
    g = torch.Generator().manual_seed(1303)
    for c in WRITE_HIDDEN:
        cache = torch.randn(2, c.num_blocks, c.block_size, c.kv_heads, c.head_dim, generator=g)
        t = len(c.slots)
        if c.strided:
            kv = torch.randn(t, 2 * c.kv_heads + 1, c.head_dim, generator=g)
            k, v = kv[:, :c.kv_heads], kv[:, c.kv_heads:2 * c.kv_heads]
        else:
            k = torch.randn(t, c.kv_heads, c.head_dim, generator=g)
            v = torch.randn(t, c.kv_heads, c.head_dim, generator=g)
        sm = torch.tensor(c.slots)
        expected = cache.clone()
        write_kv_cache(k, v, expected, sm)
        before = cache.clone()
        desc = _(c.desc)
        call(fn, (cache, k, v, sm.clone()), "write_kv", desc)
        problem = compare_tensors(expected, cache, what="kv_cache", atol=0, rtol=0)
        if problem is None:
            continue
        hint = None
        if torch.equal(cache, before):
            hint = (_("the cache did not change: the write went into a copy. Assign through a view, e.g. "
                    "kv_cache[0].view(-1, H, D)[slot_mapping] = k."))
        else:
            swapped = before.clone()
            write_kv_cache(v.contiguous(), k.contiguous(), swapped, sm)
            first = before.clone()
            first.view(2, -1, c.kv_heads, c.head_dim)[0, :t] = k
            first.view(2, -1, c.kv_heads, c.head_dim)[1, :t] = v
            if torch.equal(cache, swapped):
                hint = _("keys go to kv_cache[0] and values to kv_cache[1].")
            elif torch.equal(cache, first):
                hint = _("token i goes to slot slot_mapping[i], not to slot i.")
        fail("write_kv", desc, problem, hint)
    return len(WRITE_HIDDEN)


def check_write_kv(fn: Any, hidden: bool = True) -> int:
    """The checker of part ``write_kv``: ``fn(kv_cache, k, v, slot_mapping)`` stores ``k, v [T, num_kv_heads,
    head_dim]`` at ``slot_mapping`` (int64 ``[T]``) of ``kv_cache [2, num_blocks, block_size, num_kv_heads,
    head_dim]`` in place and changes nothing else (exactly: ``minivllm.attention.paged_attention.write_kv_cache``).
    The notebook's 3 cases, then ``WRITE_HIDDEN``. Raises ``NotWritten`` or ``PartFailed`` naming the case and the
    first wrong cache entry."""
    n = _legacy(paged.check_write_kv, fn, "write_kv")
    if hidden:
        n += _hidden(lambda: _check_write_hidden(fn), "write_kv")
    return n


# ---- gather_kv --------------------------------------------------------------------------------------------------
#: (description, num_blocks, block_size, kv_heads, head_dim, block_table, seq_len)
GATHER_HIDDEN = [
    (N_("block_table=[4, 0, 2, 5, 5] (padded with the cache's last block, 5, as the engine pads with its scratch "
     "block), seq_len=17, block_size=8, 1 KV head"), 6, 8, 1, 4, [4, 0, 2, 5, 5], 17),
    (N_("block_table=[2, 1], seq_len=32 (two full blocks), block_size=16, 3 KV heads"), 3, 16, 3, 8, [2, 1], 32),
    (N_("block_table=[3, 5, 0, 1], seq_len=3, block_size=1, 2 KV heads"), 6, 1, 2, 2, [3, 5, 0, 1], 3),
]


def _check_gather_hidden(fn: Callable) -> int:
    g = torch.Generator().manual_seed(1304)
    for desc, nb, bs, hkv, d, bt, n in GATHER_HIDDEN:
        paged.check_gather_case(fn, torch.randn(2, nb, bs, hkv, d, generator=g), bt, n, _(desc),
                                untrimmed=lambda rows, n=n: rows > n)
    return len(GATHER_HIDDEN)


def check_gather_kv(fn: Any, hidden: bool = True) -> int:
    """The checker of part ``gather_kv``: ``fn(kv_cache, block_table, seq_len) -> (k, v)``, each ``[seq_len,
    num_kv_heads, head_dim]``, equals ``minivllm.attention.paged_attention.gather_kv`` on the notebook's 4 cases
    and ``GATHER_HIDDEN``. Raises ``NotWritten`` or ``PartFailed`` naming the case and the first wrong value."""
    n = _legacy(paged.check_gather_kv, fn, "gather_kv")
    if hidden:
        n += _hidden(lambda: _check_gather_hidden(fn), "gather_kv")
    return n


# ---- paged_attention --------------------------------------------------------------------------------------------
#: (description, num_blocks, block_size, heads, kv_heads, head_dim, block_table, num_computed, T)
ATTENTION_HIDDEN = [
    (N_("a chunk: T=7 tokens at positions 13..19 (num_computed=13), block_table=[5, 1, 9, 12, 12] (padded with the "
     "scratch block 12), block_size=8, 9 query / 3 KV heads (SmolLM2's)"), 13, 8, 9, 3, 16,
     [5, 1, 9, 12, 12], 13, 7),
    (N_("decode: T=1 token at position 40, block_table=[3, 0, 6], block_size=16, 4 query heads / 1 KV head (MQA)"),
     7, 16, 4, 1, 8, [3, 0, 6], 40, 1),
    (N_("prefill: T=5 tokens, num_computed=0, block_table=[4, 2, 7, 1, 3], block_size=1, 2 query / 2 KV heads"),
     8, 1, 2, 2, 8, [4, 2, 7, 1, 3], 0, 5),
    (N_("a chunk: T=20 tokens at positions 30..49 (num_computed=30), block_table=[2, 0], block_size=32, "
     "8 query / 4 KV heads"), 3, 32, 8, 4, 8, [2, 0], 30, 20),
    (N_("a chunk: T=3 tokens at positions 10..12 (num_computed=10), block_table=[7, 3, 8, 1] (one block more than "
     "needed), block_size=4, 6 query / 2 KV heads"), 9, 4, 6, 2, 8, [7, 3, 8, 1], 10, 3),
]


ATTENTION_VARIANTS = paged.PAGED_VARIANTS


def _attention_cases() -> List[tuple]:
    g = torch.Generator().manual_seed(1305)
    cases = []
    for desc, nb, bs, h, hkv, d, bt, n, t in ATTENTION_HIDDEN:
        cache = torch.randn(2, nb, bs, hkv, d, generator=g)
        q = torch.randn(t, h, d, generator=g)
        md = one_request_metadata(bt, n, t, bs)
        cases.append((_(desc), (q, cache, torch.tensor(bt), n), reference_paged_attention(q, cache, md, 1.0 / math.sqrt(d))))
    return cases


def _gqa_note(e: PartFailed) -> str:
    """A line for an error that a missing grouped-query repeat causes (a raw size mismatch names no hint)."""
    msg = str(e)
    if getattr(e, "learner_raised", False) and "size" in msg and hint_label() not in msg:
        return "\n  " + _("Hint: {hint}").format(hint=_(
            "k and v have num_kv_heads heads and q has num_heads: repeat each KV head num_heads // num_kv_heads "
            "times (k.repeat_interleave(group, dim=1)) before the scores"))
    return ""


def check_paged_attention(fn: Any, hidden: bool = True) -> int:
    """The checker of part ``paged_attention``: ``fn(q, kv_cache, block_table, num_computed) -> out [T, num_heads,
    head_dim]`` equals ``minivllm.attention.backends.reference.reference_paged_attention`` (within 1e-5) on the
    notebook's 3 cases and ``ATTENTION_HIDDEN``. Raises ``NotWritten`` or ``PartFailed`` naming the case, the first
    differing entry and, when the answer equals a known mistake (``ATTENTION_VARIANTS``), what it is."""
    try:
        n = _legacy(paged.check_paged_attention, fn, "paged_attention")
    except PartFailed as e:
        raise PartFailed(str(e) + _gqa_note(e)) from None
    if hidden:
        general = (_(HIDDEN_HINT) + _(" Otherwise: gather this request's keys and values in position order, keep "
                   "num_computed + T of them, then attend as in cached_attention (1 / sqrt(head_dim), the mask shifted by num_computed, "
                   "repeat_interleave for grouped-query heads)."))
        n += _hidden(lambda: check_cases("paged_attention", fn, _attention_cases(), ATTENTION_VARIANTS,
                                         general_hint=general), "paged_attention")
    return n


# ---- the learner's attention backend -------------------------------------------------------------------------
def learner_attention_backend(slot_mapping: Callable, write_kv: Callable, paged_attention: Callable,
                              name: str = "LEARNER") -> Type[AttentionBackend]:
    """An attention backend made of the learner's three functions, for ``LLMEngine(..., attention_backend=cls)``.

    * The metadata builder (once per step) calls ``slot_mapping(block_table_row, positions, block_size)`` for each
      request of the step, with the request's row of the step's block table (padded with the scratch block) and
      the positions of its tokens, both as lists of ints, and concatenates the slots in batch order: the step's
      ``slot_mapping`` (``int64 [T]``), in place of the one the model runner computed.
    * The implementation (each layer) calls ``write_kv(kv_cache, key, value, slot_mapping)`` once for the whole
      step, then ``paged_attention(q, kv_cache, block_table_row, num_computed)`` once per request, with its query
      rows ``[q_len, num_heads, head_dim]``, its block-table row (an int64 tensor) and its context length.

    The class attribute ``calls`` counts the calls of each function (``{"slot_mapping": n, "write_kv": n,
    "paged_attention": n}``), so a notebook can show that the learner's code ran.

    Args:
        slot_mapping, write_kv, paged_attention: in the signatures of notebook 03's exercises (``fallback``'s).
        name: what ``get_name()`` returns.

    Returns:
        An ``AttentionBackend`` subclass. Its implementation raises ``ValueError`` for a layer whose softmax scale
        is not ``1 / sqrt(head_dim)`` (the exercise's ``paged_attention`` has no scale argument), and
        ``RuntimeError`` when the learner's slot mapping returns a number of slots other than the request's tokens.
    """
    calls: Dict[str, int] = {"slot_mapping": 0, "write_kv": 0, "paged_attention": 0}

    @dataclass(frozen=True, eq=False)
    class LearnerAttentionMetadata(AttentionMetadata):
        """``AttentionMetadata`` whose ``slot_mapping`` the learner's ``slot_mapping`` computed."""

    class LearnerAttentionMetadataBuilder(AttentionMetadataBuilder):
        def build(self, common_attn_metadata: CommonAttentionMetadata) -> LearnerAttentionMetadata:
            cm = common_attn_metadata
            fields = AttentionMetadata.common_fields(cm, self.block_size)
            qsl = cm.query_start_loc_cpu
            positions = cm.positions[:cm.num_actual_tokens].tolist()
            slots: List[int] = []
            for i in range(cm.num_reqs):
                row = cm.block_table_tensor[i].tolist()
                pos = positions[qsl[i]:qsl[i + 1]]
                got = slot_mapping(row, pos, self.block_size)
                calls["slot_mapping"] += 1
                got = got.tolist() if isinstance(got, torch.Tensor) else list(got)
                if len(got) != len(pos):
                    raise RuntimeError(_("slot_mapping returned {n} slots for request {i}'s {positions} "
                                         "positions").format(n=len(got), i=i, positions=len(pos)))
                slots.extend(int(s) for s in got)
            fields["slot_mapping"] = torch.tensor(slots, dtype=torch.int64, device=cm.slot_mapping.device)
            return LearnerAttentionMetadata(**fields)

    class LearnerAttentionImpl(AttentionImpl):
        def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> None:
            if not math.isclose(scale, 1.0 / math.sqrt(head_dim), rel_tol=1e-6):
                raise ValueError(f"the learner backend's paged_attention scales by 1 / sqrt(head_dim) = "
                                 f"{1.0 / math.sqrt(head_dim):g}; this layer's scale is {scale:g}")
            super().__init__(num_heads, head_dim, scale, num_kv_heads)

        def forward(self, query, key, value, kv_cache, attn_metadata: AttentionMetadata) -> torch.Tensor:
            md = attn_metadata
            write_kv(kv_cache, key, value, md.slot_mapping)
            calls["write_kv"] += 1
            out = torch.empty_like(query)
            for i, (q_len, ctx) in enumerate(zip(md.query_lens_cpu, md.num_computed_tokens_cpu)):
                s = md.query_start_loc_cpu[i]
                out[s:s + q_len] = paged_attention(query[s:s + q_len], kv_cache, md.block_table[i], ctx)
                calls["paged_attention"] += 1
            return out

    class LearnerAttentionBackend(AttentionBackend):
        """The learner's attention backend (``minivllm.course.learner.lesson03.learner_attention_backend``)."""

        @staticmethod
        def get_name() -> str:
            return name

        @staticmethod
        def get_builder_cls() -> Type[AttentionMetadataBuilder]:
            return LearnerAttentionMetadataBuilder

        @staticmethod
        def get_impl_cls() -> Type[AttentionImpl]:
            return LearnerAttentionImpl

    LearnerAttentionBackend.calls = calls  # type: ignore[attr-defined]
    LearnerAttentionBackend.functions = {  # type: ignore[attr-defined]
        "slot_mapping": slot_mapping, "write_kv": write_kv, "paged_attention": paged_attention}
    return LearnerAttentionBackend


def reference_functions() -> Tuple[Callable, Callable, Callable]:
    """The package's own ``slot_mapping``, ``write_kv`` and ``paged_attention`` (the parts' references)."""
    return fallback.slot_mapping, fallback.write_kv, fallback.paged_attention


# ---- registration -------------------------------------------------------------------------------------------
register(Part(
    name="slot_mapping", lesson=LESSON, symbol="slot_mapping", kind="attention",
    seam=SEAM + ", its metadata builder",
    writes=N_("slot of each position: block_table[p // block_size] * block_size + p % block_size"),
    check=check_slot_mapping, reference=fallback.slot_mapping,
    hints=(N_("A position p lives in the request's block number p // block_size, at offset p % block_size in it."),
           N_("block_table maps that logical block number to a physical block id b; physical block b covers the "
           "slots b * block_size ... b * block_size + block_size - 1 of the flattened cache."),
           "return [block_table[p // block_size] * block_size + p % block_size for p in positions]"),
))

register(Part(
    name="write_kv", lesson=LESSON, symbol="write_kv", kind="attention",
    seam=SEAM + ", AttentionImpl.forward (the write, vLLM reshape_and_cache_flash)",
    writes=N_("store this step's k and v at their slots of the paged cache, in place"),
    check=check_write_kv, reference=fallback.write_kv,
    hints=(N_("See kv_cache[0] (the keys) as one long array of slots: [num_blocks * block_size, num_kv_heads, head_dim]."),
           N_("Row i of k goes to row slot_mapping[i] of that view, and v likewise into kv_cache[1]. Assign into a "
           "view (it shares storage with kv_cache); indexing with a tensor first gives a copy."),
           "H, D = k.shape[1:]; kv_cache[0].view(-1, H, D)[slot_mapping] = k; kv_cache[1].view(-1, H, D)[slot_mapping] = v"),
))

register(Part(
    name="gather_kv", lesson=LESSON, symbol="gather_kv", kind="attention",
    seam="attention_backend: not called by the learner backend itself; paged_attention repeats this read inside",
    writes=N_("read one request's first seq_len keys and values back through its block table"),
    check=check_gather_kv, reference=fallback.gather_kv,
    hints=(N_("The request's seq_len tokens fill its first ceil(seq_len / block_size) blocks; the rest of block_table "
           "may be padding."),
           N_("Index kv_cache[0] with those block ids in table order: [n_blocks, block_size, H, D]; merge the first two "
           "axes and keep the first seq_len rows. The same for kv_cache[1]."),
           "n = -(-seq_len // block_size); k = kv_cache[0, block_table[:n]].reshape(-1, H, D)[:seq_len]"),
))

register(Part(
    name="paged_attention", lesson=LESSON, symbol="paged_attention", kind="attention",
    seam=SEAM + ", AttentionImpl.forward (attention per request)",
    writes=N_("one request's causal GQA attention over its keys read through its block table"),
    check=check_paged_attention, reference=fallback.paged_attention,
    hints=(N_("Gather the request's num_computed + T keys and values through block_table (as in gather_kv, written "
           "inside this function), then attend as notebook 02's cached_attention does."),
           N_("Query row i is position num_computed + i and sees keys 0 .. num_computed + i. Query head j uses KV head "
           "j // (num_heads // num_kv_heads) (repeat_interleave). Scale the scores by 1 / sqrt(head_dim)."),
           "scores = torch.einsum('qhd,khd->hqk', q, k) / D ** 0.5; "
           "out = torch.einsum('hqk,khd->qhd', scores.masked_fill(~allowed, float('-inf')).softmax(-1), v)"),
))


def engine_kwargs(chosen: Dict[str, Any]) -> Dict[str, Any]:
    """``your_engine``'s hook: the chosen ``slot_mapping``, ``write_kv`` and ``paged_attention`` (the learner's or
    the reference's, each on its own) as one attention backend, ``attention_backend=``. (``gather_kv`` runs inside
    the learner's ``paged_attention`` when it calls it; the backend does not call it directly.)"""
    if not {"slot_mapping", "write_kv", "paged_attention"} <= set(chosen):
        return {}
    return {"attention_backend": learner_attention_backend(chosen["slot_mapping"], chosen["write_kv"],
                                                           chosen["paged_attention"])}
