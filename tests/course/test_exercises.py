"""The exercise checkers accept correct solutions, report stubs kindly, and reject known mistakes with the right
message (the failing input, expected vs got, and the matching hint)."""

import math

import pytest
import torch
import torch.nn.functional as F

import minivllm.course.exercises as ex
from minivllm.attention.paged_attention import gather_kv as ref_gather_kv
from minivllm.course.exercises import ExerciseFailed
from minivllm.course.exercises._harness import compare_tensors
from minivllm.course.exercises._reference import layer_from_parts, run_reference_layer
from minivllm.model.loader import build_tiny_model


# ---- correct solutions, written independently of the package -----------------------------------------------
def rms_norm(x, w, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, theta):
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None, :]
    cos, sin = ang.cos().float()[:, None], ang.sin().float()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


def attention(q, k, v, n=0):
    t, h, d = q.shape
    g = h // k.shape[1]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(g, 1).transpose(0, 1), v.repeat_interleave(g, 1).transpose(0, 1),
        attn_mask=torch.arange(k.shape[0])[None] <= (n + torch.arange(t))[:, None],
    )
    return o.transpose(0, 1)


def swiglu(x, wg, wu, wd):
    return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)


def layer(x, pos, w, cfg):
    t = x.shape[0]
    h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    n = rms_norm(x, w["input_layernorm"], cfg.rms_norm_eps)
    q = rope(F.linear(n, w["q_proj"]).view(t, h, d), pos, cfg.rope_theta)
    k = rope(F.linear(n, w["k_proj"]).view(t, hkv, d), pos, cfg.rope_theta)
    v = F.linear(n, w["v_proj"]).view(t, hkv, d)
    x = x + F.linear(attention(q, k, v).reshape(t, -1), w["o_proj"])
    return x + swiglu(rms_norm(x, w["post_attention_layernorm"], cfg.rms_norm_eps), w["gate_proj"], w["up_proj"],
                      w["down_proj"])


def greedy(forward, prompt, n, eos=None):
    seq, out = list(prompt), []
    while len(out) < n:
        out.append(int(forward(seq)[-1].argmax()))
        seq.append(out[-1])
        if out[-1] == eos:
            break
    return out


class KVCache:
    def __init__(self, layers, max_len, hkv, d, dtype=torch.float32):
        self.k = [torch.empty(max_len, hkv, d, dtype=dtype) for _ in range(layers)]
        self.v = [torch.empty(max_len, hkv, d, dtype=dtype) for _ in range(layers)]
        self.n = [0] * layers
        self.max_len = max_len

    def append(self, layer, k, v):
        a, b = self.n[layer], self.n[layer] + len(k)
        if b > self.max_len:
            raise ValueError("max_model_len exceeded")
        self.k[layer][a:b], self.v[layer][a:b] = k, v
        self.n[layer] = b
        return self.k[layer][:b], self.v[layer][:b]


