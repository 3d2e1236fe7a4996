"""Reliability (issue 6): bad input is refused with a message naming the parameter, the value and the limit, and
without touching requests in flight; aborts at every point; liveness with a cache that holds one request;
preemption counters; stop conditions as in vLLM (``vllm/v1/core/sched/utils.py:check_stop``)."""

import pytest

from kv_invariants import StepChecker, check_pool, one_torch_thread
from minivllm import LLMEngine, SamplingParams
from minivllm.course.trace import TracedLLMEngine
from minivllm.model.loader import build_tiny_model, tiny_llama_config

VOCAB = 512


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


def greedy(max_tokens=10, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


# ---- requests in flight, and their outputs without any disturbance ------------------------------------------------
IN_FLIGHT = {
    "a": (list(range(1, 12)), greedy(10)),                     # 11 tokens
    "b": (list(range(40, 46)), greedy(12)),                    # 6 tokens
    "c": (list(range(1, 9)) + [77, 78, 79, 80, 81], greedy(8)),  # shares two blocks with "a"
}


def engine(traced=False, **kw):
    cfg = dict(block_size=4, num_gpu_blocks=32, max_model_len=64, max_num_batched_tokens=8, max_num_seqs=4)
    cfg.update(kw)
    return (TracedLLMEngine if traced else LLMEngine)("tiny", **cfg)


def token_ids(final):
    return {k: o.outputs[0].token_ids for k, o in sorted(final.items())}


_SOLO = {}


def solo(prompt, params):
    """The reference: the request alone in a roomy engine (no chunking, no caching)."""
    key = (tuple(prompt), params.max_tokens, params.min_tokens, tuple(params.stop_token_ids))
    if key not in _SOLO:
        eng = LLMEngine("tiny", block_size=16, num_gpu_blocks=16, max_model_len=64, enable_prefix_caching=False)
        eng.add_request("x", prompt, params)
        _SOLO[key] = eng.run_to_completion()["x"].outputs[0].token_ids
    return _SOLO[key]


def start_in_flight(eng, steps=2):
    for rid, (p, sp) in IN_FLIGHT.items():
        eng.add_request(rid, p, sp)
    for _ in range(steps):
        eng.step()


def snapshot(eng):
    sched, kv = eng.scheduler, eng.kv_cache_manager
    return (
        sched.queue_snapshot(),
        sorted(sched.requests),
        {rid: kv.get_block_ids(rid) for rid in sched.requests},
        [b.ref_cnt for b in kv.block_pool.blocks],
        [b.block_id for b in kv.block_pool.free_block_queue],
        len(kv.block_pool.cached_block_hash_to_block),
        {rid: (r.num_computed_tokens, list(r.output_token_ids)) for rid, r in sched.requests.items()},
    )


def finish_and_compare(eng, final=None):
    final = dict(final or {})
    final.update(eng.run_to_completion(max_steps=500))
    assert token_ids({k: final[k] for k in IN_FLIGHT}) == {k: solo(*IN_FLIGHT[k]) for k in IN_FLIGHT}
    check_pool(eng.kv_cache_manager, idle=True)
    return final


# ---- bad input: one case per row ----------------------------------------------------------------------------------
BAD_REQUESTS = [
    ("empty prompt", lambda e: e.add_request("x", [], greedy()), ["prompt", "empty"]),
    ("token id too large", lambda e: e.add_request("x", [1, 2, VOCAB], greedy()),
     ["prompt_token_ids", str(VOCAB), f"[0, {VOCAB})"]),
    ("negative token id", lambda e: e.add_request("x", [3, -1], greedy()), ["prompt_token_ids", "-1", f"[0, {VOCAB})"]),
    ("prompt longer than max_model_len", lambda e: e.add_request("x", [1] * 65, greedy()),
     ["prompt length (65 tokens)", "max_model_len (64)"]),
    ("prompt larger than the whole KV cache", lambda e: e.add_request("x", [1] * 129, greedy()),
     ["129 tokens", "33 KV blocks", "block_size=4", "num_gpu_blocks=32", "128 tokens"]),
    ("stop token id outside the vocabulary", lambda e: e.add_request("x", [1, 2], greedy(stop_token_ids=[600])),
     ["stop_token_ids", "600", f"[0, {VOCAB})"]),
    ("duplicate request id", lambda e: e.add_request("a", [1, 2], greedy()), ["request_id 'a'", "already in use"]),
    ("stop string without a tokenizer", lambda e: e.add_request("x", [1, 2], greedy(stop=["."])),
     ["stop strings", "tokenizer"]),
    ("params of the wrong type", lambda e: e.add_request("x", [1, 2], {"max_tokens": 3}),
     ["params", "SamplingParams", "dict"]),
    ("prompt of the wrong type", lambda e: e.add_request("x", 3.5, greedy()), ["prompt must be", "float"]),
    ("text prompt without a tokenizer", lambda e: e.add_request("x", "hello", greedy()), ["prompt", "no tokenizer"]),
]

BAD_PARAMS = [
    ("max_tokens 0", dict(max_tokens=0), ["max_tokens", ">= 1", "got 0"]),
    ("max_tokens negative", dict(max_tokens=-3), ["max_tokens", ">= 1", "got -3"]),
    ("min_tokens > max_tokens", dict(min_tokens=5, max_tokens=3), ["min_tokens", "<= max_tokens (3)", "got 5"]),
    ("min_tokens negative", dict(min_tokens=-1), ["min_tokens", ">= 0", "got -1"]),
    ("temperature negative", dict(temperature=-0.5), ["temperature", ">= 0", "got -0.5"]),
    ("top_p 0", dict(top_p=0.0), ["top_p", "in (0, 1]", "got 0.0"]),
    ("top_p above 1", dict(top_p=1.5), ["top_p", "in (0, 1]", "got 1.5"]),
    ("top_k -2", dict(top_k=-2), ["top_k", ">= 1, or 0 / -1", "got -2"]),
    ("top_k not an int", dict(top_k=2.5), ["top_k", "got 2.5"]),
    ("min_p above 1", dict(min_p=1.5), ["min_p", "in [0, 1]", "got 1.5"]),
    ("negative stop token id", dict(stop_token_ids=[-3]), ["stop_token_ids", "non-negative", "got -3"]),
    ("empty stop string", dict(stop=[""]), ["stop", "non-empty", "got ''"]),
    ("n > 1 greedy", dict(n=2, temperature=0.0), ["n must be 1 when using greedy sampling", "got 2"]),
    ("seed past int64", dict(seed=2**63), ["seed", "[-2**63, 2**63 - 1]", "got 9223372036854775808"]),
    ("presence_penalty above 2", dict(presence_penalty=2.5), ["presence_penalty", "in [-2, 2]", "got 2.5"]),
    ("repetition_penalty 0", dict(repetition_penalty=0.0), ["repetition_penalty", "> 0", "got 0.0"]),
    ("logprobs -2", dict(logprobs=-2), ["logprobs", ">= 0, or -1", "got -2"]),
]


@pytest.mark.parametrize("name, call, fragments", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_is_refused_and_in_flight_requests_are_untouched(name, call, fragments):
    eng = engine()
    start_in_flight(eng)
    before = snapshot(eng)
    with pytest.raises(ValueError) as err:
        call(eng)
    for f in fragments:
        assert f in str(err.value), (f, str(err.value))
    assert snapshot(eng) == before
    finish_and_compare(eng)


@pytest.mark.parametrize("name, kwargs, fragments", BAD_PARAMS, ids=[b[0] for b in BAD_PARAMS])
def test_bad_sampling_params_are_refused_at_construction(name, kwargs, fragments):
    eng = engine()
    start_in_flight(eng)
    before = snapshot(eng)
    with pytest.raises(ValueError) as err:
        eng.add_request("x", [1, 2, 3], SamplingParams(**kwargs))
    for f in fragments:
        assert f in str(err.value), (f, str(err.value))
    assert snapshot(eng) == before
    finish_and_compare(eng)


def test_boundary_values_are_accepted():
    eng = engine()
    for rid, sp in [("k0", SamplingParams(top_k=0, max_tokens=2)), ("k-1", SamplingParams(top_k=-1, max_tokens=2)),
                    ("p1", SamplingParams(top_p=1.0, max_tokens=2)), ("t0", greedy(2, min_tokens=2)),
                    ("v", greedy(2, stop_token_ids=[VOCAB - 1]))]:
        eng.add_request(rid, [VOCAB - 1, 0], sp)
    eng.add_request("full", [1] * 64, greedy(5))  # exactly max_model_len: accepted, capped to one token
    final = eng.run_to_completion(max_steps=100)
    assert final["full"].outputs[0].finish_reason == "length" and len(final["full"].outputs[0].token_ids) == 1
    assert all(len(o.outputs[0].token_ids) == (1 if k == "full" else 2) for k, o in final.items())


def test_prompt_plus_max_tokens_beyond_max_model_len_is_capped_not_rejected():
    eng = engine()
    start_in_flight(eng)
    eng.add_request("long", list(range(100, 160)), greedy(10))  # 60 + 10 > 64
    final = finish_and_compare(eng)
    out = final["long"].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    assert out.token_ids == solo(list(range(100, 160)), greedy(4))


# ---- engine configuration ----------------------------------------------------------------------------------------
BAD_CONFIGS = [
    ("budget below max_num_seqs", dict(max_num_batched_tokens=8, max_num_seqs=16),
     ["max_num_batched_tokens (8)", "max_num_seqs (16)"]),
    ("budget below max_model_len without chunking",
     dict(max_num_batched_tokens=32, max_model_len=64, enable_chunked_prefill=False, num_gpu_blocks=32),
     ["max_num_batched_tokens (32)", "max_model_len (64)", "enable_chunked_prefill=False"]),
    ("block_size 0", dict(block_size=0), ["block_size", "positive", "got 0"]),
    ("block_size negative", dict(block_size=-4), ["block_size", "positive", "got -4"]),
    ("fewer blocks than one request needs", dict(block_size=4, num_gpu_blocks=3, max_model_len=16),
     ["num_gpu_blocks (3)", "block_size (4)", "max_model_len (16)", "at least 4 blocks"]),
    ("no blocks", dict(num_gpu_blocks=0), ["num_gpu_blocks", ">= 1", "got 0"]),
    ("max_num_seqs 0", dict(max_num_seqs=0, max_num_batched_tokens=16), ["max_num_seqs", "positive", "got 0"]),
    ("max_model_len beyond the model", dict(max_model_len=5000, num_gpu_blocks=400),
     ["max_model_len (5000)", "context length (4096)"]),
    ("unknown policy", dict(scheduling_policy="lifo"), ["scheduling_policy", "'fcfs' or 'priority'", "'lifo'"]),
    ("negative prefill threshold", dict(long_prefill_token_threshold=-1), ["long_prefill_token_threshold", "got -1"]),
    ("unknown dtype", dict(dtype="float8"), ["dtype", "'float8'"]),
]


@pytest.mark.parametrize("name, kwargs, fragments", BAD_CONFIGS, ids=[b[0] for b in BAD_CONFIGS])
def test_bad_engine_config_is_refused(name, kwargs, fragments):
    cfg = dict(num_gpu_blocks=32, max_model_len=64)
    cfg.update(kwargs)
    with pytest.raises(ValueError) as err:
        LLMEngine("tiny", **cfg)
    for f in fragments:
        assert f in str(err.value), (f, str(err.value))


# ---- aborts ------------------------------------------------------------------------------------------------------
def _abort_and_check(eng, rid, expect_status):
    r = eng.scheduler.requests[rid]
    assert r.status.name == expect_status
    held = len(eng.kv_cache_manager.get_blocks(rid))
    free_before = eng.kv_cache_manager.num_free_blocks
    shared = sum(1 for b in eng.kv_cache_manager.get_blocks(rid) if b.ref_cnt > 1)
    tokens_so_far = list(r.output_token_ids)
    [out] = eng.abort_request(rid)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert out.outputs[0].token_ids == tokens_so_far
    assert rid not in eng.scheduler.requests and eng.kv_cache_manager.get_blocks(rid) == []
    assert eng.kv_cache_manager.num_free_blocks == free_before + held - shared
    check_pool(eng.kv_cache_manager)
    assert eng.abort_request(rid) == []  # a second abort is a no-op
    return out


@pytest.mark.parametrize("caching", [False, True])
def test_abort_while_waiting(caching):
    eng = engine(enable_prefix_caching=caching)
    start_in_flight(eng, steps=1)
    eng.add_request("x", list(range(1, 20)), greedy(5))
    _abort_and_check(eng, "x", "WAITING")
    finish_and_compare(eng)


@pytest.mark.parametrize("caching", [False, True])
def test_abort_mid_prefill(caching):
    eng = engine(enable_prefix_caching=caching, traced=True)
    eng.add_request("x", list(range(1, 30)), greedy(5))  # 29 tokens, budget 8: four chunks
    eng.step()
    for rid, (p, sp) in IN_FLIGHT.items():
        eng.add_request(rid, p, sp)
    eng.step()
    r = eng.scheduler.requests["x"]
    assert 0 < r.num_computed_tokens < r.num_tokens and r.num_output_tokens == 0
    _abort_and_check(eng, "x", "RUNNING")
    finish_and_compare(eng)
    assert all("x" not in s.num_scheduled_tokens for s in eng.trace.steps[2:])


@pytest.mark.parametrize("caching", [False, True])
def test_abort_while_decoding(caching):
    eng = engine(enable_prefix_caching=caching)
    start_in_flight(eng, steps=0)
    eng.add_request("x", list(range(1, 10)), greedy(20))
    while eng.scheduler.requests["x"].num_output_tokens < 3:
        eng.step()
    out = _abort_and_check(eng, "x", "RUNNING")
    assert out.outputs[0].token_ids == solo(list(range(1, 10)), greedy(20))[: len(out.outputs[0].token_ids)]
    finish_and_compare(eng)


@pytest.mark.parametrize("caching", [False, True])
def test_abort_while_preempted(caching):
    # 10 blocks of 4: "a" and "x" both grow past 20 tokens, so the younger "x" is preempted.
    eng = LLMEngine("tiny", block_size=4, num_gpu_blocks=10, max_model_len=40, max_num_batched_tokens=16,
                    enable_prefix_caching=caching)
    eng.add_request("a", list(range(1, 12)), greedy(25))
    eng.add_request("x", list(range(60, 71)), greedy(25))
    while eng.scheduler.requests["x"].num_preemptions == 0:
        eng.step()
    out = _abort_and_check(eng, "x", "PREEMPTED")
    assert out.num_preemptions == 1
    final = eng.run_to_completion(max_steps=200)
    assert final["a"].outputs[0].token_ids == solo(list(range(1, 12)), greedy(25))
    check_pool(eng.kv_cache_manager, idle=True)


def test_abort_of_unknown_or_finished_requests_is_ignored():
    eng = engine()
    eng.add_request("done", [1, 2, 3], greedy(1))
    eng.run_to_completion()
    assert eng.abort_request(["done", "never-seen"]) == []
    assert not eng.has_unfinished_requests() and not eng.output_processor.request_states


# ---- liveness, FCFS progress, preemption counters ------------------------------------------------------------------
PROMPTS = [list(range(1 + 9 * i, 7 + 9 * i)) for i in range(6)]  # six 6-token prompts


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("caching", [False, True])
def test_liveness_with_a_cache_that_holds_one_request(policy, chunked, caching):
    # max_model_len 16 = the whole cache (4 blocks of 4): each request can grow to fill it alone.
    eng = TracedLLMEngine("tiny", block_size=4, num_gpu_blocks=4, max_model_len=16,
                    max_num_batched_tokens=16 if not chunked else 4, max_num_seqs=4, enable_chunked_prefill=chunked,
                    enable_prefix_caching=caching, scheduling_policy=policy)
    checker = StepChecker(eng)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, greedy(20), priority=i % 3)
    final = eng.run_to_completion(max_steps=1000)
    assert sorted(final) == [f"r{i}" for i in range(6)]
    for i, p in enumerate(PROMPTS):
        out = final[f"r{i}"].outputs[0]
        assert out.finish_reason == "length" and len(out.token_ids) == 10  # capped at max_model_len 16
        assert out.token_ids == solo(p, greedy(10))
    assert checker.num_steps == len(eng.trace)
    check_pool(eng.kv_cache_manager, idle=True)
    # thrashing is visible: per request and per run
    per_request = [final[f"r{i}"].num_preemptions for i in range(6)]
    assert sum(per_request) == eng.num_preemptions == len(eng.trace.preemptions()) > 0


def test_fcfs_oldest_running_request_always_progresses():
    eng = TracedLLMEngine("tiny", block_size=4, num_gpu_blocks=6, max_model_len=24, max_num_batched_tokens=8,
                    max_num_seqs=4, enable_prefix_caching=False)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, greedy(18))
    eng.run_to_completion(max_steps=2000)
    assert eng.num_preemptions > 0
    steps = eng.trace.steps
    for prev, cur in zip(steps, steps[1:]):
        if not prev.running:
            continue
        oldest = prev.running[0]
        if oldest in prev.finished:
            continue
        # the oldest running request is never the victim, and it is scheduled in every step
        assert oldest not in cur.preempted, cur.step
        assert oldest in cur.num_scheduled_tokens, cur.step
        assert cur.requests[oldest].num_computed_tokens > prev.requests[oldest].num_computed_tokens


