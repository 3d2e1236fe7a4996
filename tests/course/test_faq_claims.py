"""The answers of notebook 10 (FAQ), asserted on the tiny model so that a broken claim fails with a clear name.

Each test is named after its question (q1 ... q9) and checks the same behaviour the notebook demonstrates:
Q1 when a request is scheduled again, Q2 when a KV connector sees a request again, Q3-Q5 the waiting-loop gate,
where preempted requests go, the admission gate and why it cannot deadlock, Q6-Q9 what the chunks of a chunked
prefill compute, need and output. The scenarios are the notebook's, with the tiny random-weight model in place of
SmolLM2 for Q6-Q9.
"""

import re
from unittest import mock

import pytest
import torch

import minivllm.attention.paged_attention as paged_attention
from minivllm import LLMEngine, SamplingParams
from minivllm.course.trace import TracedLLMEngine
from minivllm.core.sched.scheduler import Scheduler
from minivllm.course.buggy_connector import BuggyOffloadConnector
from minivllm.course.recording_connector import RecordingConnector
from minivllm.distributed.kv_transfer import KVBlockStore, OffloadConnector
from minivllm.worker.model_runner import CachedRequestState

LONG_PROMPT = list(range(100, 260))  # 160 tokens


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def tiny(**kw):
    kw.setdefault("enable_prefix_caching", False)
    return TracedLLMEngine("tiny", **kw)


def run_counting_peeks(engine, before_step=None):
    """Step until done; per step, how often the waiting loop peeked at the queue and how many requests waited."""
    peeks, waiting_before, final = [], [], {}
    peek = engine.scheduler.waiting.peek_request

    def counting_peek():
        peeks[-1] += 1
        return peek()

    engine.scheduler.waiting.peek_request = counting_peek
    while engine.has_unfinished_requests():
        if before_step is not None:
            before_step(len(peeks))
        peeks.append(0)
        waiting_before.append(len(engine.scheduler.waiting))
        final.update((o.request_id, o) for o in engine.step() if o.finished)
    return peeks, waiting_before, final


def preemption_scenario(**kw):
    """Notebook 10's [Q3-a]: A, B, C (8-token prompts, 20 outputs) in 9 blocks of 4; D arrives before step 12."""
    eng = tiny(block_size=4, num_gpu_blocks=9, max_num_batched_tokens=64, **kw)
    for i, rid in enumerate("ABC"):
        eng.add_request(rid, list(range(10 * i + 1, 10 * i + 9)), greedy(20))

    def add_d(k):
        if k == 12:
            eng.add_request("D", [200, 201, 202], greedy(3))

    peeks, waiting_before, final = run_counting_peeks(eng, add_d)
    return eng, peeks, waiting_before, final


@pytest.fixture(scope="module")
def preempt_run():
    return preemption_scenario()


# ---- Q1 ---------------------------------------------------------------------------------------------------------
def test_q1_request_scheduled_per_chunk_per_decode_and_again_after_preemption():
    eng = tiny(block_size=16, num_gpu_blocks=12, max_num_batched_tokens=64, record_inputs=True)
    eng.add_request("A", list(range(1, 21)), greedy(8))
    eng.add_request("B", LONG_PROMPT, greedy(4))
    eng.run_to_completion()
    tr = eng.trace
    assert tr.chunk_sizes("A", kind=None) == [20] + [1] * 7
    assert tr.chunk_sizes("B") == [44, 63, 53, 64, 64, 33]
    assert tr.preemptions() == [(3, "B")]
    assert tr.steps_of("B") == [0, 1, 2, 8, 9, 10, 11, 12]
    assert tr[8].resumed == ["B"] and tr[8].num_computed_before["B"] == 0
    assert tr[1].kinds == {"A": "decode", "B": "prefill"}  # no separate prefill and decode phases


