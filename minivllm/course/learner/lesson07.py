"""Lesson 07's part (see ``minivllm.course.learner.parts``): the prefix-cache lookup at admission.

The learner writes ``PrefixCacheLookup``, a ``Scheduler`` subclass that overrides ``_prefix_cache_lookup`` (the
seam of ``scheduler_cls``, vLLM 0.32 ``SchedulerConfig.scheduler_cls``): for a waiting request about to be admitted,
the longest run of its full blocks already in the prefix cache, as vLLM's ``KVCacheManager.get_computed_blocks``
finds it (`v0.32.0 kv_cache_manager.py L264
<https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/v1/core/kv_cache_manager.py#L264>`_, with
``FullAttentionManager.find_longest_cache_hit`` walking the hashes, `single_type_kv_cache_manager.py L784
<https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/v1/core/single_type_kv_cache_manager.py#L784>`_): nothing when the request may not read the
cache (``KVCacheManager.prefix_cache_lookup_enabled``: caching off, or ``skip_reading_prefix_cache``); at most
``(num_tokens - 1) // block_size`` blocks (vLLM's ``max_cache_hit_length = request.num_tokens - 1``: the last token
is always computed, its logits sample the next token); walk ``request.block_hashes`` from the first and stop at
the first hash the block pool does not hold (``BlockPool.get_cached_block``). The KV connector's half of the
lookup (lesson 08) is given in the exercise cell.

The checker runs two kinds of cases, each against the reference:

* lookups: the learner's ``_prefix_cache_lookup`` called directly on a pool holding one cached prompt with a
  middle block evicted, for every request length around it (block sizes 4, and hidden 1 and 16), a request with
  ``skip_reading_prefix_cache`` and a pool with caching off; the blocks found and the tokens they hold are compared,
  and the pool must be left as it was (the lookup takes no reference: ``allocate_slots`` does);
* workloads: whole scheduled runs (``compare``'s step records) with prefix caching on: the notebook's shared
  system prompt, a fully cached prompt of exact block multiples, preemption then resume from cached blocks, and
  hidden ones (random shared-prefix workloads, a middle block evicted in a real run, ``skip_reading_prefix_cache``).

Calling ``kv_cache_manager.get_computed_blocks`` (or ``super()._prefix_cache_lookup`` without a connector) is the
answer, not the exercise: the checker refuses it by name.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from minivllm.core.sched.scheduler import Scheduler
from minivllm.course.learner import compare
from minivllm.course.learner.parts import NotWritten, Part, PartFailed, not_written_message, register
from minivllm.i18n import N_, _, ngettext

PART = "prefix_cache_lookup"
METHODS = ("_prefix_cache_lookup",)

#: English; translated where raised.
SHORTCUT = N_("your PrefixCacheLookup called kv_cache_manager.get_computed_blocks (directly, or through "
            "super()._prefix_cache_lookup without a connector): that is the lookup this exercise writes. Walk "
            "request.block_hashes with self.kv_cache_manager.block_pool.get_cached_block(h) instead.")


class PrefixCacheLookupReference(Scheduler):
    """The reference part: ``Scheduler``'s own ``_prefix_cache_lookup`` (it overrides nothing), which the engine runs
    where the learner's ``PrefixCacheLookup`` is not finished."""


class _Shortcut(Exception):
    """Raised inside a checked run when the learner's class reaches ``get_computed_blocks``."""


def _harness(cls: type, skip_ids: Sequence[str] = (), guard: bool = False) -> type:
    """``cls`` with the checker's two additions, neither of which changes a decision: the requests ``skip_ids``
    are marked ``skip_reading_prefix_cache`` as they are added (the course's workload format has no such field),
    and, with ``guard``, ``kv_cache_manager.get_computed_blocks`` raises ``_Shortcut`` when there is no connector."""
    skip = frozenset(skip_ids)

    class Checked(cls):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if guard and self.connector is None:
                self.kv_cache_manager.get_computed_blocks = _refuse

        def add_request(self, request: Any) -> None:
            if request.request_id in skip:
                request.sampling_params.skip_reading_prefix_cache = True
            super().add_request(request)

    Checked.__name__ = Checked.__qualname__ = cls.__name__
    return Checked


