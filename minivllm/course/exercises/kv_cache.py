"""Checkers for notebook 02: a contiguous per-request KV cache, and attention of new tokens over cached ones."""

from __future__ import annotations

from typing import Callable, List

import torch

from minivllm.course.exercises._harness import Variant, _NotWrittenYet, call, check_cases, checker, compare_tensors, fail
from minivllm.course.exercises._reference import attention_ref, contiguous_attention
from minivllm.course.exercises.layers import _attn_variants
from minivllm.i18n import N_, _, ngettext


def _describe(steps: List[str]) -> str:
    return "; ".join(steps) if steps else _("a new cache")


@checker("KVCache")
def check_kv_cache(cls: Callable) -> int:
    """Check a contiguous KV cache class ``cls(num_layers, max_model_len, num_kv_heads, head_dim, dtype)``.

    Its method ``append(layer, k, v)`` takes this step's ``k, v [T, num_kv_heads, head_dim]`` for one layer,
    stores them after the tokens already held for that layer, and returns ``(k_all, v_all)``: every key and value
    of that layer so far, ``[tokens_so_far, num_kv_heads, head_dim]`` in the cache's dtype. Appending past
    ``max_model_len`` tokens raises ``ValueError``. Each layer keeps its own length; two instances share nothing.

    Raises:
        ExerciseFailed: naming the sequence of appends, the expected and the actual tensors, and a hint.
    """
    g = torch.Generator().manual_seed(6)
    layers, max_len, hkv, d = 2, 12, 2, 4
    n_tests = 0

    def new_cache(desc: str, dtype=torch.float32):
        return call(cls, (layers, max_len, hkv, d, dtype), "KVCache", desc)

    # 1) prefill 5 tokens into both layers, then 3 decode steps; every append returns all tokens so far.
    steps: List[str] = []
    cache = new_cache("KVCache(num_layers=2, max_model_len=12, num_kv_heads=2, head_dim=4, dtype=torch.float32)")
    held = {layer: ([], []) for layer in range(layers)}
    for n_new in [5, 1, 1, 1]:
        for layer in range(layers):
            k, v = torch.randn(n_new, hkv, d, generator=g), torch.randn(n_new, hkv, d, generator=g)
            held[layer][0].append(k)
            held[layer][1].append(v)
            steps.append(ngettext("append(layer={layer}, {n} token)", "append(layer={layer}, {n} tokens)",
                                  n_new).format(layer=layer, n=n_new))
            desc = _describe(steps)
            out = call(lambda *a: cache.append(*a), (layer, k.clone(), v.clone()), "KVCache.append", desc)
            if not isinstance(out, tuple) or len(out) != 2:
                fail("KVCache.append", desc, _("expected a tuple (k_all, v_all), got {type}").format(type=type(out).__name__))
            exp_k, exp_v = torch.cat(held[layer][0]), torch.cat(held[layer][1])
            for name, exp, got in (("k_all", exp_k, out[0]), ("v_all", exp_v, out[1])):
                problem = compare_tensors(exp, got, what=name, atol=0, rtol=0)
                if problem is None:
                    continue
                hint = None
                if isinstance(got, torch.Tensor) and tuple(got.shape) == (n_new, hkv, d) and exp.shape[0] != n_new:
                    hint = _("return every token held for this layer so far, not only the ones just appended.")
                elif isinstance(got, torch.Tensor) and got.dim() == 3 and got.shape[0] == max_len:
                    hint = _("return only the rows filled so far (storage[:length]), not the whole reserved buffer.")
                elif isinstance(got, torch.Tensor) and got.dim() == 3 and got.shape[0] > exp.shape[0]:
                    hint = (_("each layer keeps its own length: layer 1's tokens go after layer 1's earlier tokens "
                            "(keep a length per layer, not one shared counter)."))
                elif isinstance(got, torch.Tensor) and tuple(got.shape) == tuple(exp.shape):
                    other = exp_v if name == "k_all" else exp_k
                    if torch.equal(got, other):
                        hint = _("keys and values are swapped.")
                    elif torch.equal(got[-n_new:], exp[-n_new:]) or torch.equal(got[:n_new], exp[-n_new:]):
                        hint = (_("earlier tokens were overwritten: write the new ones at rows [length, length + T) "
                                "of this layer, after the ones already held."))
                fail("KVCache.append", desc, problem, hint)
    n_tests += 1

    # 2) a second instance shares nothing with the first.
    other = new_cache(_("a second KVCache next to the first"))
    k, v = torch.randn(2, hkv, d, generator=g), torch.randn(2, hkv, d, generator=g)
    desc = _("a second, new KVCache: append(layer=0, 2 tokens) while the first cache holds 8 tokens")
    out = call(lambda *a: other.append(*a), (0, k, v), "KVCache.append", desc)
    problem = compare_tensors(k, out[0] if isinstance(out, tuple) else out, what="k_all", atol=0, rtol=0)
    if problem is not None:
        fail("KVCache.append", desc, problem,
             _("create the storage in __init__ (self.kv = torch.zeros(...)), not as a class attribute shared by all "
             "caches."))
    n_tests += 1

    # 3) the cache keeps its dtype (bfloat16 halves the bytes per token).
    desc = _("KVCache(..., dtype=torch.bfloat16), append(layer=0, 3 bfloat16 tokens)")
    bf = new_cache(desc, torch.bfloat16)
    k, v = torch.randn(3, hkv, d, generator=g).bfloat16(), torch.randn(3, hkv, d, generator=g).bfloat16()
    out = call(lambda *a: bf.append(*a), (0, k, v), "KVCache.append", desc)
    problem = compare_tensors(k, out[0] if isinstance(out, tuple) else out, what="k_all", atol=0, rtol=0)
    if problem is not None:
        fail("KVCache.append", desc, problem, _("allocate the storage with the `dtype` given to __init__."))
    n_tests += 1

    # 4) at most max_model_len tokens: the storage was reserved for exactly that many.
    desc = _("max_model_len=12: append(layer=0, 10 tokens), then append(layer=0, 3 tokens)")
    full = new_cache(desc)
    call(lambda *a: full.append(*a), (0, torch.zeros(10, hkv, d), torch.zeros(10, hkv, d)), "KVCache.append", desc)
    try:
        full.append(0, torch.zeros(3, hkv, d), torch.zeros(3, hkv, d))
    except ValueError:
        pass
    except NotImplementedError:
        raise _NotWrittenYet() from None
    except Exception as e:  # noqa: BLE001
        fail("KVCache.append", desc, _("raised {error}: {message}").format(error=type(e).__name__, message=e),
             _("check the length yourself and raise ValueError naming max_model_len before writing anything."))
    else:
        fail("KVCache.append", desc, _("13 tokens were accepted by a cache of 12 slots"),
             _("raise ValueError when length + T > max_model_len."))
    n_tests += 1
    return n_tests