def test_q1_never_twice_in_one_step(preempt_run):
    eng, _, _, _ = preempt_run
    for s in eng.trace:
        assert not set(s.preempted) & set(s.num_scheduled_tokens)
        assert not set(s.new) & set(s.resumed)
        assert len(s.new) + len(s.resumed) + sum(
            1 for r in s.num_scheduled_tokens if r not in s.new and r not in s.resumed
        ) == len(s.num_scheduled_tokens)


def test_q1_num_computed_tokens_advances_inside_schedule():
    eng = tiny(max_num_batched_tokens=64)
    eng.add_request("B", LONG_PROMPT, greedy(1))
    so = eng.scheduler.schedule()
    assert so.num_scheduled_tokens == {"B": 64}
    assert eng.get_request("B").num_computed_tokens == 64


# ---- Q2 ---------------------------------------------------------------------------------------------------------
B_PROMPT = list(range(100, 112))


def _warm_store():
    store = KVBlockStore()
    eng = LLMEngine("tiny", kv_connector=OffloadConnector(4, store=store), block_size=4, num_gpu_blocks=8)
    eng.add_request("B0", B_PROMPT, greedy(4))
    eng.run_to_completion()
    return store


def _connector_run(connector):
    conn = RecordingConnector(connector, record_layers=False)
    eng = tiny(kv_connector=conn, block_size=4, num_gpu_blocks=8)
    eng.add_request("A", list(range(1, 25)), greedy(3))
    eng.add_request("C", [7, 8], greedy(10))
    eng.add_request("B", B_PROMPT, greedy(3))
    b_request = eng.get_request("B")  # the engine drops finished requests: keep B's while it is live
    eng.run_to_completion()
    return eng, b_request


def _calls(eng, name, req_id=None):
    return [s.step for s in eng.trace for d in s.connector_calls
            if d["call"] == name and (req_id is None or d.get("req_id") == req_id)]


def _loads(eng):
    return [d["meta"]["load"] for s in eng.trace for d in s.connector_calls if d["call"] == "build_connector_meta"]


def test_q2_build_connector_meta_once_per_step_and_waiting_request_asked_every_step():
    eng, b_request = _connector_run(OffloadConnector(4, store=_warm_store()))
    n = len(eng.trace)
    assert _calls(eng, "build_connector_meta") == list(range(n))
    assert _calls(eng, "get_num_new_matched_tokens", "B") == [0, 1, 2, 3]
    assert _calls(eng, "update_state_after_alloc", "B") == [3]
    assert _loads(eng) == [{}, {}, {}, {"B": 2}] + [{}] * (n - 4)
    cached_c = [s.step for s in eng.trace for d in s.connector_calls
                if d["call"] == "build_connector_meta" and "C" in d["cached"]]
    assert cached_c == list(range(1, 10))