def _refuse(request: Any) -> Any:
    raise _Shortcut(SHORTCUT)


# -- the workloads ---------------------------------------------------------------------------------------------
def _wl(name: str, engine: Dict[str, Any], requests: Sequence[tuple], shared_prefix: int = 0,
        skip_reading: Sequence[str] = (), prompts: Optional[Dict[str, List[int]]] = None, shows: str = "",
        extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """``compare.workload`` with prefix caching on, requests marked ``skip_reading_prefix_cache`` and, where
    given, hand-written prompts (``prompts``: request id -> token ids)."""
    w = compare.workload(name, {"enable_prefix_caching": True, **engine}, requests, shows=shows,
                         shared_prefix=shared_prefix, extra_engine_kwargs=extra)
    for r in w["requests"]:
        if prompts and r["id"] in prompts:
            r["prompt_token_ids"] = list(prompts[r["id"]])
    w["skip_reading"] = list(skip_reading)
    return w


def _middle_miss() -> Dict[str, Any]:
    """A real run whose lookup meets a miss followed by cached blocks (9 blocks of 4). ``A`` (8 tokens, S0 S1)
    decodes while ``B`` (16 tokens, S0-S3, ``skip_reading_prefix_cache``) computes its own copies: S0 and S1 are
    already cached (A's), so B's copies stay unhashed, while S2 and S3 are cached in B's blocks. ``A`` finishes
    first (S1 and S0 to the back of the free queue), then ``B`` (S3 and S2 behind them, its unhashed blocks to the
    front). ``Y`` needs six blocks: the five unhashed ones, then A's S1, evicted. ``C`` (S0-S3 and one token) finds
    S0, misses S1, while S2 and S3 are still cached: the lookup must stop at S1."""
    s = list(range(470, 486))
    return _wl(N_("a miss in the middle (hidden)"), dict(block_size=4, num_usable_blocks=9, max_model_len=36,
                                                     max_num_batched_tokens=40),
               [("A", 8, 3, 0), ("B", 16, 4, 1), ("Y", 24, 1, 6), ("C", 17, 1, 8)],
               skip_reading=["B"], prompts={"A": s[:8], "B": s, "C": s + [9]})


def notebook_workloads() -> List[Dict[str, Any]]:
    """The notebook's own scenarios, with prefix caching on (block size 4)."""
    return [
        _wl(N_("07 section 2: a shared system prompt"), dict(block_size=4, num_usable_blocks=16, max_model_len=64),
            [("A", 13, 6, 0), ("B", 12, 6, 1), ("C", 14, 6, 1)], shared_prefix=10,
            shows="B and C take A's two full blocks of the 10 shared tokens"),
        _wl(N_("07 section 5a: a fully cached prompt of two blocks"), dict(block_size=4, num_usable_blocks=16,
                                                                        max_model_len=64),
            [("first", 8, 4, 0), ("second", 8, 4, 6), ("third", 12, 2, 12)], shared_prefix=8,
            shows="the second run of the same 8 tokens recomputes its last block"),
        _wl(N_("07 section 5d: thrashing, with caching"), dict(block_size=4, num_usable_blocks=12),
            [("A", 4, 30), ("B", 4, 8), ("C", 4, 12), ("D", 4, 16), ("E", 4, 20)],
            shows="preempted requests resume from their own cached blocks"),
    ]


def hidden_workloads() -> List[Dict[str, Any]]:
    """Workloads the notebook never shows: a middle miss in a real run, ``skip_reading_prefix_cache``, full hits
    of 16-token prompts, preemption with a shared prefix, and random shared-prefix workloads."""
    return [
        _middle_miss(),
        _wl(N_("skip_reading_prefix_cache (hidden)"), dict(block_size=4, num_usable_blocks=24),
            [("A", 14, 3, 0), ("B", 14, 3, 2), ("C", 15, 3, 2), ("D", 9, 2, 5)], shared_prefix=12,
            skip_reading=["B", "D"]),
        _wl(N_("full hits of 16 tokens (hidden)"), dict(block_size=4, num_usable_blocks=24),
            [("A", 16, 2, 0), ("B", 16, 2, 3), ("C", 16, 1, 3), ("D", 17, 2, 6), ("E", 15, 2, 6)], shared_prefix=16),
        _wl(N_("preemption with a shared prefix (hidden)"), dict(block_size=4, num_usable_blocks=11,
                                                             max_num_batched_tokens=16),
            [("A", 10, 14), ("B", 10, 12), ("C", 9, 16, 1), ("D", 13, 10, 2)], shared_prefix=8),
    ] + compare.random_workloads(707, 6, prefix_caching=True)


# -- the checker -------------------------------------------------------------------------------------------------
def _lookup_cases(cls: type, block_sizes: Sequence[int]) -> int:
    """Call the learner's lookup directly on hand-built pools; raise ``PartFailed`` at the first difference."""
    import random

    from minivllm import SamplingParams
    from minivllm.config import SchedulerConfig
    from minivllm.core.kv_cache_manager import KVCacheManager
    from minivllm.core.kv_cache_utils import get_request_block_hasher
    from minivllm.request import Request

    rng = random.Random(7)
    n_cases = 0
    for bs in block_sizes:
        for caching in (True, False):
            kv = KVCacheManager(num_gpu_blocks=64, block_size=bs, max_model_len=256, enable_caching=caching)
            hasher = get_request_block_hasher(bs)
            base = [rng.randrange(3, 512) for _i in range(6 * bs)]
            seed = Request("seed", base, SamplingParams(temperature=0, max_tokens=1), block_hasher=hasher)
            kv.allocate_slots(seed, len(base))
            seed.num_computed_tokens = len(base)
            kv.free(seed)
            evicted = ""
            if caching and bs > 1:
                # Block 3 alone evicted (hidden workload "a miss in the middle" reaches this in a real run).
                kv.block_pool.cached_block_hash_to_block.pop(seed.block_hashes[3]).block_hash = None
                evicted = _(", block 3 evicted")
            sched = _harness(cls, guard=True)(SchedulerConfig(max_model_len=256), kv, None)
            lengths = list(range(1, 6 * bs + 3)) if caching else [6 * bs]
            for n in lengths:
                for skip in ((False, True) if n == 6 * bs else (False,)):
                    tokens = base[:n] if n <= len(base) else base + [7] * (n - len(base))
                    params = SamplingParams(temperature=0, max_tokens=1, skip_reading_prefix_cache=skip)
                    req = Request(f"r{n}", tokens, params, block_hasher=hasher)
                    exp_blocks, exp_tokens = KVCacheManager.get_computed_blocks(kv, req)
                    k = len(req.block_hashes)
                    where = ngettext("a request of {n} tokens (block_size={bs}, {k} full block{skip}) against a pool "
                                     "that caches a 6-block prompt with the same first tokens{evicted}{off}",
                                     "a request of {n} tokens (block_size={bs}, {k} full blocks{skip}) against a pool "
                                     "that caches a 6-block prompt with the same first tokens{evicted}{off}", k).format(
                        n=n, bs=bs, k=k, skip=", skip_reading_prefix_cache=True" if skip else "", evicted=evicted,
                        off="" if caching else _(", prefix caching off"))
                    before = _pool_state(kv)
                    try:
                        hit = sched._prefix_cache_lookup(req)
                    except NotImplementedError:
                        raise NotWritten(not_written_message(cls.__name__)) from None
                    except _Shortcut:
                        raise PartFailed(f"{PART}: {_(SHORTCUT)}") from None
                    except Exception as e:  # noqa: BLE001 - the learner's error is reported with its case
                        extra = ("\n" + _("  in minivllm the flag is request.sampling_params.skip_reading_prefix_cache "
                                          "(vLLM 0.32 copies it onto the Request); "
                                          "prefix_cache_lookup_enabled(request) reads it for you")
                                 ) if "skip_reading_prefix_cache" in str(e) else ""
                        raise PartFailed(_("{part}: your {cls}._prefix_cache_lookup raised {error}: {message}").format(
                            part=PART, cls=cls.__name__, error=type(e).__name__, message=e)
                            + "\n" + _("  on {where}").format(where=where) + extra) from None
                    _compare_hit(hit, exp_blocks, exp_tokens, bs, where, req, kv)
                    if _pool_state(kv) != before:
                        raise PartFailed(_("{part}: on {where}, your lookup changed the block pool (ref_cnt or the "
                                           "free queue): a lookup only finds blocks; allocate_slots takes them").format(
                            part=PART, where=where))
                    n_cases += 1
    return n_cases


def _pool_state(kv: Any) -> tuple:
    pool = kv.block_pool
    return (tuple(b.ref_cnt for b in pool.blocks), tuple(b.block_id for b in pool.free_block_queue),
            len(pool.cached_block_hash_to_block))


def _compare_hit(hit: Any, exp_blocks: list, exp_tokens: int, bs: int, where: str, req: Any, kv: Any) -> None:
    if not (isinstance(hit, tuple) and len(hit) == 4):
        raise PartFailed(_("{part}: on {where}, your lookup returned {value}; return PrefixCacheHit(blocks, "
                           "num_tokens, 0, False) (the given lines at the end of the cell do)").format(
            part=PART, where=where, value=repr(hit)))
    blocks, tokens, external, load_async = hit
    try:
        got_ids = [b.block_id for b in blocks]
    except (TypeError, AttributeError):
        raise PartFailed(_("{part}: on {where}, new_computed_blocks must be a list of KVCacheBlock (what "
                           "get_cached_block returns), got {value}").format(part=PART, where=where,
                                                                            value=repr(blocks))) from None
    exp_ids = [b.block_id for b in exp_blocks]
    if got_ids != exp_ids or tokens != exp_tokens:
        flags = [kv.block_pool.get_cached_block(h) is not None for h in req.block_hashes]
        why = _why(got_ids, exp_ids, tokens, exp_tokens, bs, req, kv)
        raise PartFailed(
            _("{part}: on {where}").format(part=PART, where=where) + "\n"
            + _("  cached per full block of the request: {flags}; last-block rule: at most ({num_tokens} - 1) // "
                "{bs} = {limit}").format(flags=flags, num_tokens=req.num_tokens, bs=bs,
                                         limit=_n_blocks((req.num_tokens - 1) // bs)) + "\n"
            + _("    expected: {blocks}, num_new_local_computed_tokens {tokens}").format(blocks=_blocks(exp_ids),
                                                                                       tokens=exp_tokens) + "\n"
            + _("    yours:    {blocks}, num_new_local_computed_tokens {tokens}").format(blocks=_blocks(got_ids),
                                                                                       tokens=tokens) + why)
    if (external, load_async) != (0, False):
        raise PartFailed(_("{part}: on {where} (no connector), num_external_computed_tokens and load_kv_async must be "
                           "0 and False, yours are {external} and {load_async}").format(
            part=PART, where=where, external=repr(external), load_async=repr(load_async)))


def _n_blocks(n: int) -> str:
    return ngettext("{n} block", "{n} blocks", n).format(n=n)


def _blocks(ids: list) -> str:
    return ngettext("{n} block {ids}", "{n} blocks {ids}", len(ids)).format(n=len(ids), ids=ids)


def _why(got: list, exp: list, tokens: int, exp_tokens: int, bs: int, req: Any, kv: Any) -> str:
    """Name the known mistake a wrong lookup matches, as a last line (empty when none does)."""
    if got == exp:
        return "\n" + _("  the blocks are right: the tokens they hold are len(blocks) * block_size = {n}").format(
            n=len(exp) * bs)
    if req.sampling_params.skip_reading_prefix_cache and exp == []:
        return "\n" + _("  this request has skip_reading_prefix_cache: it may not read the cache "
                        "(kv_cache_manager.prefix_cache_lookup_enabled(request) is False)")
    if len(got) > len(exp) and len(exp) == (req.num_tokens - 1) // bs:
        return "\n" + _("  the last-block rule: take at most (num_tokens - 1) // block_size blocks, so that the last "
                        "token is computed (its logits sample the next token)")
    if len(got) > len(exp):
        return "\n" + _("  the lookup stops at the first miss: a later block's hash chains this one's, so a later "
                        "hit cannot be used without the missing block's KV")
    if got == exp[:len(got)]:
        return "\n" + _("  you took fewer blocks than are cached and allowed: the limit is (num_tokens - 1) // "
                        "block_size = {limit}, and num_tokens counts a resumed request's output tokens too (not only "
                        "num_prompt_tokens)").format(limit=_n_blocks((req.num_tokens - 1) // bs))
    return ""


def check(cls: Any, hidden: bool) -> int:
    """The checker of ``prefix_cache_lookup`` (``parts.Part.check``): lookups, then whole workloads. Returns the
    number of cases; raises ``NotWritten`` while blank, ``PartFailed`` at the first difference."""
    compare.check_scheduler_part(PART, cls, METHODS, workloads=())  # the class's shape only
    n = _lookup_cases(cls, (4, 1, 16) if hidden else (4,))
    for w in notebook_workloads() + (hidden_workloads() if hidden else []):
        n += _check_workload(cls, w)
    return n


def _check_workload(cls: type, w: Dict[str, Any]) -> int:
    skip = w.get("skip_reading", [])
    where = compare.describe(w) + (_(" with skip_reading_prefix_cache on {requests}").format(
        requests=", ".join(skip)) if skip else "")
    expected = compare.run_steps(w, _harness(Scheduler, skip))
    try:
        got = compare.run_steps(w, _harness(cls, skip, guard=True))
    except NotImplementedError:
        raise NotWritten(not_written_message(cls.__name__)) from None
    except _Shortcut:
        raise PartFailed(f"{PART}: {_(SHORTCUT)}") from None
    except Exception as e:  # noqa: BLE001 - the learner's error is reported with its workload
        raise PartFailed(_("{part}: your {cls} raised {error}: {message}").format(
            part=PART, cls=cls.__name__, error=type(e).__name__, message=e)
            + "\n" + _("  on workload {workload}").format(workload=where)) from None
    d = compare.first_difference(expected, got)
    if d is not None:
        e_step = expected[d.step] if d.step < len(expected) else None
        g_step = got[d.step] if d.step < len(got) else None
        raise PartFailed(_("on workload {workload}").format(workload=where) + f"\n{d.format(e_step, g_step)}")
    return 1


HINTS = (
    N_("Three rules, in this order: may this request read the cache at all "
    "(self.kv_cache_manager.prefix_cache_lookup_enabled(request))? How many blocks may it take at most, so that its "
    "last token is still computed? Then walk request.block_hashes from the first: where does the walk stop?"),
    N_("max_blocks = (request.num_tokens - 1) // block_size. For each hash h of request.block_hashes[:max_blocks], "
    "block = self.kv_cache_manager.block_pool.get_cached_block(h); None is a miss and ends the walk (every later "
    "hash chains the missing one). The hit is the blocks found before it, and len(blocks) * block_size tokens."),
    "if kv.prefix_cache_lookup_enabled(request):\n"
    "    for h in request.block_hashes[:(request.num_tokens - 1) // kv.block_size]:\n"
    "        block = kv.block_pool.get_cached_block(h)\n"
    "        if block is None:\n"
    "            break\n"
    "        new_computed_blocks.append(block)",
)

register(Part(
    name=PART, lesson="07", symbol="PrefixCacheLookup", kind="scheduler",
    seam="scheduler_cls: Scheduler._prefix_cache_lookup",
    writes=N_("prefix-cache lookup: longest hit, last-block rule"),
    check=check, hints=HINTS, reference=PrefixCacheLookupReference,
))

__all__ = ["PART", "PrefixCacheLookupReference", "check", "hidden_workloads",
           "notebook_workloads"]