def test_num_preemptions_per_request_and_per_run():
    eng = TracedLLMEngine("tiny", block_size=4, num_gpu_blocks=8, max_model_len=32, max_num_batched_tokens=16,
                    enable_prefix_caching=False)
    for i, p in enumerate(PROMPTS[:4]):
        eng.add_request(f"r{i}", p, greedy(20))
    final = eng.run_to_completion(max_steps=1000)
    counted = {}
    for _, rid in eng.trace.preemptions():
        counted[rid] = counted.get(rid, 0) + 1
    assert {k: o.num_preemptions for k, o in final.items() if o.num_preemptions} == counted
    assert eng.num_preemptions == sum(counted.values()) == eng.scheduler.stats.num_preemptions > 0
    assert final["r0"].num_preemptions == 0  # FCFS: the oldest is never the victim


# ---- stop conditions -------------------------------------------------------------------------------------------------
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def free_run():
    """Greedy tokens for PROMPT from the tiny model with no EOS: 209, 345, 139, 483, ... (all different)."""
    seq = solo(PROMPT, greedy(8))
    assert len(set(seq)) == len(seq)
    return seq


def eos_engine(eos):
    """The same tiny model (same seed, same weights) with an EOS token id in its config."""
    model = build_tiny_model(tiny_llama_config(eos_token_id=eos))
    return LLMEngine(model, block_size=4, num_gpu_blocks=16, max_model_len=64)


