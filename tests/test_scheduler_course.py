"""The numbers that notebooks 05 (chunked prefill) and 06 (preemption) state, asserted on the engine.

Each test rebuilds a notebook's scenario with the same settings. All of them use the tiny random-weight model: the
tiny model has no EOS token, so every request runs to ``max_tokens`` and the schedule depends only on token
counts, exactly as in the notebooks (05 runs the same 160-token schedule on SmolLM2; its prompt lengths are used
here).
"""

import pytest
import torch

from minivllm import SamplingParams
from minivllm.course.trace import TracedLLMEngine
from minivllm.utils.math_utils import cdiv

GREEDY = SamplingParams(temperature=0, max_tokens=1)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The tiny model gains nothing from a second thread, and loses a lot when the other core is busy."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def engine05(budget, **kw):
    """Notebook 05's engine settings: block size 16, 64 blocks, no prefix caching, batch inputs recorded."""
    kw.setdefault("num_gpu_blocks", 64)
    return TracedLLMEngine("tiny", max_num_batched_tokens=budget, enable_prefix_caching=False, record_inputs=True, **kw)


def engine06(num_gpu_blocks, policy="fcfs", prefix_caching=False):
    """Notebook 06's engine settings: block size 4, a small pool."""
    return TracedLLMEngine("tiny", block_size=4, num_gpu_blocks=num_gpu_blocks, scheduling_policy=policy,
                     enable_prefix_caching=prefix_caching)


def prompt(i, length):
    return [10 + 7 * i + j for j in range(length)]


PROMPT_160 = [(37 * i) % 500 + 1 for i in range(160)]