def slot_mapping(bt, pos, bs):
    return torch.tensor([bt[p // bs] * bs + p % bs for p in pos])


def write_kv(cache, k, v, slots):
    bs = cache.shape[2]
    cache[0, slots // bs, slots % bs] = k
    cache[1, slots // bs, slots % bs] = v


def paged_attention(q, cache, bt, n):
    k, v = ref_gather_kv(cache, bt, n + q.shape[0])
    return attention(q, k, v, n)


def stub(*args):
    raise NotImplementedError


# ---- accepting ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "check, fn, n",
    [
        (ex.check_rms_norm, rms_norm, 4),
        (ex.check_rope, rope, 3),
        (ex.check_gqa_attention, attention, 4),
        (ex.check_swiglu, swiglu, 2),
        (ex.check_decoder_layer, layer, 2),
        (ex.check_greedy_generate, greedy, 4),
        (ex.check_kv_cache, KVCache, 4),
        (ex.check_cached_attention, attention, 4),
        (ex.check_slot_mapping, slot_mapping, 5),
        (ex.check_write_kv, write_kv, 3),
        (ex.check_gather_kv, ref_gather_kv, 4),
        (ex.check_paged_attention, paged_attention, 3),
    ],
)
def test_correct_solution_passes(check, fn, n, capsys):
    assert check(fn) is None
    out = capsys.readouterr().out
    assert out.startswith("✓ ") and f"all {n} tests passed" in out


def test_decoder_layer_checks_a_given_model_too(capsys):
    big = build_tiny_model(seed=3)
    ex.check_decoder_layer(layer, model=big)
    assert "all 4 tests passed" in capsys.readouterr().out


@pytest.mark.parametrize(
    "check",
    [ex.check_rms_norm, ex.check_rope, ex.check_gqa_attention, ex.check_swiglu, ex.check_decoder_layer,
     ex.check_greedy_generate, ex.check_kv_cache, ex.check_cached_attention, ex.check_slot_mapping,
     ex.check_write_kv, ex.check_gather_kv, ex.check_paged_attention, ex.check_static_batching,
     ex.check_predict_chunks],
)
def test_stub_is_reported_not_raised(check, capsys):
    check(stub)
    out = capsys.readouterr().out
    assert "not written yet" in out and "✓" not in out


def test_kv_cache_stub_methods_are_reported(capsys):
    class Half(KVCache):
        def append(self, layer, k, v):
            raise NotImplementedError

    ex.check_kv_cache(Half)
    assert "KVCache: not written yet" in capsys.readouterr().out


# ---- rejecting, with the right message -------------------------------------------------------------------------
def fails(check, fn, *patterns, **kwargs):
    with pytest.raises(ExerciseFailed) as info:
        check(fn, **kwargs)
    msg = str(info.value)
    for p in patterns:
        assert p in msg, f"{p!r} not in:\n{msg}"
    return msg


def test_rms_norm_mistakes():
    layer_norm = lambda x, w, e: (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + e) * w
    msg = fails(ex.check_rms_norm, layer_norm, "x [4, 8] random", "expected", "this is LayerNorm")
    assert "output[0, 0] is" in msg
    fails(ex.check_rms_norm, lambda x, w, e: x / x.pow(2).mean(-1, keepdim=True).sqrt() * w,
          "all zeros", "eps is missing", "nan")
    fails(ex.check_rms_norm, lambda x, w, e: x / (x.pow(2).mean(-1, keepdim=True).sqrt() + e) * w,
          "eps goes inside the square root")
    fails(ex.check_rms_norm, lambda x, w, e: rms_norm(x, 1.0, e), "multiply the normalised x by `weight`")
    fails(ex.check_rms_norm, lambda x, w, e: x * torch.rsqrt(x.pow(2).mean() + e) * w, "mean over the last dimension")


def test_rope_mistakes():
    def interleaved(x, pos, theta):
        d = x.shape[-1]
        inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        ang = pos.double()[:, None] * inv
        cos, sin = ang.cos().float()[:, None], ang.sin().float()[:, None]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)

    fails(ex.check_rope, interleaved, "positions [0, 1, 2, 3]", "i + head_dim/2")
    fails(ex.check_rope, lambda x, p, t: rope(x, torch.arange(x.shape[0]), t), "[7, 0, 31, 2, 100]",
          "not by its row number")
    fails(ex.check_rope, lambda x, p, t: rope(x, -p, t), "wrong way")
    fails(ex.check_rope, lambda x, p, t: x, "rope is wrong")


def test_attention_mistakes():
    no_mask = lambda q, k, v: F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), enable_gqa=True).transpose(0, 1)
    fails(ex.check_gqa_attention, no_mask, "T=5 tokens", "causal mask")

    def repeat_heads(q, k, v):
        g = q.shape[1] // k.shape[1]
        return attention(q, k.repeat(1, g, 1), v.repeat(1, g, 1))

    fails(ex.check_gqa_attention, repeat_heads, "4 query heads sharing 2 KV heads", "repeat_interleave")

    def no_scale(q, k, v):
        return attention(q * math.sqrt(q.shape[-1]), k, v)

    fails(ex.check_gqa_attention, no_scale, "1 / sqrt(head_dim)")
    fails(ex.check_gqa_attention, lambda q, k, v: q, "gqa_attention is wrong")


def test_attention_error_is_reported_with_input():
    def crashes(q, k, v):
        return q @ k  # wrong shapes: a RuntimeError inside the learner's code

    fails(ex.check_gqa_attention, crashes, "gqa_attention raised RuntimeError", "T=5 tokens")


def test_swiglu_mistakes():
    fails(ex.check_swiglu, lambda x, g, u, d: swiglu(x, u, g, d), "x [3, 8]", "SiLU goes on the gate")
    fails(ex.check_swiglu, lambda x, g, u, d: F.linear(F.gelu(F.linear(x, g)) * F.linear(x, u), d), "not GELU")
    fails(ex.check_swiglu, lambda x, g, u, d: x @ g @ d, "swiglu raised RuntimeError")


def test_decoder_layer_mistakes():
    def unknown_mistake(x, p, w, c):
        return layer(x, p, w, c) - x  # matches no known variant: only the general hint applies

    fails(ex.check_decoder_layer, lambda x, p, w, c: layer(x, torch.arange(len(x)), w, c),
          "positions [0, 3, 4, 8, 9]", "rotate q and k by `positions`")
    fails(ex.check_decoder_layer, lambda x, p, w, c: layer_from_parts(x, p, w, c, residual=False),
          "residual connections")
    fails(ex.check_decoder_layer, lambda x, p, w, c: layer_from_parts(x, p, w, c, swap_gate_up=True),
          "gate and up are swapped")
    msg = fails(ex.check_decoder_layer, unknown_mistake, "decoder_layer is wrong", "Hint:")
    assert "run the part checkers first" in msg


def test_greedy_generate_mistakes():
    fails(ex.check_greedy_generate, lambda f, p, n, e=None: list(p) + greedy(f, p, n, e), "not the prompt")
    fails(ex.check_greedy_generate, lambda f, p, n, e=None: greedy(lambda s: f(s)[:1], p, n, e), "logits[-1]")
    fails(ex.check_greedy_generate, lambda f, p, n, e=None: greedy(f, p, n, None),
          "eos_token_id=", "stop as soon as")
    fails(ex.check_greedy_generate, lambda f, p, n, e=None: greedy(f, p, n, e)[:-1] if e is not None else greedy(f, p, n, e),
          "keep the EOS token")
    fails(ex.check_greedy_generate, lambda f, p, n, e=None: greedy(f, p, n + 1, e), "one too many")

    def mutates(f, p, n, e=None):
        out = []
        for _ in range(n):
            p.append(int(f(p)[-1].argmax()))
            out.append(p[-1])
        return out

    fails(ex.check_greedy_generate, mutates, "changed in place")

    def only_last_token(f, p, n, e=None):
        seq, out = list(p), []
        for _ in range(n):
            out.append(int(f(seq[-1:])[-1].argmax()))
            seq.append(out[-1])
        return out

    fails(ex.check_greedy_generate, only_last_token, "whole sequence")


def test_kv_cache_mistakes():
    class OnlyNew(KVCache):
        def append(self, layer, k, v):
            super().append(layer, k, v)
            return k, v

    fails(ex.check_kv_cache, OnlyNew, "append(layer=0, 1 token)", "every token held for this layer")

    class SharedCounter(KVCache):
        def append(self, layer, k, v):
            a, b = self.n[0], self.n[0] + len(k)
            self.k[layer][a:b], self.v[layer][a:b] = k, v
            self.n[0] = b
            return self.k[layer][:b], self.v[layer][:b]

    fails(ex.check_kv_cache, SharedCounter, "append(layer=1, 5 tokens)", "each layer keeps its own length")

    class Overwrites(KVCache):
        def append(self, layer, k, v):
            self.n[layer] += len(k)
            b = self.n[layer]
            self.k[layer][: len(k)], self.v[layer][: len(k)] = k, v
            return self.k[layer][:b], self.v[layer][:b]

    fails(ex.check_kv_cache, Overwrites, "earlier tokens were overwritten")

    class Whole(KVCache):
        def append(self, layer, k, v):
            super().append(layer, k, v)
            return self.k[layer], self.v[layer]

    fails(ex.check_kv_cache, Whole, "not the whole reserved buffer")

    class Swapped(KVCache):
        def append(self, layer, k, v):
            return super().append(layer, v, k)

    fails(ex.check_kv_cache, Swapped, "keys and values are swapped")

    class NoLimit(KVCache):
        def __init__(self, layers, max_len, hkv, d, dtype=torch.float32):
            super().__init__(layers, max_len + 8, hkv, d, dtype)

    fails(ex.check_kv_cache, NoLimit, "max_model_len=12", "13 tokens were accepted")

    class FloatOnly(KVCache):
        def __init__(self, layers, max_len, hkv, d, dtype=torch.float32):
            super().__init__(layers, max_len, hkv, d, torch.float32)

    fails(ex.check_kv_cache, FloatOnly, "bfloat16", "dtype")

    class Shared:
        store = KVCache(2, 12, 2, 4)

        def __init__(self, *args):
            pass

        def append(self, layer, k, v):
            return Shared.store.append(layer, k, v)

    fails(ex.check_kv_cache, Shared, "a second, new KVCache", "class attribute")


def test_cached_attention_mistakes():
    top_left = lambda q, k, v, n: F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True).transpose(0, 1)
    fails(ex.check_cached_attention, top_left, "decode: T=1 new token at position 8", "is_causal=True",
          "Shift the diagonal right by num_computed")
    no_mask = lambda q, k, v, n: attention(q, k, v, n=k.shape[0])
    fails(ex.check_cached_attention, no_mask, "prefill", "causal mask")


