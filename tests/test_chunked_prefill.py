"""Chunked prefill: exact chunk sizes, and the same tokens for every token budget."""

import pytest

from minivllm import SamplingParams
from tests.conftest import make_tiny_engine, run_all

PROMPT = [(7 * i + 3) % 500 + 1 for i in range(37)]


def _generate(budget, prompt=PROMPT, params=None, **kw):
    eng = make_tiny_engine(max_num_batched_tokens=budget, max_num_seqs=min(budget, 256), traced=True, **kw)
    eng.add_request("r", {"prompt_token_ids": prompt}, params or SamplingParams(temperature=0, max_tokens=8))
    return run_all(eng)["r"], eng


def test_160_token_prompt_at_budget_64_runs_as_64_64_32():
    out, eng = _generate(64, prompt=list(range(1, 161)))
    assert eng.trace.chunk_sizes("r") == [64, 64, 32]
    # Each chunk starts where the previous one ended.
    assert [eng.trace[s].num_computed_before["r"] for s in range(3)] == [0, 64, 128]
    # Blocks of 16 tokens: 4, then 8, then 10 held after each chunk.
    assert [len(eng.trace[s].requests["r"].block_ids) for s in range(3)] == [4, 8, 10]
    # Then one decode token per step.
    assert eng.trace.chunk_sizes("r", kind="decode") == [1] * 7


def test_every_budget_gives_the_unchunked_tokens():
    ref, _ = _generate(2048)
    for budget in range(1, len(PROMPT) + 1):
        out, eng = _generate(budget)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids, f"budget {budget}"
        sizes = eng.trace.chunk_sizes("r")
        assert sum(sizes) == len(PROMPT) and all(s == budget for s in sizes[:-1]), (budget, sizes)


def test_partial_prefill_emits_nothing_and_samples_are_discarded():
    eng = make_tiny_engine(max_num_batched_tokens=16, max_num_seqs=4, record_inputs=True)
    eng.add_request("r", {"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=2))
    emitted = [eng.step() for _ in range(3)]
    assert emitted[0] == [] and emitted[1] == []          # 16 + 16 of 37 tokens: partial, no output
    assert [o.new_token_ids for o in emitted[2]] and len(emitted[2][0].new_token_ids) == 1
    # The LM head ran on exactly one row per step (the chunk's last position) and it was discarded.
    for k in range(2):
        inp = eng.trace[k].inputs
        assert inp["logits_indices"] == [15] and inp["discard_mask"] == [True]
    assert eng.trace[2].inputs["discard_mask"] == [False]


@pytest.mark.parametrize("budget", [5, 16, 37])
def test_seeded_sampling_is_independent_of_chunking(budget):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12)
    ref, _ = _generate(2048, params=params)
    out, _ = _generate(budget, params=params)
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_long_prefill_token_threshold_caps_each_request():
    eng = make_tiny_engine(max_num_batched_tokens=64, long_prefill_token_threshold=24, traced=True)
    for rid in "ab":
        eng.add_request(rid, {"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=1))
    run_all(eng)
    assert eng.trace[0].num_scheduled_tokens == {"a": 24, "b": 24}
    assert eng.trace.chunk_sizes("a") == [24, 13]


def test_chunked_prefill_off_admits_whole_prompts_only():
    eng = make_tiny_engine(max_num_batched_tokens=40, max_model_len=40, enable_chunked_prefill=False,
                           traced=True)
    eng.add_request("a", {"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=3))
    eng.add_request("b", {"prompt_token_ids": PROMPT[:10]}, SamplingParams(temperature=0, max_tokens=3))
    run_all(eng)
    # a (37 tokens) fills the step; b cannot be split, so it waits (strict FCFS: the loop stops).
    assert eng.trace[0].num_scheduled_tokens == {"a": 37}
    assert eng.trace[1].num_scheduled_tokens == {"a": 1, "b": 10}