@checker("cached_attention")
def check_cached_attention(fn: Callable) -> int:
    """Check ``fn(q, k_all, v_all, num_computed) -> out``: new tokens attending to cached and new keys.

    ``q [T, num_heads, head_dim]`` are the queries of the ``T`` new tokens, at positions
    ``num_computed .. num_computed + T - 1``; ``k_all, v_all [num_computed + T, num_kv_heads, head_dim]`` are
    the keys and values of every token so far (cached ones first). Query row ``i`` sees keys
    ``0 .. num_computed + i``: a causal mask whose diagonal is shifted right by ``num_computed``. Expected:
    ``reference_paged_attention``.

    Raises:
        ExerciseFailed: naming the failing input, expected and actual values, and a hint for known mistakes.
    """
    g = torch.Generator().manual_seed(7)
    shapes = [
        (_("prefill: T=5 new tokens, num_computed=0 (nothing cached), 4 query / 2 KV heads"), 0, 5, 4, 2, 8),
        (_("decode: T=1 new token at position 8, num_computed=8 (keys 0..8), 4 query / 2 KV heads"), 8, 1, 4, 2, 8),
        (_("a chunk: T=3 new tokens at positions 5..7, num_computed=5, 9 query / 3 KV heads"), 5, 3, 9, 3, 16),
        (_("decode: T=1 new token at position 0, num_computed=0"), 0, 1, 2, 1, 8),
    ]
    cases = []
    for desc, n, t, h, hkv, d in shapes:
        q = torch.randn(t, h, d, generator=g)
        k, v = torch.randn(n + t, hkv, d, generator=g), torch.randn(n + t, hkv, d, generator=g)
        cases.append((desc, (q, k, v, n), contiguous_attention(q, k, v, n)))
    variants = [
        Variant(lambda q, k, v, n: attention_ref(q, k, v, n, mask="top_left"),
                N_("row i of q is the token at position num_computed + i, so it may see keys 0..num_computed + i. "
                "A mask aligned to the top-left corner (torch.tril(ones(T, S)), or SDPA's is_causal=True) lets a "
                "decode token see only key 0. Shift the diagonal right by num_computed."))
    ] + _attn_variants(with_context=True)
    return check_cases("cached_attention", fn, cases, variants)
