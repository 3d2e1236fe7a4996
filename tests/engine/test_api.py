"""The vLLM-style API: LLM.generate / chat, LLMEngine step-by-step streaming, the CLI."""

import os
import subprocess
import sys

from minivllm import LLM, LLMEngine, SamplingParams
from tests.conftest import make_tiny_engine, run_all


def test_generate_returns_outputs_in_input_order():
    llm = LLM("tiny", enable_prefix_caching=False)
    prompts = [[1, 2, 3], {"prompt_token_ids": [9] * 40}, [5, 6]]
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=m) for m in (3, 7, 5)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 7, 5]
    assert [o.prompt_token_ids for o in outs] == [[1, 2, 3], [9] * 40, [5, 6]]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)


def test_batched_equals_one_at_a_time():
    prompts = [[(i * 31 + j) % 500 for j in range(5 + 7 * i)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=10)
    batched = LLM("tiny").generate(prompts, params, use_tqdm=False)
    for p, b in zip(prompts, batched):
        solo = LLM("tiny").generate([p], params, use_tqdm=False)[0]
        assert solo.outputs[0].token_ids == b.outputs[0].token_ids


def test_rejected_batch_queues_nothing():
    llm = LLM("tiny")
    try:
        llm.generate([[1, 2], []], SamplingParams(max_tokens=2), use_tqdm=False)
    except ValueError as e:
        assert "empty prompt" in str(e)
    else:
        raise AssertionError("an empty prompt must be rejected")
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.kv_cache_manager.num_free_blocks == llm.llm_engine.cache_config.num_gpu_blocks


def test_streaming_pieces_add_up_to_the_final_text(real_llm):
    eng = real_llm.llm_engine
    eng.add_request("s", "The three primary colours are", SamplingParams(temperature=0, max_tokens=24))
    pieces, ids, final = [], [], None
    while eng.has_unfinished_requests():
        for o in eng.step():
            pieces.append(o.new_text)
            ids += o.new_token_ids
            if o.finished:
                final = o
    assert "".join(pieces) == final.outputs[0].text
    assert ids == final.outputs[0].token_ids
    assert final.outputs[0].text == real_llm.get_tokenizer().decode(ids, skip_special_tokens=True)


def test_engine_config_defaults_follow_vllm():
    eng = make_tiny_engine()
    assert eng.cache_config.block_size == 16
    assert eng.scheduler_config.max_num_batched_tokens == 2048
    assert eng.scheduler_config.max_num_seqs == 256
    assert eng.scheduler_config.enable_chunked_prefill
    assert LLMEngine("tiny").cache_config.enable_prefix_caching


def test_run_to_completion_returns_every_request():
    eng = make_tiny_engine(num_gpu_blocks=16, block_size=4)
    for i in range(5):
        eng.add_request(None, [i + 1] * (3 + i), SamplingParams(temperature=0, max_tokens=4))
    outs = run_all(eng)
    assert sorted(outs) == ["0", "1", "2", "3", "4"]


def test_cli_generate_prints_text_and_summary():
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "minivllm", "generate", "The capital of France is", "--max-tokens", "4"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "[minivllm] 1 request(s), 4 steps" in r.stdout and "output tok/s" in r.stdout