def one(eng, params, prompt=PROMPT):
    eng.add_request("q", prompt, params)
    return eng.run_to_completion(max_steps=200)["q"]


def test_max_tokens_1():
    eng = engine()
    for prompt in ([1], [1, 2, 3, 4], list(range(1, 9))):
        out = one(eng, greedy(1), prompt).outputs[0]
        assert len(out.token_ids) == 1 and out.finish_reason == "length" and out.stop_reason is None
        assert out.token_ids == solo(prompt, greedy(8))[:1]


def test_eos_stops_with_reason_stop(free_run):
    eng = eos_engine(free_run[2])
    out = one(eng, greedy(8)).outputs[0]
    assert out.token_ids == free_run[:3]  # the EOS token is part of token_ids, as in vLLM
    assert (out.finish_reason, out.stop_reason) == ("stop", None)


def test_eos_at_the_last_allowed_token_is_stop(free_run):
    # vLLM 0.32's check_stop tests EOS before the length: EOS sampled as token max_tokens ends it with "stop".
    eng = eos_engine(free_run[2])
    out = one(eng, greedy(3)).outputs[0]
    assert out.token_ids == free_run[:3] and (out.finish_reason, out.stop_reason) == ("stop", None)


def test_ignore_eos(free_run):
    eng = eos_engine(free_run[2])
    out = one(eng, greedy(8, ignore_eos=True)).outputs[0]
    assert out.token_ids == free_run and out.finish_reason == "length"