def test_q2_connector_offers_whole_blocks_before_the_last_prompt_token():
    eng, b_request = _connector_run(OffloadConnector(4, store=_warm_store()))
    store = eng.scheduler.connector.store
    assert all(store.contains(h) for h in b_request.block_hashes[:3])  # all 3 prompt blocks stored
    offered = [d["result"][0] for s in eng.trace for d in s.connector_calls
               if d["call"] == "get_num_new_matched_tokens" and d["req_id"] == "B"]
    assert set(offered) == {(len(B_PROMPT) - 1) // 4 * 4} == {8}  # the block holding the last token is computed


def test_q2_buggy_connector_emits_the_same_request_every_step():
    eng, b_request = _connector_run(BuggyOffloadConnector(4, store=_warm_store()))
    loads = _loads(eng)
    last_b = eng.trace.steps_of("B")[-1]
    assert all("B" in m for m in loads)
    assert [m["B"] for m in loads] == [0, 0, 0, 2, 2, 2] + [0] * (len(loads) - 6)
    assert last_b == 5 and len(loads) > last_b + 1  # emitted also after B finished


def test_q2_async_load_steps_without_tokens_still_build_meta_and_alloc_twice():
    conn = RecordingConnector(OffloadConnector(4, load_mode="async", async_load_delay_steps=2, store=_warm_store()),
                              record_layers=False)
    eng = tiny(kv_connector=conn, block_size=4, num_gpu_blocks=8)
    eng.add_request("B", B_PROMPT, greedy(3))
    checks = []
    check = eng.scheduler._update_waiting_for_remote_kv

    def counting_check(request):
        checks.append(len(eng.trace))
        return check(request)

    eng.scheduler._update_waiting_for_remote_kv = counting_check
    eng.run_to_completion()
    # visited every step, scheduled (an entry in num_scheduled_tokens) only once the load has finished
    assert [eng.trace[k].requests["B"].status for k in (0, 1, 2)] == ["WAITING_FOR_REMOTE_KVS"] * 3
    assert checks == [1, 2, 3] and eng.trace.steps_of("B")[0] == 3 and eng.trace[3].new == ["B"]
    assert [s.total_scheduled for s in eng.trace][:3] == [0, 0, 0]
    assert _calls(eng, "build_connector_meta") == list(range(len(eng.trace)))
    allocs = [d["num_external_tokens"] for s in eng.trace for d in s.connector_calls
              if d["call"] == "update_state_after_alloc"]
    assert _calls(eng, "update_state_after_alloc", "B") == [0, 3] and allocs == [8, 0]


# ---- Q3 ---------------------------------------------------------------------------------------------------------
def test_q3_waiting_loop_skipped_exactly_in_preempting_steps(preempt_run):
    eng, peeks, waiting_before, _ = preempt_run
    preempting = [s.step for s in eng.trace if s.preempted]
    assert preempting == [5, 9, 24]
    for s in eng.trace:
        if s.preempted:
            assert peeks[s.step] == 0
        elif waiting_before[s.step]:
            assert peeks[s.step] >= 1
    for k in preempting:  # not a persistent state: the next step runs the loop while the victim still waits
        assert set(eng.trace[k].preempted) <= set(eng.trace[k + 1].waiting) and peeks[k + 1] >= 1


def test_q3_resumed_and_new_requests_admitted_by_the_same_loop(preempt_run):
    eng, peeks, _, _ = preempt_run
    assert eng.trace[20].resumed == ["B", "C"] and peeks[20] == 3
    assert eng.trace[31].resumed == ["C"] and eng.trace[31].new == ["D"]


def test_q3_request_that_fits_is_not_admitted_in_a_preempting_step():
    eng = tiny(block_size=4, num_gpu_blocks=5, max_num_batched_tokens=64, scheduling_policy="priority")
    eng.add_request("A", list(range(1, 9)), greedy(6), priority=0)
    eng.add_request("V", list(range(11, 19)), greedy(6), priority=5)
    peeks, *_ = run_counting_peeks(eng, lambda k: k == 1 and eng.add_request("W", [300], greedy(2), priority=1))
    s1 = eng.trace[1]
    assert s1.preempted == ["V"] and "W" in s1.waiting and peeks[1] == 0
    assert s1.num_free_blocks >= 1 and s1.token_budget - s1.total_scheduled >= 1
    assert len(s1.running) < s1.max_num_seqs
    assert eng.trace[2].new == ["W"] and "V" in eng.trace[2].waiting
    # priority: the later, better-priority arrival W is admitted before the preempted V, which returns in step 6
    assert eng.trace.steps_of("V")[1] == 6 and eng.trace[6].resumed == ["V"]


# ---- Q4 ---------------------------------------------------------------------------------------------------------
def test_q4_preempted_reqs_is_a_local_of_schedule(preempt_run):
    eng, _, _, _ = preempt_run
    assert "preempted_reqs" in Scheduler.schedule.__code__.co_varnames
    assert not hasattr(eng.scheduler, "preempted_reqs")
    # SchedulerOutput.preempted_req_ids is built from the local list: this step's victims only
    assert [eng.trace[k].preempted for k in (4, 5, 6)] == [[], ["C"], []]


def test_q4_victim_goes_to_front_of_waiting_reset_and_comes_back_resumed(preempt_run):
    eng, _, _, _ = preempt_run
    for k, rid in eng.trace.preemptions():
        snap = eng.trace[k].requests[rid]
        assert eng.trace[k].waiting[0] == rid
        assert snap.status == "PREEMPTED" and snap.num_computed_tokens == 0 and snap.block_ids == []
        assert snap.num_output_tokens > 0
        back = next(s for s in eng.trace.steps[k + 1:] if rid in s.resumed)
        assert rid in eng.trace[back.step - 1].waiting
        assert back.num_computed_before[rid] == 0 and back.num_scheduled_tokens[rid] == snap.num_tokens


def test_q4_outputs_equal_run_without_preemption(preempt_run):
    eng, _, _, final = preempt_run
    roomy = tiny(block_size=4, num_gpu_blocks=64)
    for i, rid in enumerate("ABC"):
        roomy.add_request(rid, list(range(10 * i + 1, 10 * i + 9)), greedy(20))
    out = roomy.run_to_completion()
    assert roomy.num_preemptions == 0
    for rid in "ABC":
        assert final[rid].outputs[0].token_ids == out[rid].outputs[0].token_ids


# ---- Q5 ---------------------------------------------------------------------------------------------------------
def test_q5_no_deadlock_but_thrashing(preempt_run):
    eng, _, _, final = preempt_run
    tr = eng.trace
    assert sorted(r for s in tr for r in s.finished) == ["A", "B", "C", "D"]
    assert all(s.total_scheduled > 0 for s in tr)
    assert all(s.running[0] in s.num_scheduled_tokens for s in tr if s.running)
    assert final["C"].num_preemptions == 2 and final["A"].num_preemptions == 0
    assert {r: tr.recomputed_tokens(r) for r in "ABCD"} == {"A": 0, "B": 16, "C": 28, "D": 0}
    # the same from first principles: every token scheduled minus the distinct positions that needed KV
    # (prompt + outputs - 1: the last sampled token is never fed back)
    for r in "ABCD":
        out = final[r]
        needed = len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1
        assert tr.recomputed_tokens(r) == sum(tr.chunk_sizes(r, kind=None)) - needed


def test_q5_prefix_caching_reduces_recompute(preempt_run):
    eng, _, _, _ = preempt_run
    cached, *_ = preemption_scenario(enable_prefix_caching=True)
    assert cached.trace.preemptions() == eng.trace.preemptions()
    for rid in "BC":
        assert cached.trace.recomputed_tokens(rid) < eng.trace.recomputed_tokens(rid)


def test_q5_request_that_never_fits_is_refused(preempt_run):
    eng, _, _, _ = preempt_run
    with pytest.raises(ValueError, match="could never be scheduled"):
        eng.add_request("huge", list(range(1, 41)), greedy(1))
    assert "huge" not in eng.scheduler.requests


def test_q5_pool_too_small_for_max_model_len_is_refused():
    with pytest.raises(ValueError, match="max_model_len"):
        LLMEngine("tiny", block_size=4, num_gpu_blocks=9, max_model_len=40)


def test_q5_admission_gate_needs_the_whole_prompt_free_then_allocates_per_chunk():
    eng = tiny(block_size=16, num_gpu_blocks=12, max_num_batched_tokens=128)
    eng.add_request("A", list(range(1, 51)), greedy(4))
    eng.add_request("B", LONG_PROMPT, greedy(1))
    gate = eng.kv_cache_manager.num_blocks_to_admit(eng.get_request("B"))
    eng.run_to_completion()
    assert gate == 10
    waiting = [s for s in eng.trace if "B" in s.waiting]
    assert [s.step for s in waiting] == [0, 1, 2, 3]
    for s in waiting:
        first_chunk_blocks = -(-min(160, s.token_budget - s.total_scheduled) // 16)
        assert first_chunk_blocks <= s.num_free_blocks < gate  # the first chunk would fit, the whole prompt not
        assert "B" not in s.num_scheduled_tokens
    assert eng.trace[4].new == ["B"] and eng.trace[4].num_scheduled_tokens["B"] == 128
    assert [len(eng.trace[k].requests["B"].block_ids) for k in (4, 5)] == [8, 10]


# ---- Q6-Q9 (tiny model, 160-token prompt, budget 64) ------------------------------------------------------------
def run_prompt(budget, params, after_step=None, keep_hidden=False, **kw):
    eng = TracedLLMEngine("tiny", max_num_batched_tokens=budget, num_gpu_blocks=32, record_inputs=True, **kw)
    eng.model_runner.keep_logits = True
    eng.model_runner.keep_hidden_states = keep_hidden
    eng.add_request("q", LONG_PROMPT, params)
    returned, logits, hidden = [], [], []
    while eng.has_unfinished_requests():
        returned.append(eng.step())
        li = eng.model_runner.last_inputs
        logits.append(li.logits.clone())
        hidden.append(li.hidden_states.clone() if keep_hidden else None)
        if after_step is not None:
            after_step(eng, len(returned) - 1)
    return eng, returned, logits, hidden


@pytest.fixture(scope="module")
def chunked():
    return run_prompt(64, greedy(8))


@pytest.fixture(scope="module")
def unchunked():
    return run_prompt(256, greedy(8), keep_hidden=True)


def test_q6_later_chunks_differ_only_in_inputs(chunked):
    eng = chunked[0]
    assert eng.trace.chunk_sizes("q") == [64, 64, 32]
    assert [("q" in s.new) for s in eng.trace.steps[:3]] == [True, False, False]
    for s, start, q in zip(eng.trace.steps[:3], [0, 64, 128], [64, 64, 32]):
        x = s.inputs
        assert x["num_computed_tokens"] == [start] and x["seq_lens"] == [start + q]
        assert x["positions"] == list(range(start, start + q))
        assert x["input_ids"] == LONG_PROMPT[start:start + q]
        table = s.requests["q"].block_ids
        assert len(table) == -(-(start + q) // 16)
        assert x["slot_mapping"] == [table[p // 16] * 16 + p % 16 for p in x["positions"]]


def test_q6_later_chunks_need_chunk1_only_through_its_kv(chunked, unchunked):
    _, _, logits_c, _ = chunked
    _, _, logits_u, _ = unchunked
    assert torch.allclose(logits_c[2], logits_u[0], atol=1e-4)
    assert chunked[1][-1][0].outputs[0].token_ids == unchunked[1][-1][0].outputs[0].token_ids

    def zero_chunk1(eng, k):
        if k == 0:
            ids = eng.kv_cache_manager.get_block_ids("q")[:4]
            for cache in eng.model_runner.kv_caches:
                cache[:, ids] = 0.0

    _, _, logits_z, _ = run_prompt(64, greedy(1), zero_chunk1)
    assert (logits_z[2] - logits_u[0]).abs().max().item() > 0.1
    assert not any("hidden" in f or "logit" in f for f in CachedRequestState.__dataclass_fields__)


def test_q6_inspection_switches_are_never_read_back(chunked):
    # keep_logits / keep_hidden_states only fill last_inputs; dropping it after every step changes no bit
    eng = LLMEngine("tiny", max_num_batched_tokens=64, num_gpu_blocks=32)
    eng.model_runner.keep_logits = True
    eng.model_runner.keep_hidden_states = True
    eng.add_request("q", LONG_PROMPT, greedy(1))
    logits = []
    while eng.has_unfinished_requests():
        eng.step()
        logits.append(eng.model_runner.last_inputs.logits.clone())
        eng.model_runner.last_inputs = None
    assert len(logits) == 3 and torch.equal(logits[2], chunked[2][2])


def test_q7_later_chunks_attend_to_earlier_chunks_and_to_themselves(unchunked):
    mask = paged_attention.chunk_causal_mask(64, 64)
    assert tuple(mask.shape) == (64, 128) and bool(mask[:, :64].all())
    assert torch.equal(mask[:, 64:], torch.ones(64, 64, dtype=torch.bool).tril())
    logits_u = unchunked[2]

    def only_earlier(num_computed, query_len, device=None):
        keys = torch.arange(num_computed + query_len, device=device)
        return (keys < num_computed)[None, :].expand(query_len, -1)

    def no_causal(num_computed, query_len, device=None):
        return torch.ones(query_len, num_computed + query_len, dtype=torch.bool, device=device)

    for wrong in (only_earlier, no_causal):
        with mock.patch.object(paged_attention, "chunk_causal_mask", wrong):
            _, _, logits_w, _ = run_prompt(64, greedy(1))
        # float rounding alone stays below 1e-4 (test_q6); a wrong mask moves the logits by far more
        assert (logits_w[2] - logits_u[0]).abs().max().item() > 1e-2, wrong.__name__


def test_q8_each_chunk_one_lm_head_row_sampled_and_discarded_except_the_last(chunked, unchunked):
    eng, returned, logits, _ = chunked
    steps = eng.trace.steps[:3]
    assert [s.inputs["positions"][s.inputs["logits_indices"][0]] for s in steps] == [63, 127, 159]
    assert [tuple(l.shape) for l in logits[:3]] == [(1, 512)] * 3
    assert [s.inputs["discard_mask"] for s in steps] == [[True], [True], [False]]
    assert [s.num_scheduled_tokens["q"] - len(s.inputs["logits_indices"]) for s in steps] == [63, 63, 31]
    assert returned[0] == [] and returned[1] == []
    assert returned[2][0].new_token_ids == [steps[2].inputs["sampled"][0]] == returned[-1][0].outputs[0].token_ids[:1]
    hidden_u = unchunked[3][0]
    row63 = eng.model.compute_logits(hidden_u[63:64])
    assert torch.allclose(logits[0], row63, atol=1e-4)  # a real prediction for position 64
    assert logits[0].argmax() == row63.argmax()


def test_q9_kv_of_earlier_chunks_reused_by_a_later_request():
    eng, _, _, _ = run_prompt(64, greedy(1), enable_prefix_caching=True)
    eng.add_request("again", LONG_PROMPT, greedy(1))
    out = eng.run_to_completion()["again"]
    assert out.num_cached_tokens == 144 and eng.trace.chunk_sizes("again") == [16]


def test_q9_seeded_stream_untouched_by_discarded_draws():
    params = SamplingParams(temperature=0.8, seed=42, max_tokens=12, ignore_eos=True)
    fresh = torch.Generator().manual_seed(42).get_state()
    states = {}

    def record(eng, k):
        states[k] = eng.model_runner.requests["q"].generator.get_state()

    _, returned_c, _, _ = run_prompt(64, params, record)
    _, returned_u, _, _ = run_prompt(256, params)
    assert torch.equal(states[0], fresh) and torch.equal(states[1], fresh)
    assert not torch.equal(states[2], fresh)
    assert returned_c[-1][0].outputs[0].token_ids == returned_u[-1][0].outputs[0].token_ids


# --- Claims added with the vLLM-0.32 scoping of the notebooks (05, 06, 10) --------------------------------------


def test_q6_no_chunk_size_threshold_ignored_for_a_lone_request():
    # 05 / Q6: a chunk is what the budget leaves, capped by long_prefill_token_threshold only when more than one
    # request is running or waiting (vLLM 0.32 scheduler.py L645).
    alone = tiny(max_num_batched_tokens=64, long_prefill_token_threshold=48)
    alone.add_request("q", LONG_PROMPT, greedy(1))
    alone.run_to_completion()
    assert alone.trace.chunk_sizes("q") == [64, 64, 32]
    pair = tiny(max_num_batched_tokens=64, long_prefill_token_threshold=48)
    pair.add_request("q", LONG_PROMPT, greedy(1))
    pair.add_request("o", list(range(1, 21)), greedy(1))
    pair.run_to_completion()
    assert pair.trace.chunk_sizes("q") == [48, 48, 64]  # capped while "o" is there, whole budget once it is done


def test_q8_discard_rule_is_known_sequence_not_prompt():
    # Q8 / 05: a resumed request's recompute chunk that ends exactly at the end of the prompt is still discarded,
    # because its known sequence (prompt + the output generated before the preemption) is not finished.
    def run(num_gpu_blocks):
        eng = tiny(block_size=16, num_gpu_blocks=num_gpu_blocks, max_num_batched_tokens=64, record_inputs=True)
        eng.add_request("A", list(range(1, 41)), greedy(40))
        eng.add_request("B", list(range(100, 228)), greedy(12))  # 128-token prompt
        return eng, eng.run_to_completion()

    eng, outs = run(11)
    assert eng.trace.preemptions() == [(3, "B")]
    s = next(s for s in eng.trace if s.step > 3 and s.num_computed_before.get("B") == 64)
    assert s.num_computed_before["B"] + s.num_scheduled_tokens["B"] == 128  # the chunk finishes the prompt ...
    assert s.inputs["discard_mask"][s.inputs["req_ids"].index("B")] is True  # ... and its token is discarded
    _, ref = run(64)
    assert {k: o.outputs[0].token_ids for k, o in outs.items()} == {k: o.outputs[0].token_ids for k, o in ref.items()}


def test_course_links_between_notebooks_resolve():
    # 10_faq linked 08's section 6 by an old title; every "NN_name.ipynb#anchor" link must name a heading of the
    # target notebook (JupyterLab's anchors: the heading's text, backticks dropped, spaces as "-").
    import json
    import re
    from pathlib import Path

    nbdir = Path(__file__).resolve().parents[2] / "notebooks"
    heads, links = {}, []
    for f in sorted(nbdir.glob("*.ipynb")):
        cells = [c for c in json.loads(f.read_text())["cells"] if c["cell_type"] == "markdown"]
        text = "\n".join("".join(c["source"]) for c in cells)
        heads[f.name] = {re.sub("`", "", m).strip().replace(" ", "-") for m in re.findall(r"^#+\s+(.*)$", text, re.M)}
        links += [(f.name, t, a) for t, a in re.findall(r"\]\((\d\d_\w+\.ipynb)(?:#([^)\s]+))?\)", text)]
    assert len(links) >= 20
    bad = [(src, t, a) for src, t, a in links if t not in heads or (a and a not in heads[t])]
    assert bad == []


def test_notebooks_name_the_pinned_vllm_release():
    # The course pins vLLM 0.32.0 and names 0.33.0 beside it (issue 25): a notebook that speaks of 0.33 also names
    # 0.32, the release it describes; no later release is cited.
    from pathlib import Path

    import json

    release = r"(?i)(vllm[ -]?|\bv)0\.{minor}\b|\b0\.{minor}\.\d|\b0\.{minor}:"
    for f in sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb")):
        # sources and outputs only: the execution timestamps in cell metadata ("14:57:10.339408Z") may contain it
        cells = json.loads(f.read_text())["cells"]
        text = json.dumps([(c["source"], c.get("outputs")) for c in cells])
        if re.search(release.format(minor=33), text):
            assert re.search(release.format(minor=32), text), f"{f.name} speaks of 0.33 and never names 0.32"
        for minor in (34, 35):
            assert not re.search(release.format(minor=minor), text), f"{f.name} cites 0.{minor}"