# ---- notebook 05: chunked prefill ---------------------------------------------------------------------------
def test_160_token_prompt_at_budget_64_is_scheduled_64_64_32():
    eng = engine05(64)
    eng.add_request("rhine", PROMPT_160, SamplingParams(temperature=0, max_tokens=4))
    returned = [eng.step() for _ in range(3)]
    assert eng.trace.chunk_sizes("rhine") == [64, 64, 32]
    assert [s.num_computed_before["rhine"] for s in eng.trace.steps[:3]] == [0, 64, 128]
    # earlier chunks return nothing to the caller; the last chunk returns the first token
    assert returned[0] == [] and returned[1] == []
    assert len(returned[2]) == 1 and len(returned[2][0].new_token_ids) == 1

    expected = [
        # positions, seq_lens, query_start_loc, block_table, logits_indices, discard_mask
        (range(0, 64), [64], [0, 64], [0, 1, 2, 3], [63], [True]),
        (range(64, 128), [128], [0, 64], [0, 1, 2, 3, 4, 5, 6, 7], [63], [True]),
        (range(128, 160), [160], [0, 32], list(range(10)), [31], [False]),
    ]
    for s, (pos, seq_lens, qsl, table, logits_idx, discard) in zip(eng.trace.steps, expected):
        inp = s.inputs
        assert inp["positions"] == list(pos)
        assert inp["input_ids"] == PROMPT_160[pos.start:pos.stop]
        assert inp["seq_lens"] == seq_lens
        assert inp["query_start_loc"] == qsl
        assert inp["block_table"] == [table]
        assert inp["slot_mapping"] == [table[p // 16] * 16 + p % 16 for p in pos]
        assert inp["logits_indices"] == logits_idx
        assert inp["discard_mask"] == discard
    # the discarded tokens never reach the request: its first output is the last chunk's sample
    assert eng.get_request("rhine").output_token_ids[0] == eng.trace[2].inputs["sampled"][0]


def _last_chunk_logits(wipe_first_chunk: bool):
    eng = engine05(64)
    eng.model_runner.keep_logits = True
    eng.add_request("p", PROMPT_160, GREEDY)
    eng.step()
    if wipe_first_chunk:
        blocks = eng.kv_cache_manager.get_block_ids("p")
        assert blocks == [0, 1, 2, 3]
        for kv in eng.model_runner.kv_caches:
            kv[:, blocks] = 0.0
    eng.step()
    eng.step()
    assert eng.trace.chunk_sizes("p") == [64, 64, 32]
    return eng.model_runner.last_inputs.logits[0].clone()


def test_later_chunks_need_the_first_only_through_the_kv_cache():
    ref = engine05(2048)
    ref.model_runner.keep_logits = True
    ref.add_request("p", PROMPT_160, GREEDY)
    ref.step()
    assert ref.trace.chunk_sizes("p") == [160]
    unchunked = ref.model_runner.last_inputs.logits[0]
    assert torch.allclose(_last_chunk_logits(False), unchunked, atol=1e-4)
    wiped = _last_chunk_logits(True)
    assert not torch.allclose(wiped, unchunked, atol=1e-4)
    assert (wiped - unchunked).abs().max() > 0.1  # far beyond float rounding (1e-6)


def _seeded_run(budget, consume_discarded=False):
    eng = engine05(budget)
    eng.add_request("s", PROMPT_160, SamplingParams(temperature=1.0, seed=42, max_tokens=16))
    fresh = torch.Generator().manual_seed(42).get_state()
    untouched, final = [], None
    while eng.has_unfinished_requests():
        final = next((o for o in eng.step() if o.finished), final)
        inp = eng.trace[-1].inputs
        if inp["discard_mask"][0]:
            gen = eng.model_runner.requests["s"].generator
            untouched.append(torch.equal(gen.get_state(), fresh))
            if consume_discarded:
                torch.empty(eng.vocab_size).exponential_(generator=gen)
    return untouched, final.outputs[0].token_ids


def test_discarded_samples_leave_the_seeded_stream_untouched():
    untouched, chunked = _seeded_run(64)
    assert untouched == [True, True]
    none, unchunked = _seeded_run(2048)
    assert none == []
    assert chunked == unchunked
    # the check can fail: without the restore, the same run samples other tokens
    _, consumed = _seeded_run(64, consume_discarded=True)
    assert consumed != unchunked


def _mix(budget, **kw):
    """Notebook 05 section 7 with its prompt lengths: decoders of 37 and 38 tokens, a 354-token prompt at step 4."""
    eng = engine05(budget, **kw)
    eng.add_request("fr", prompt(0, 37), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    eng.add_request("sea", prompt(1, 38), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    final = {}
    while eng.has_unfinished_requests():
        if len(eng.trace) == 4:
            eng.add_request("long", prompt(2, 354), SamplingParams(temperature=0, max_tokens=6))
        final.update((o.request_id, o.outputs[0].token_ids) for o in eng.step() if o.finished)
    return eng, final


def test_long_prefill_mixed_with_decodes():
    (chunked, chunked_out), (whole, whole_out) = _mix(64), _mix(1024, enable_chunked_prefill=False)
    assert chunked.trace.chunk_sizes("long") == [62, 62, 62, 62, 62, 44]
    assert whole.trace.chunk_sizes("long") == [354]

    def largest_step_fr_waited_for(eng):
        return max(s.total_scheduled for s in eng.trace if s.kinds.get("fr") == "decode")

    assert largest_step_fr_waited_for(chunked) == 64
    assert largest_step_fr_waited_for(whole) == 356
    for rid in ("fr", "sea", "long"):
        assert chunked_out[rid] == whole_out[rid]
    mixed = next(s for s in chunked.trace if s.kinds.get("long") == "prefill" and s.num_computed_before["long"] > 0)
    assert mixed.step == 5
    assert mixed.inputs["req_ids"] == ["fr", "sea", "long"]
    assert mixed.inputs["query_start_loc"] == [0, 1, 2, 64]
    assert mixed.inputs["logits_indices"] == [0, 1, 63]
    assert mixed.inputs["discard_mask"] == [False, False, True]
    assert mixed.inputs["positions"][2:] == list(range(62, 124))
    # the decoders hold blocks 0-5, so the long prompt's slots are not its positions
    assert mixed.requests["long"].block_ids == list(range(6, 14))
    assert mixed.inputs["slot_mapping"][2:] == list(range(6 * 16 + 62, 6 * 16 + 124))


@pytest.mark.parametrize("prompt_len,budget,num_decoding,expected", [
    (160, 64, 0, [64, 64, 32]), (160, 64, 2, [62, 62, 36]), (100, 32, 3, [29, 29, 29, 13]),
    (50, 64, 1, [50]), (64, 64, 1, [63, 1]),
    (20, 4, 4, []),  # the decoders use the whole budget (and every seat): the prompt gets nothing while they run
])
def test_running_decodes_take_the_budget_first(prompt_len, budget, num_decoding, expected):
    """Notebook 05's exercise (predict_chunks) and its checker: the same cases, the same bounded loop."""
    eng = TracedLLMEngine("tiny", max_num_batched_tokens=budget, enable_prefix_caching=False)
    for i in range(num_decoding):
        eng.add_request(f"d{i}", [7 + i], SamplingParams(temperature=0, max_tokens=1000))
    eng.step()
    eng.add_request("p", list(range(1, prompt_len + 1)), GREEDY)
    for _ in range(prompt_len + 5):  # enough for any prompt that gets at least one token per step
        if "p" not in eng.scheduler.requests:
            break
        eng.step()
    assert eng.trace.chunk_sizes("p") == expected
    assert ("p" in eng.scheduler.requests) == (expected == [])
    if expected == []:  # ... while every decoder ran in every step
        assert all(len(s.num_scheduled_tokens) == num_decoding for s in eng.trace[1:])


# ---- notebook 06: preemption --------------------------------------------------------------------------------
def _three_requests(num_gpu_blocks=9):
    eng = engine06(num_gpu_blocks)
    for i, rid in enumerate("ABC"):
        eng.add_request(rid, prompt(i, 8), SamplingParams(temperature=0, max_tokens=20))
    return eng


def _token_ids(outputs):
    return {rid: o.outputs[0].token_ids for rid, o in outputs.items()}


def test_three_requests_in_nine_blocks():
    assert 3 * cdiv(8 + 20 - 1, 4) == 21
    eng = _three_requests()
    out = eng.run_to_completion()
    assert len(eng.trace) == 42
    assert eng.trace.preemptions() == [(5, "C"), (9, "B"), (24, "C")]
    s = eng.trace[5]
    assert s.waiting[0] == "C" and s.running == ["A", "B"]
    snap = s.requests["C"]
    assert (snap.status, snap.num_computed_tokens, snap.block_ids, snap.num_preemptions) == ("PREEMPTED", 0, [], 1)
    resumes = [(s.step, s.num_scheduled_tokens["C"], s.requests["C"].num_output_tokens)
               for s in eng.trace if "C" in s.resumed]
    assert resumes == [(20, 13, 5), (31, 17, 9)]
    roomy = _three_requests(64)
    assert _token_ids(roomy.run_to_completion()) == _token_ids(out) and roomy.num_preemptions == 0


def test_what_preemption_resets_and_keeps():
    eng = _three_requests()
    for _ in range(5):
        eng.step()
    c = eng.get_request("C")
    kept = list(c.output_token_ids)
    assert (c.num_computed_tokens, len(kept), c.num_tokens) == (12, 5, 13)
    assert {r: eng.kv_cache_manager.get_block_ids(r) for r in "ABC"} == {"A": [0, 1, 6], "B": [2, 3, 7], "C": [4, 5, 8]}
    eng.step()
    assert eng.trace.preemptions() == [(5, "C")]
    assert (c.status.name, c.num_computed_tokens, c.num_tokens, c.num_preemptions) == ("PREEMPTED", 0, 13, 1)
    assert c.output_token_ids == kept
    assert eng.scheduler.queue_snapshot() == (["C"], ["A", "B"])
    assert {r: eng.kv_cache_manager.get_block_ids(r) for r in "ABC"} == {"A": [0, 1, 6, 4], "B": [2, 3, 7, 5], "C": []}
    assert eng.kv_cache_manager.num_free_blocks == 1


ARRIVALS = [(0, "low", 1, 8, 20), (2, "high", 0, 8, 20), (10, "w", 0, 4, 3)]


def _arrivals_run(policy):
    eng = engine06(9, policy)
    pending = sorted(ARRIVALS)
    while pending or eng.has_unfinished_requests():
        while pending and pending[0][0] <= len(eng.trace):
            step, rid, priority, length, max_tokens = pending.pop(0)
            eng.add_request(rid, prompt(len(eng.scheduler.requests), length),
                            SamplingParams(temperature=0, max_tokens=max_tokens), arrival_time=float(step),
                            priority=priority)
        eng.step()
    return eng


def test_no_waiting_request_is_admitted_in_a_step_that_preempted():
    eng = _arrivals_run("priority")
    gate, after = eng.trace[11], eng.trace[12]
    assert gate.preempted == ["low"] and gate.waiting == ["w", "low"]
    assert gate.num_free_blocks == 4 >= cdiv(gate.requests["w"].num_tokens, 4) == 1
    assert gate.new == [] and gate.resumed == []
    assert after.preempted == [] and after.new == ["w"]
    # and in every run of the notebook: a preempting step admits nobody, yet every request finishes
    runs = [eng, _arrivals_run("fcfs"), _three_requests(), _thrash_run()[0]]
    runs[2].run_to_completion()
    for run in runs:
        assert run.trace.preemptions()
        for s in run.trace:
            if s.preempted:
                assert s.new == [] and s.resumed == []
        assert not run.has_unfinished_requests()


def _thrash_run(num_gpu_blocks=12, prefix_caching=False, seeded=False):
    eng = engine06(num_gpu_blocks, prefix_caching=prefix_caching)
    for i, (rid, n) in enumerate({"A": 30, "B": 8, "C": 12, "D": 16, "E": 20}.items()):
        sp = SamplingParams(temperature=1.0, seed=100 + i, max_tokens=n) if seeded else \
            SamplingParams(temperature=0, max_tokens=n)
        eng.add_request(rid, prompt(i, 4), sp)
    return eng, eng.run_to_completion()


def test_thrashing_costs_recomputed_tokens_but_not_output():
    eng, out = _thrash_run()
    assert eng.trace.preemptions() == [(5, "E"), (9, "E"), (13, "E"), (25, "E")]
    assert out["E"].num_preemptions == 4
    assert eng.trace.chunk_sizes("E") == [4, 9, 10, 11, 20]
    assert {r: eng.trace.recomputed_tokens(r) for r in "ABCDE"} == {"A": 0, "B": 0, "C": 0, "D": 0, "E": 46}
    # notebook 06: E needed 4 + 20 - 1 = 23 positions, was scheduled 69 tokens: 46 computed twice, 2.0x the need
    assert sum(eng.trace.chunk_sizes("E", kind=None)) - (4 + 20 - 1) == 46
    assert sum(s.total_scheduled for s in eng.trace) == 147
    roomy, roomy_out = _thrash_run(64)
    assert roomy.num_preemptions == 0 and _token_ids(roomy_out) == _token_ids(out)
    seeded, seeded_out = _thrash_run(12, seeded=True)
    roomy_seeded, roomy_seeded_out = _thrash_run(64, seeded=True)
    assert seeded.num_preemptions == 4 and roomy_seeded.num_preemptions == 0
    assert _token_ids(seeded_out) == _token_ids(roomy_seeded_out)


def test_prefix_caching_cuts_the_recompute():
    eng, _ = _thrash_run(prefix_caching=True)
    assert eng.trace.preemptions() == [(5, "E"), (9, "E"), (13, "E"), (25, "E")]
    assert eng.trace.chunk_sizes("E") == [4, 9, 10, 3, 8]
    # the last two resumes start from 8 and 12 cached tokens, so they compute only 3 and 8
    assert [s.num_computed_before["E"] for s in eng.trace if "E" in s.resumed] == [0, 0, 8, 12]
    assert eng.trace.recomputed_tokens("E") == 26
    assert sum(eng.trace.chunk_sizes("E", kind=None)) - (4 + 20 - 1) == 26


def test_fcfs_preempts_the_newest_priority_the_least_important():
    fcfs, prio = _arrivals_run("fcfs"), _arrivals_run("priority")
    assert fcfs.trace[10].running == prio.trace[10].running == ["low", "high"]
    assert fcfs.trace.preemptions() == [(11, "high")]
    assert prio.trace.preemptions() == [(11, "low")]
    finished = lambda eng: {rid: s.step for s in eng.trace for rid in s.finished}  # noqa: E731
    assert finished(fcfs) == {"low": 19, "w": 22, "high": 30}
    assert finished(prio) == {"w": 14, "high": 21, "low": 30}