def test_min_tokens_suppresses_eos(free_run):
    eos = free_run[1]
    eng = eos_engine(eos)
    assert one(eng, greedy(8)).outputs[0].token_ids == free_run[:2]
    out = one(eng, greedy(8, min_tokens=4)).outputs[0]
    assert eos not in out.token_ids[:4] and len(out.token_ids) >= 4
    assert out.token_ids[0] == free_run[0] and out.token_ids[1] != eos
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == eos and eos not in out.token_ids[:-1]
    # with min_tokens == max_tokens, the same first tokens
    assert one(eng, greedy(4, min_tokens=4)).outputs[0].token_ids == out.token_ids[:4]


def test_min_tokens_suppresses_stop_token_ids(free_run):
    eng = engine()
    stop = free_run[1]
    out = one(eng, greedy(8, stop_token_ids=[stop])).outputs[0]
    assert out.token_ids == free_run[:2] and (out.finish_reason, out.stop_reason) == ("stop", stop)
    out = one(eng, greedy(8, stop_token_ids=[stop], min_tokens=3)).outputs[0]
    assert stop not in out.token_ids[:3] and out.token_ids[0] == free_run[0]
    # (a stop token as the last allowed token: test_stop_conditions.py::test_engine_stop_token_at_max_tokens_is_stop)


