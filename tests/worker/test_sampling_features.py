"""Penalties, logit_bias, logprobs, prompt_logprobs, n > 1 and seeds, with vLLM 0.32's semantics (issue 28 items 8
and 13, issue 25's prompt_logprobs): each test checks a value that could be wrong, against a hand computation or
against the logits the runner kept."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLMEngine, SamplingParams
from minivllm.sampling_params import RequestOutputKind
from minivllm.worker.sampler import Sampler, SamplingMetadata, apply_penalties

PROMPT = [5, 17, 42, 9, 17, 3, 88, 120, 7, 64, 33, 2, 19, 250, 11, 6, 90, 14, 27, 300]


def engine(runner="v1", budget=512, **kw) -> LLMEngine:
    kw.setdefault("enable_prefix_caching", False)
    return LLMEngine("tiny", model_runner=runner, block_size=16, num_gpu_blocks=32, max_num_batched_tokens=budget,
                     max_model_len=256, **kw)


def final(eng, rid, prompt, sp):
    eng.add_request(rid, prompt, sp)
    return eng.run_to_completion(max_steps=500)[rid]


# ---- penalties: a hand computation on one small row ---------------------------------------------------------
def test_apply_penalties_matches_a_hand_computation():
    row = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0])
    prompt, output = [0, 1], [3, 3, 4]
    got = apply_penalties(row, prompt, output, presence=0.5, frequency=0.25, repetition=2.0)
    # repetition over prompt + output tokens {0, 1, 3, 4}: positive / 2, negative * 2
    # frequency (count) and presence over the output tokens only: 3 twice, 4 once
    want = [2.0 / 2, -1.0 * 2, 0.5, 3.0 / 2 - 0.25 * 2 - 0.5, -2.0 * 2 - 0.25 - 0.5, 1.0]
    assert got.tolist() == pytest.approx(want)
    assert row.tolist() == [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]  # not modified in place


def test_sampler_applies_bias_then_penalties_and_keeps_raw_logprobs():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]])
    sp = SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias={5: 1.0}, logprobs=2)
    plain = SamplingParams(temperature=0)
    md = SamplingMetadata([sp, plain], [None, None], [2, 0], [None, None], all_greedy=False,
                          prompt_token_ids=[[0], [1]], output_token_ids=[[3, 3], []])
    s = Sampler(torch.Generator().manual_seed(0))
    out = s(logits, md)
    # row 0: 3 -> 1.5, 0 -> 1.0, 5 -> 1 + 1 = 2.0: argmax is token 5 (the argmax of the raw row is 3)
    assert out.tolist() == [5, 5]
    e = s.last_logprobs[0]
    raw = logits[0].log_softmax(-1)
    assert e.token_ids == [5, 3, 0] and e.logprobs == pytest.approx([raw[5].item(), raw[3].item(), raw[0].item()])
    assert e.rank == 3  # token 5 is third in the raw row
    assert s.last_logprobs[1] is None


@pytest.mark.parametrize("bad, msg", [
    (dict(presence_penalty=-2.5), r"presence_penalty must be in \[-2, 2\]"),
    (dict(frequency_penalty=3), r"frequency_penalty must be in \[-2, 2\]"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be a finite number > 0"),
    (dict(repetition_penalty=-1.0), "repetition_penalty must be a finite number > 0"),
    (dict(logprobs=-3), "logprobs must be None, an int >= 0"),
    (dict(prompt_logprobs=1.5), "prompt_logprobs must be None"),
    (dict(n=0), "n must be an int >= 1"),
    (dict(n=2, temperature=0), "n must be 1 when using greedy sampling"),
    (dict(logit_bias={"x": 1.0}), "logit_bias must map integer token ids"),
    (dict(logit_bias={1: float("nan")}), "logit_bias must map integer token ids"),
])
def test_bad_values_are_refused_naming_the_parameter(bad, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**bad)


def test_engine_refuses_out_of_vocab_bias_and_too_many_logprobs_before_any_state_changes():
    eng = engine()
    for sp, msg in [(SamplingParams(logit_bias={10**6: 1.0}), "logit_bias.*out-of-vocab"),
                    (SamplingParams(logprobs=21), "logprobs.*max allowed: 20"),
                    (SamplingParams(prompt_logprobs=-1), "prompt_logprobs.*max allowed")]:
        with pytest.raises(ValueError, match=msg):
            eng.add_request("r", PROMPT, sp)
        assert not eng.has_unfinished_requests() and not eng.output_processor.request_states
    assert SamplingParams(logit_bias={3: 500}).logit_bias == {3: 100.0}  # vLLM's clamp


# ---- logit_bias and penalties through the engine ------------------------------------------------------------
@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_minus_100_bias_on_the_greedy_token_changes_it(runner):
    eng = engine(runner)
    base = final(eng, "a", PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)).outputs[0].token_ids
    biased = final(eng, "b", PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                     logit_bias={base[0]: -100.0})).outputs[0].token_ids
    assert biased[0] != base[0]
    assert base[0] not in biased  # the bias holds at every step
    zero = final(eng, "c", PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                   logit_bias={base[0]: 0.0})).outputs[0].token_ids
    assert zero == base


def test_engine_penalties_equal_argmax_of_the_hand_penalised_kept_logits():
    eng = engine()
    eng.model_runner.keep_logits = True
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, presence_penalty=1.5, frequency_penalty=1.0,
                        repetition_penalty=1.3)
    eng.add_request("p", PROMPT, sp)
    out: list = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            tok = o.new_token_ids[0]
            row = eng.model_runner.last_inputs.logits[0]
            want = apply_penalties(row, PROMPT, out, 1.5, 1.0, 1.3).argmax().item()
            assert tok == want
            out.append(tok)
    assert len(out) == 6


def test_plain_greedy_rows_are_unchanged_beside_processed_rows():
    alone = final(engine(), "g", PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    eng = engine()
    eng.add_request("x", PROMPT[::-1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                      repetition_penalty=1.5, logprobs=2))
    eng.add_request("g", PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    together = eng.run_to_completion(max_steps=100)
    assert together["g"].outputs[0].token_ids == alone.outputs[0].token_ids
    assert together["g"].outputs[0].logprobs is None and together["g"].prompt_logprobs is None


# ---- logprobs ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_logprobs_equal_log_softmax_of_the_kept_logits(runner):
    eng = engine(runner)
    eng.model_runner.keep_logits = True
    sp = SamplingParams(temperature=0.9, seed=7, max_tokens=5, ignore_eos=True, logprobs=3,
                        repetition_penalty=1.2, output_kind=RequestOutputKind.DELTA)
    eng.add_request("l", PROMPT, sp)
    n = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            (tok,), (lp,) = o.outputs[0].token_ids, o.outputs[0].logprobs
            raw = eng.model_runner.last_inputs.logits[0].log_softmax(-1)  # before penalty and temperature
            top = torch.topk(raw, 3)
            assert list(lp)[:1] == [tok] or tok in lp
            assert lp[tok].logprob == pytest.approx(raw[tok].item(), abs=1e-6)
            assert lp[tok].rank == int((raw >= raw[tok]).sum())
            for r, (v, i) in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1):
                assert lp[i].logprob == pytest.approx(v, abs=1e-6) and lp[i].rank == r
            n += 1
    assert n == 5


def test_cumulative_logprobs_follow_token_ids_and_carry_text():
    o = final(engine(), "c", PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0))
    c = o.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 4
    assert all(list(d) == [t] and d[t].rank == 1 for d, t in zip(c.logprobs, c.token_ids))  # greedy: rank 1


# ---- prompt_logprobs -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_prompt_logprobs_equal_with_and_without_chunked_prefill(runner):
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    whole = final(engine(runner), "w", PROMPT, sp)
    chunked_eng = engine(runner, budget=8, max_num_seqs=8)
    chunked_eng.add_request("c", PROMPT, sp)
    steps = []
    while chunked_eng.has_unfinished_requests():
        steps.append(chunked_eng.step())
    chunked = next(o for s in steps for o in s if o.finished)
    assert len([s for s in steps if not s]) >= 2  # the prompt really was chunked (partial steps emit nothing)
    a, b = whole.prompt_logprobs, chunked.prompt_logprobs
    assert a[0] is None and b[0] is None and len(a) == len(b) == len(PROMPT)
    for pos, (da, db) in enumerate(zip(a[1:], b[1:]), 1):
        assert PROMPT[pos] in da and list(da) == list(db)
        assert [x.logprob for x in da.values()] == pytest.approx([x.logprob for x in db.values()], abs=1e-5)
    # the first output carries them (DELTA: the first one only)
    delta = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=0,
                           output_kind=RequestOutputKind.DELTA)
    eng = engine(runner)
    eng.add_request("d", PROMPT, delta)
    outs = [o for _ in range(10) for o in eng.step()]
    assert outs[0].prompt_logprobs is not None and all(o.prompt_logprobs is None for o in outs[1:])


def test_prompt_logprobs_skip_the_prefix_cache_as_in_vllm():
    eng = engine(enable_prefix_caching=True)
    sp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    a = final(eng, "a", PROMPT, sp)
    b = final(eng, "b", PROMPT, sp)  # the same 20 tokens: one full block would be a cache hit
    assert b.num_cached_tokens == 0 and all(d is not None for d in b.prompt_logprobs[1:])
    assert [list(d) for d in a.prompt_logprobs[1:]] == [list(d) for d in b.prompt_logprobs[1:]]
    # vLLM skips only the reading: the blocks it computed are cached for others (one full block of 16 here).
    c = final(eng, "c", PROMPT, SamplingParams(temperature=0, max_tokens=2))
    assert c.num_cached_tokens == 16
    e = final(eng, "e", PROMPT, SamplingParams(temperature=0, max_tokens=2, skip_reading_prefix_cache=True))
    assert e.num_cached_tokens == 0 and e.prompt_logprobs is None  # the flag alone, as vLLM's SamplingParams
    stats = eng.engine_core.scheduler.kv_cache_manager.prefix_cache_stats
    assert stats.requests == 1 and stats.hits == 16  # only c's lookup is counted (vLLM record_prefix_cache_stats)


def _resume_hits(prompt_logprobs):
    """Run two 30-token prompts that cannot both grow to 70 tokens in 8 blocks of 16 (one is preempted and resumes);
    return the prefix-cache hit, in tokens, of every admission of a preempted request, and the outputs."""
    eng = LLMEngine("tiny", block_size=16, num_gpu_blocks=8, max_num_batched_tokens=64, max_model_len=128,
                    enable_prefix_caching=True)
    kvm = eng.engine_core.scheduler.kv_cache_manager
    real, hits = kvm.get_computed_blocks, []

    def spy(request):
        blocks, n = real(request)
        if request.num_preemptions > 0:
            hits.append(n)
        return blocks, n

    kvm.get_computed_blocks = spy
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=prompt_logprobs)
    eng.add_request("x", list(range(3, 33)), sp)
    eng.add_request("y", list(range(40, 70)), sp)
    outs = eng.run_to_completion(max_steps=500)
    return hits, outs


def test_prompt_logprobs_request_reads_no_cache_when_it_resumes_after_preemption():
    plain_hits, _ = _resume_hits(None)
    assert plain_hits and max(plain_hits) >= 16  # the control: a resumed request hits its own cached blocks
    hits, outs = _resume_hits(0)
    assert hits and all(n == 0 for n in hits)  # vLLM 0.32: skip_reading_prefix_cache holds on resumption too
    assert all(d is not None for o in outs.values() for d in o.prompt_logprobs[1:])


def test_prompt_logprobs_equal_log_softmax_of_a_full_forward():
    eng = engine()
    o = final(eng, "f", PROMPT, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    model = eng.model
    rid = "g"
    eng.model_runner.keep_hidden_states = True
    eng.add_request(rid, PROMPT, SamplingParams(temperature=0, max_tokens=1))
    eng.step()
    hidden = eng.model_runner.last_inputs.hidden_states
    with torch.inference_mode():
        lp = model.compute_logits(hidden).float().log_softmax(-1)
    for pos in range(1, len(PROMPT)):
        assert o.prompt_logprobs[pos][PROMPT[pos]].logprob == pytest.approx(lp[pos - 1, PROMPT[pos]].item(), abs=1e-5)


# ---- n > 1 and seeds -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_n3_with_a_seed_is_reproducible_and_child_i_uses_seed_plus_i(runner):
    sp = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=6, ignore_eos=True)
    first = final(engine(runner), "p", PROMPT, sp)
    again = final(engine(runner), "p", PROMPT, sp)
    assert [c.index for c in first.outputs] == [0, 1, 2] and first.finished
    toks = [list(c.token_ids) for c in first.outputs]
    assert toks == [list(c.token_ids) for c in again.outputs]
    assert len({tuple(t) for t in toks}) == 3
    for i in range(3):  # vLLM ParentRequest._get_child_sampling_params: seed + index
        single = final(engine(runner), "s", PROMPT, SamplingParams(temperature=1.0, seed=1234 + i, max_tokens=6,
                                                                   ignore_eos=True))
        assert list(single.outputs[0].token_ids) == toks[i]


def test_n_outputs_stream_with_their_index_and_abort_reaches_every_child():
    eng = engine()
    eng.add_request("p", PROMPT, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=3, ignore_eos=True,
                                                 output_kind=RequestOutputKind.DELTA))
    seen = {0: [], 1: []}
    while eng.has_unfinished_requests():
        for o in eng.step():
            assert o.request_id == "p"
            for c in o.outputs:
                seen[c.index] += c.token_ids
    assert [len(v) for v in seen.values()] == [3, 3] and not eng.output_processor.has_request("p")
    eng.add_request("q", PROMPT, SamplingParams(n=3, temperature=1.0, max_tokens=50, ignore_eos=True))
    eng.step()
    outs = eng.abort_request("q")
    assert outs[-1].finished and outs[-1].request_id == "q" and len(outs[-1].outputs) == 3
    assert {c.finish_reason for c in outs[-1].outputs} == {"abort"}
    assert not eng.has_unfinished_requests() and not eng.output_processor.has_request("q")
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("0_r", PROMPT, SamplingParams(max_tokens=50))
        eng.add_request("r", PROMPT, SamplingParams(n=2, max_tokens=5))


def test_negative_seed_is_a_seed_and_minus_one_is_none():
    a = final(engine(), "a", PROMPT, SamplingParams(temperature=1.0, seed=-7, max_tokens=5, ignore_eos=True))
    b = final(engine(), "b", PROMPT, SamplingParams(temperature=1.0, seed=-7, max_tokens=5, ignore_eos=True))
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    v2 = final(engine("v2"), "c", PROMPT, SamplingParams(temperature=1.0, seed=2**63 - 1, n=2, max_tokens=3))
    assert len(v2.outputs) == 2  # child 1's seed passes 2**63 - 1: wrapped to an int64 under V2


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_async_scheduling_and_chunking_give_the_same_tokens_and_logprobs(runner):
    sp = SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=6, ignore_eos=True, logprobs=2,
                        repetition_penalty=1.3, frequency_penalty=0.5, logit_bias={7: 5.0}, prompt_logprobs=1)
    outs = []
    for kw in (dict(), dict(async_scheduling=True), dict(budget=8, max_num_seqs=8)):
        o = final(engine(runner, **kw), "r", PROMPT, sp)
        outs.append(([list(c.token_ids) for c in o.outputs],
                     [d[t].logprob for c in o.outputs for d, t in zip(c.logprobs, c.token_ids)],
                     [d[t].logprob for d, t in zip(o.prompt_logprobs[1:], PROMPT[1:])]))
    for other in outs[1:]:
        assert other[0] == outs[0][0]
        assert other[1] == pytest.approx(outs[0][1], abs=1e-4) and other[2] == pytest.approx(outs[0][2], abs=1e-4)


def test_the_logprobs_tap_leaves_no_reference_cycle():
    """The engine wraps its scheduler's update_from_output (see LLMEngine._install_logprobs_tap): weakly, so a
    dropped engine is freed at once, without a garbage collection."""
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        eng = engine()
        final(eng, "a", PROMPT, SamplingParams(max_tokens=2, logprobs=1))
        ref = weakref.ref(eng.engine_core.scheduler)
        del eng
        assert ref() is None
    finally:
        gc.enable()


def test_n_is_bounded_and_the_prompt_is_checked_once_for_all_children():
    from minivllm import LLMEngine
    from minivllm.sampling_params import MAX_N_SEQUENCES

    with pytest.raises(ValueError, match=f"n must be at most {MAX_N_SEQUENCES}, got {MAX_N_SEQUENCES + 1}"):
        SamplingParams(n=MAX_N_SEQUENCES + 1, temperature=1.0)
    eng = LLMEngine("tiny", num_gpu_blocks=64, block_size=4)
    calls = []
    tokenize = eng.input_processor.tokenize
    eng.input_processor.tokenize = lambda p: calls.append(1) or tokenize(p)
    eng.add_request("p", [5, 6, 7], SamplingParams(n=50, temperature=1.0, seed=3, max_tokens=2))
    assert len(calls) == 1  # one validation, then 49 cheap copies (vLLM fans out after validating once)
    children = [eng.get_request(f"{i}_p") for i in range(50)]
    assert [c.sampling_params.seed for c in children[:3]] == [3, 4, 5] and all(c.sampling_params.n == 1 for c in children)
    assert len({id(c.prompt_token_ids) for c in children}) == 50  # each child its own token list
    out = eng.run_to_completion()["p"]
    assert sorted(c.index for c in out.outputs) == list(range(50))
