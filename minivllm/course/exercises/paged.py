"""Checkers for notebook 03: slot mapping, writing K/V through it, reading back through a block table, and
paged attention (PagedAttention, Kwon et al., SOSP 2023, section 4.1; vLLM ``reshape_and_cache_flash``).

Cache layout (one layer): ``kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]``, ``[0]`` keys and
``[1]`` values, as in ``minivllm.attention.paged_attention``. Unused slots of every test cache hold random
numbers, so reading or writing the wrong slot always shows.
"""

from __future__ import annotations

import math
from typing import Callable, List

import torch

from minivllm.attention.backends.reference import reference_paged_attention
from minivllm.attention.paged_attention import gather_kv, write_kv_cache
from minivllm.worker.block_table import compute_slot_mapping
from minivllm.course.exercises._harness import Variant, call, check_cases, checker, compare_tensors, fail
from minivllm.course.exercises._reference import attention_ref, one_request_metadata
from minivllm.i18n import N_, _


# ---- slot mapping -----------------------------------------------------------------------------------------------
#: Known mistakes of slot_mapping: (the wrong formula, its hint in English; translated where shown).
_SLOT_MISTAKES = [
    (lambda bt, p, i, bs: p, N_("look the block up in the block table: the slot is block_table[p // block_size] * "
     "block_size + p % block_size, not the position itself.")),
    (lambda bt, p, i, bs: bt[p // bs] + p % bs, N_("a block holds block_size slots: multiply the block id by block_size.")),
    (lambda bt, p, i, bs: bt[p % bs] * bs + p // bs,
     N_("p // block_size picks the entry of the block table, p % block_size the offset inside the block.")),
    (lambda bt, p, i, bs: bt[i // bs] * bs + i % bs,
     N_("use each token's position p, not its index in the `positions` list (a chunk need not start at 0).")),
]


@checker("slot_mapping")
def check_slot_mapping(fn: Callable) -> int:
    """Check ``fn(block_table, positions, block_size) -> slots``, all Python lists of ints (a tensor is accepted).

    ``slots[i] = block_table[positions[i] // block_size] * block_size + positions[i] % block_size``: the row of
    the flattened ``[num_blocks * block_size]`` cache where the token at ``positions[i]`` lives. Expected:
    ``minivllm.worker.block_table.compute_slot_mapping``.

    Raises:
        ExerciseFailed: naming the failing input, expected and actual slots, and a hint for known mistakes.
    """
    cases = [
        ("block_table=[3], positions=[0, 1, 2], block_size=4", [3], [0, 1, 2], 4),
        (_("block_table=[3, 7], positions=[0..7], block_size=4 (two blocks)"), [3, 7], list(range(8)), 4),
        (_("block_table=[9, 2, 5], positions=[6..10] (a chunk starting inside block 1), block_size=4"),
         [9, 2, 5], list(range(6, 11)), 4),
        (_("block_table=[4, 0, 6], positions=[9] (one decode token), block_size=4"), [4, 0, 6], [9], 4),
        ("block_table=[1, 8], positions=[0..31], block_size=16", [1, 8], list(range(32)), 16),
    ]
    for desc, bt, pos, bs in cases:
        got = call(fn, (list(bt), list(pos), bs), "slot_mapping", desc)
        try:
            got_list = [int(s) for s in (got.tolist() if isinstance(got, torch.Tensor) else got)]
        except Exception:  # noqa: BLE001
            fail("slot_mapping", desc, _("expected a list of ints, got {type}: {value}").format(type=type(got).__name__, value=repr(got)))
        expected = compute_slot_mapping(bt, pos, bs)
        if got_list != expected:
            hint = None
            for wrong, h in _SLOT_MISTAKES:
                try:
                    if [wrong(bt, p, i, bs) for i, p in enumerate(pos)] == got_list:
                        hint = _(h)
                        break
                except IndexError:
                    continue
            fail("slot_mapping", desc, _("expected slots {expected}, got {got}").format(expected=expected, got=got_list), hint)
    return len(cases)


# ---- writing and reading the paged cache ---------------------------------------------------------------------
def _garbage_cache(g: torch.Generator, num_blocks: int, block_size: int, hkv: int, d: int) -> torch.Tensor:
    return torch.randn(2, num_blocks, block_size, hkv, d, generator=g)


@checker("write_kv")
def check_write_kv(fn: Callable) -> int:
    """Check ``fn(kv_cache, k, v, slot_mapping)``: store ``k, v [T, num_kv_heads, head_dim]`` in place.

    Token ``i``'s key goes to slot ``slot_mapping[i]`` of ``kv_cache[0]`` viewed as ``[num_blocks * block_size,
    num_kv_heads, head_dim]``, its value to the same slot of ``kv_cache[1]``; no other entry changes. The return
    value is ignored. Expected: ``minivllm.attention.paged_attention.write_kv_cache``.

    Raises:
        ExerciseFailed: naming the failing input and the first wrong cache entry, with a hint.
    """
    g = torch.Generator().manual_seed(8)
    cases = [
        (_("kv_cache [2, 4 blocks, block_size 4, 2 KV heads, head_dim 3], slot_mapping=[5, 6, 7]"), 4, 4, [5, 6, 7]),
        (_("kv_cache [2, 4, 4, 2, 3], slot_mapping=[13, 2, 8, 9] (scattered over blocks 3, 0, 2)"), 4, 4, [13, 2, 8, 9]),
        (_("kv_cache [2, 4, 4, 2, 3], slot_mapping=[15] (one decode token, last slot of block 3)"), 4, 4, [15]),
    ]
    for desc, nb, bs, slots in cases:
        cache = _garbage_cache(g, nb, bs, 2, 3)
        k, v = torch.randn(len(slots), 2, 3, generator=g), torch.randn(len(slots), 2, 3, generator=g)
        sm = torch.tensor(slots)
        expected = cache.clone()
        write_kv_cache(k, v, expected, sm)
        before = cache.clone()
        call(fn, (cache, k.clone(), v.clone(), sm.clone()), "write_kv", desc)
        problem = compare_tensors(expected, cache, what="kv_cache", atol=0, rtol=0)
        if problem is None:
            continue
        hint = None
        if torch.equal(cache, before):
            hint = (_("the cache did not change: the write went into a copy. Assign through a view, e.g. "
                    "kv_cache[0].view(-1, H, D)[slot_mapping] = k; chained indexing such as kv_cache[0][b][o] = k "
                    "writes into a temporary."))
        else:
            swapped = before.clone()
            write_kv_cache(v, k, swapped, sm)
            if torch.equal(cache, swapped):
                hint = _("keys go to kv_cache[0] and values to kv_cache[1].")
        fail("write_kv", desc, problem, hint)
    return len(cases)


@checker("gather_kv")
def check_gather_kv(fn: Callable) -> int:
    """Check ``fn(kv_cache, block_table, seq_len) -> (k, v)``: one request's first ``seq_len`` keys and values.

    ``block_table`` is an int64 tensor of block ids in position order; it may be longer than needed (rows of a
    batch's block table are padded with 0). Returns ``k, v [seq_len, num_kv_heads, head_dim]``: token ``p`` is at
    offset ``p % block_size`` of block ``block_table[p // block_size]``. Expected:
    ``minivllm.attention.paged_attention.gather_kv``.

    Raises:
        ExerciseFailed: naming the failing input, expected and actual values, and a hint for known mistakes.
    """
    g = torch.Generator().manual_seed(9)
    cases = [
        (_("block_table=[2, 0], seq_len=6, block_size=4 (the last block is half full)"), [2, 0], 6),
        (_("block_table=[3, 1, 4], seq_len=12, block_size=4 (three full blocks)"), [3, 1, 4], 12),
        ("block_table=[5], seq_len=1, block_size=4", [5], 1),
        (_("block_table=[1, 6, 0, 0] (padded with zeros past the request's blocks), seq_len=5, block_size=4"),
         [1, 6, 0, 0], 5),
    ]
    for desc, bt, n in cases:
        check_gather_case(fn, _garbage_cache(g, 8, 4, 2, 3), bt, n, desc,
                          untrimmed=lambda rows, bt=bt, n=n: rows in (-(-n // 4) * 4, len(bt) * 4))
    return len(cases)


def check_gather_case(fn: Callable, cache: torch.Tensor, bt: list, n: int, desc: str,
                      untrimmed: Callable[[int], bool]) -> None:
    """Run ``fn(cache, block_table, n)`` on one case and compare ``(k, v)`` with the package's ``gather_kv``
    exactly; shared by this checker and lesson 03's hidden cases.

    Args:
        cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``; block_size and head counts come from it.
        bt: the block table as a list of ints; n: ``seq_len``; desc: the case, in words, for the message.
        untrimmed: whether a wrong answer of that many rows (not ``n``) is the untrimmed-blocks mistake.

    Raises:
        ExerciseFailed: naming the case, the first wrong value and a hint for a known mistake.
    """
    __tracebackhide__ = True
    table = torch.tensor(bt)
    exp_k, exp_v = gather_kv(cache, table, n)
    got = call(fn, (cache.clone(), table.clone(), n), "gather_kv", desc)
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        fail("gather_kv", desc, _("expected a tuple (k, v), got {type}").format(type=type(got).__name__))
    bs, heads, dim = cache.shape[2:]
    for name, exp, other, out in (("k", exp_k, exp_v, got[0]), ("v", exp_v, exp_k, got[1])):
        problem = compare_tensors(exp, out, what=name, atol=0, rtol=0)
        if problem is None:
            continue
        hint = None
        nblk = -(-n // bs)
        if isinstance(out, torch.Tensor) and out.dim() == 3 and out.shape[0] != n and untrimmed(out.shape[0]):
            hint = _("keep only the first seq_len rows: the last block is only partly filled (or not the request's).")
        elif isinstance(out, torch.Tensor) and out.shape == exp.shape and torch.equal(out, other):
            hint = _("k comes from kv_cache[0], v from kv_cache[1].")
        elif isinstance(out, torch.Tensor) and out.shape == exp.shape:
            contiguous = cache[0 if name == "k" else 1, :nblk].reshape(nblk * bs, heads, dim)[:n]
            if torch.equal(out, contiguous):
                hint = _("read the blocks listed in block_table, in that order, not blocks 0, 1, 2, ...")
        fail("gather_kv", desc, problem, hint)


# ---- paged attention -------------------------------------------------------------------------------------------
def _paged_variant(q, cache, bt, n, *, gather="table", mask="bottom_right", head_map="interleave"):
    t = q.shape[0]
    bs = cache.shape[2]
    seq_len = n + t
    nblk = -(-seq_len // bs)
    blocks = bt[:nblk] if gather == "table" else torch.arange(nblk)
    k = cache[0, blocks].reshape(nblk * bs, *cache.shape[3:])[:seq_len]
    v = cache[1, blocks].reshape(nblk * bs, *cache.shape[3:])[:seq_len]
    return attention_ref(q, k, v, n, mask=mask, head_map=head_map)


def _untrimmed(q, cache, bt, n):
    """Keeps every row of the blocks it reads, past ``num_computed + T``, with the mask aligned to the last row."""
    t, bs = q.shape[0], cache.shape[2]
    nblk = -(-(n + t) // bs)
    k = cache[0, bt[:nblk]].reshape(nblk * bs, *cache.shape[3:])
    v = cache[1, bt[:nblk]].reshape(nblk * bs, *cache.shape[3:])
    return attention_ref(q, k, v, nblk * bs - t)


def _no_context(q, cache, bt, n):
    """Attends over this step's own ``T`` keys only, not the context."""
    t = q.shape[0]
    k, v = gather_kv(cache, bt, n + t)
    return attention_ref(q, k[n:], v[n:], 0)


def _scaled(scale_of_d: Callable[[int], float]) -> Callable:
    def run(q, cache, bt, n):
        k, v = gather_kv(cache, bt, n + q.shape[0])
        return attention_ref(q, k, v, n, scale=scale_of_d(q.shape[2]))
    return run


#: Known mistakes of paged attention and their hints, tried in order (also used by lesson 03's hidden cases).
PAGED_VARIANTS = [
    Variant(lambda q, c, b, n: _paged_variant(q, c, b, n, gather="range"),
            N_("read the blocks listed in block_table (block_table[p // block_size]), not blocks 0, 1, 2, ...")),
    Variant(lambda q, c, b, n: _paged_variant(q, c, b, n, mask="top_left"),
            N_("row i of q is position num_computed + i: it sees keys 0..num_computed + i (shift the causal "
            "mask's diagonal right by num_computed).")),
    Variant(lambda q, c, b, n: _paged_variant(q, c, b, n, mask="none"),
            N_("apply the causal mask: in a prefill or chunk, row i must not see keys after num_computed + i.")),
    Variant(lambda q, c, b, n: _paged_variant(q, c, b, n, head_map="repeat"),
            N_("query head j uses KV head j // (num_heads // num_kv_heads): repeat_interleave, not repeat.")),
    Variant(_untrimmed, N_("keep only the first num_computed + T keys and values: the rest of the last block is "
                        "another request's data or garbage.")),
    Variant(_no_context, N_("attend over all num_computed + T keys (the context in the cache and this step's), not "
                         "only this step's T.")),
    Variant(_scaled(lambda d: 1.0), N_("scale the scores by 1 / sqrt(head_dim).")),
    Variant(_scaled(lambda d: 1.0 / d), N_("the scale is 1 / sqrt(head_dim), not 1 / head_dim.")),
]


@checker("paged_attention")
def check_paged_attention(fn: Callable) -> int:
    """Check ``fn(q, kv_cache, block_table, num_computed) -> out``: attention of one request through its blocks.

    ``q [T, num_heads, head_dim]`` are the queries of the ``T`` tokens at positions ``num_computed ..
    num_computed + T - 1``. The keys and values of all ``num_computed + T`` tokens are already in ``kv_cache``
    (this step's were written first, as vLLM does), found through ``block_table`` (int64 tensor). Query row ``i``
    sees keys ``0 .. num_computed + i``; scale ``1/sqrt(head_dim)``; grouped-query heads as in notebook 01.
    Expected: ``minivllm.attention.backends.reference.reference_paged_attention``.

    Raises:
        ExerciseFailed: naming the failing input, expected and actual values, and a hint for known mistakes.
    """
    g = torch.Generator().manual_seed(10)
    shapes = [
        (_("prefill: T=6 tokens, num_computed=0, block_table=[3, 1], block_size=4, 4 query / 2 KV heads"),
         [3, 1], 0, 6, 4, 2),
        (_("decode: T=1 token at position 9 (num_computed=9), block_table=[5, 0, 2], block_size=4"), [5, 0, 2], 9, 1, 4, 2),
        (_("a chunk: T=4 tokens at positions 5..8 (num_computed=5), block_table=[2, 6, 4], 9 query / 3 KV heads"),
         [2, 6, 4], 5, 4, 9, 3),
    ]
    cases: List[tuple] = []
    d = 8
    for desc, bt, n, t, h, hkv in shapes:
        cache = _garbage_cache(g, 8, 4, hkv, d)
        q = torch.randn(t, h, d, generator=g)
        table = torch.tensor(bt)
        md = one_request_metadata(bt, n, t, 4)
        cases.append((desc, (q, cache, table, n), reference_paged_attention(q, cache, md, 1.0 / math.sqrt(d))))
    variants = PAGED_VARIANTS
    general = (_("gather this request's keys and values in position order (your gather_kv), keep num_computed + T "
               "of them, then attend as in cached_attention."))
    return check_cases("paged_attention", fn, cases, variants, general_hint=general)