@pytest.mark.parametrize("length", [1, 3, 4, 5, 8, 12, 16])
def test_prompt_lengths_around_block_boundaries(length):
    prompt = [(11 * i + 3) % VOCAB for i in range(length)]
    ref = solo(prompt, greedy(6))
    for kw in (dict(), dict(enable_prefix_caching=False), dict(max_num_batched_tokens=4, max_num_seqs=4)):
        eng = engine(**kw)
        checker = StepChecker(eng)
        eng.add_request("first", prompt, greedy(6))
        first = eng.run_to_completion()["first"]
        eng.add_request("again", prompt, greedy(6))
        again = eng.run_to_completion()["again"]
        assert first.outputs[0].token_ids == again.outputs[0].token_ids == ref
        caching = kw.get("enable_prefix_caching", True)
        # a fully cached exact multiple of block_size still recomputes its last block
        assert again.num_cached_tokens == (4 * ((length - 1) // 4) if caching else 0)
        assert checker.num_steps > 0
        check_pool(eng.kv_cache_manager, idle=True)


# ---- stop strings with the real tokenizer --------------------------------------------------------------------------
def test_stop_strings_spanning_token_boundaries(real_llm):
    tok = real_llm.get_tokenizer()
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    full = real_llm.chat(msgs, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    assert full.text == "The capital of France is Paris."
    # find two neighbouring tokens and a stop string made of the end of one and the start of the next
    pieces = [tok.decode([t]) for t in full.token_ids]
    assert "".join(pieces).startswith(full.text)
    i = next(k for k in range(len(pieces) // 2, len(pieces)) if len(pieces[k - 1].strip()) >= 2 and len(pieces[k]) >= 2)
    start = len("".join(pieces[:i]))
    stop = full.text[start - 2: start + 2]
    assert stop not in full.text[: start - 2] + full.text[start - 2: start + 1]
    for include in (False, True):
        out = real_llm.chat(msgs, SamplingParams(temperature=0, max_tokens=16, stop=[stop],
                                                 include_stop_str_in_output=include), use_tqdm=False)[0].outputs[0]
        assert (out.finish_reason, out.stop_reason) == ("stop", stop)
        assert out.text == full.text[: start + 2 if include else start - 2]
        # generation stopped at the token that completed the stop string
        assert out.token_ids == full.token_ids[: i + 1]
    assert stop == "ce i"  # " France" | " is": the boundary is inside the stop string