def test_slot_mapping_mistakes():
    fails(ex.check_slot_mapping, lambda bt, p, bs: list(p), "block_table=[3]", "expected slots [12, 13, 14], got [0, 1, 2]",
          "look the block up")
    fails(ex.check_slot_mapping, lambda bt, p, bs: [bt[x // bs] + x % bs for x in p], "multiply the block id")
    fails(ex.check_slot_mapping, lambda bt, p, bs: [bt[i // bs] * bs + i % bs for i in range(len(p))],
          "positions=[6..10]", "not its index")
    fails(ex.check_slot_mapping, lambda bt, p, bs: "slots", "expected a list of ints")


def test_write_kv_mistakes():
    def copy_only(cache, k, v, slots):
        bs = cache.shape[2]
        cache[0][slots // bs][:, 0] = k  # chained advanced indexing writes into a temporary

    fails(ex.check_write_kv, copy_only, "slot_mapping=[5, 6, 7]", "did not change")
    fails(ex.check_write_kv, lambda c, k, v, s: write_kv(c, v, k, s), "keys go to kv_cache[0]")
    fails(ex.check_write_kv, lambda c, k, v, s: write_kv(c, k, v, s // 2), "write_kv is wrong")


def test_gather_kv_mistakes():
    def untruncated(cache, bt, n):
        nblk = -(-n // cache.shape[2])
        return cache[0, bt[:nblk]].flatten(0, 1), cache[1, bt[:nblk]].flatten(0, 1)

    fails(ex.check_gather_kv, untruncated, "seq_len=6", "expected [6, 2, 3]", "first seq_len rows")

    def ignores_table(cache, bt, n):
        return ref_gather_kv(cache, torch.arange(len(bt)), n)

    fails(ex.check_gather_kv, ignores_table, "read the blocks listed in block_table")
    fails(ex.check_gather_kv, lambda c, b, n: ref_gather_kv(c, b, n)[::-1], "k comes from kv_cache[0]")


def test_paged_attention_mistakes():
    fails(ex.check_paged_attention, lambda q, c, b, n: paged_attention(q, c, torch.arange(len(b)), n),
          "block_table=[3, 1]", "not blocks 0, 1, 2")

    def top_left(q, c, b, n):
        k, v = ref_gather_kv(c, b, n + q.shape[0])
        return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                              is_causal=True, enable_gqa=True).transpose(0, 1)

    fails(ex.check_paged_attention, top_left, "decode", "num_computed + i")


# ---- the machinery itself --------------------------------------------------------------------------------------
def test_split_layer_weights_round_trips_to_fused():
    model = build_tiny_model()
    lyr = model.model.layers[0]
    w = ex.split_layer_weights(lyr)
    assert torch.equal(torch.cat([w["q_proj"], w["k_proj"], w["v_proj"]]), lyr.self_attn.qkv_proj.weight)
    assert torch.equal(torch.cat([w["gate_proj"], w["up_proj"]]), lyr.mlp.gate_up_proj.weight)
    w["q_proj"].zero_()  # a copy: the model is untouched
    assert lyr.self_attn.qkv_proj.weight.abs().sum() > 0


def test_layer_from_parts_equals_minivllm_layer():
    model = build_tiny_model()
    x, pos = torch.randn(6, model.config.hidden_size), torch.arange(3, 9)
    for lyr in model.model.layers:
        got = layer_from_parts(x, pos, ex.split_layer_weights(lyr), model.config)
        assert torch.allclose(got, run_reference_layer(lyr, x, pos), atol=1e-5)


def test_one_request_metadata_validates():
    with pytest.raises(ValueError, match="block_table has 1 blocks"):
        ex.one_request_metadata([0], num_computed=3, num_new=2, block_size=4)
    with pytest.raises(ValueError, match="num_new must be >= 1"):
        ex.one_request_metadata([0], num_computed=0, num_new=0, block_size=4)
    md = ex.one_request_metadata([5, 2], num_computed=3, num_new=2, block_size=4)
    assert md.slot_mapping.tolist() == [23, 8] and md.positions.tolist() == [3, 4] and md.seq_lens_cpu == [5]


def test_compare_tensors_messages():
    e = torch.zeros(2, 3)
    assert compare_tensors(e, e.clone()) is None
    assert "should be a torch.Tensor" in compare_tensors(e, [0.0])
    assert "has shape [3, 2], expected [2, 3]" in compare_tensors(e, torch.zeros(3, 2))
    assert "dtype torch.float64" in compare_tensors(e, torch.zeros(2, 3, dtype=torch.float64))
    g = e.clone()
    g[1, 2] = 0.5
    msg = compare_tensors(e, g)
    assert "output[1, 2] is 0.5, expected 0" in msg and "1 of 6 entries differ" in msg
    nan = e.clone()
    nan[0, 0] = float("nan")
    assert "is nan" in compare_tensors(e, nan)


# ---- notebooks 05-08: the scheduler and connector exercises, checked against the engine -----------------------
# Solutions written from vLLM 0.32's Scheduler.schedule (FCFS) and the connector contract, not from the package.


def test_chunk_prediction(capsys):
    ex.check_chunk_prediction(None)
    out = capsys.readouterr().out
    assert "chunk_prediction: not done yet (predicted is still None)" in out and "✓" not in out
    # B decodes; C, resumed after 5 prompt + 3 generated tokens, is chunked 5 + 3; D's first chunk is what is left
    ex.check_chunk_prediction([{"B": 1, "C": 5}, {"B": 1, "C": 3, "D": 2}, {"B": 1, "C": 1, "D": 4}])
    assert capsys.readouterr().out.startswith("✓ chunk_prediction: all 3 tests passed")
    with pytest.raises(ExerciseFailed, match=r"step 11, request 'C':\n    predicted 8 tokens, the engine scheduled 5"):
        ex.check_chunk_prediction([{"B": 1, "C": 8}, {"B": 1, "D": 5}, {"B": 1, "C": 1, "D": 4}])


def test_predict_chunks():
    def predict(prompt_len, budget, num_decoding):
        per_step, chunks = budget - num_decoding, []
        while per_step > 0 and prompt_len > 0:
            chunks.append(min(per_step, prompt_len))
            prompt_len -= chunks[-1]
        return chunks

    ex.check_predict_chunks(predict)
    with pytest.raises(ExerciseFailed, match=r"predict_chunks\(160, 64, 2\)(.|\n)*returned \[64, 64, 32\]"):
        ex.check_predict_chunks(lambda p, b, d: [min(b, p - i) for i in range(0, p, b)])




def test_static_batching(capsys):
    def static(engine, prompts, params, batch_size):
        for start in range(0, len(prompts), batch_size):
            for prompt, sp in zip(prompts[start:start + batch_size], params[start:start + batch_size]):
                engine.add_request(None, prompt, sp)
            while engine.has_unfinished_requests():
                engine.step()

    def continuous(engine, prompts, params, batch_size):  # everything at once: the engine batches continuously
        for prompt, sp in zip(prompts, params):
            engine.add_request(None, prompt, sp)
        while engine.has_unfinished_requests():
            engine.step()

    ex.check_static_batching(static)
    assert capsys.readouterr().out.startswith("✓ static_batching: all 2 tests passed")
    with pytest.raises(ExerciseFailed, match="add the next batch only after \\*every\\* request"):
        ex.check_static_batching(continuous)


# ---- notebooks 01-03: the cells after an exercise use the learner's function or the package's ------------------
FALLBACKS = [
    (ex.check_rms_norm, ex.fallback.rms_norm), (ex.check_rope, ex.fallback.rope),
    (ex.check_gqa_attention, ex.fallback.gqa_attention), (ex.check_swiglu, ex.fallback.swiglu),
    (ex.check_decoder_layer, ex.fallback.decoder_layer), (ex.check_greedy_generate, ex.fallback.greedy_generate),
    (ex.check_kv_cache, ex.fallback.KVCache), (ex.check_cached_attention, ex.fallback.cached_attention),
    (ex.check_slot_mapping, ex.fallback.slot_mapping), (ex.check_write_kv, ex.fallback.write_kv),
    (ex.check_gather_kv, ex.fallback.gather_kv), (ex.check_paged_attention, ex.fallback.paged_attention),
]


@pytest.mark.parametrize("check, reference", FALLBACKS, ids=lambda x: getattr(x, "__name__", ""))
def test_fallback_passes_its_checker(check, reference, capsys):
    """What notebooks 01-03 run while an exercise is unfilled must be a correct solution of it."""
    check(reference)
    out = capsys.readouterr().out
    assert out.startswith("✓ ") and "tests passed" in out


def test_fallback_kv_cache_refuses_overflow_before_writing():
    cache = ex.fallback.KVCache(1, 4, 1, 2)
    cache.append(0, torch.ones(3, 1, 2), torch.ones(3, 1, 2))
    with pytest.raises(ValueError, match="max_model_len is 4"):
        cache.append(0, torch.full((2, 1, 2), 7.0), torch.full((2, 1, 2), 7.0))
    assert cache.lengths == [3] and not bool((cache.kv == 7).any())


def test_use_yours_or_reference(capsys):
    use, ref = ex.use_yours_or_reference, ex.fallback.rms_norm
    assert use(stub, ref, ex.check_rms_norm) is ref
    assert capsys.readouterr().out == ("rms_norm: not written yet, so the cells below use the package's reference "
                                       "(minivllm.course.exercises.fallback.rms_norm)\n")
    assert use(rms_norm, ref, ex.check_rms_norm) is rms_norm  # the learner's, correct: theirs is used
    assert capsys.readouterr().out == "rms_norm: yours passes its checker, so the cells below use yours\n"

    def wrong(x, w, eps):
        return x * w

    assert use(wrong, ref, ex.check_rms_norm) is ref
    out = capsys.readouterr().out
    assert "yours does not pass its checker yet" in out and "✓" not in out
    assert use(ref, ref, ex.check_rms_norm) is ref  # the name already holds the reference: never "yours passes"
    assert "run your exercise cell again" in capsys.readouterr().out


def test_use_yours_or_reference_passes_checker_arguments(capsys):
    """``model=`` reaches the checker: with a model it runs 4 tests (2 more, on that model's layer), without it 2."""
    calls = []

    def spy(x, positions, w, cfg):
        calls.append(cfg.hidden_size)
        return layer(x, positions, w, cfg)

    assert ex.use_yours_or_reference(spy, ex.fallback.decoder_layer, ex.check_decoder_layer) is spy
    without = len(calls)
    big = build_tiny_model(seed=3)
    assert ex.use_yours_or_reference(spy, ex.fallback.decoder_layer, ex.check_decoder_layer, model=big) is spy
    assert len(calls) - without > without
