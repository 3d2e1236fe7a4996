"""Odd inputs and vLLM's stop-string rules, at the engine boundary."""

import numpy as np
import pytest

from minivllm import SamplingParams
from minivllm.engine.detokenizer import IncrementalDetokenizer
from minivllm.model.loader import default_model_path
from minivllm.model.tokenizer import load_tokenizer
from tests.conftest import make_tiny_engine


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_model_path())


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_temperature_is_rejected(value):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=value)


def test_float_token_ids_are_rejected_and_numpy_ints_accepted():
    eng = make_tiny_engine()
    with pytest.raises(ValueError, match="prompt_token_ids must be ints, got 1.5"):
        eng.add_request("a", [1.5, 2])
    with pytest.raises(ValueError, match="prompt_token_ids must be ints"):
        eng.add_request("a", {"prompt_token_ids": [True, 2]})
    assert not eng.has_unfinished_requests()
    eng.add_request("b", list(np.array([3, 4], dtype=np.int64)))
    assert eng.get_request("b").prompt_token_ids == [3, 4]


def test_the_stop_string_that_completes_first_wins_ties_in_list_order(tok):
    # vLLM 0.32 check_stop_strings: what feeding one token at a time would find, whatever the list order.
    det = IncrementalDetokenizer.from_new_request(tok, SamplingParams(stop=["b", "a"]))
    stop = det.update(tok.encode("xa b c", add_special_tokens=False), False)
    assert stop == "a" and det.output_text == "x"
    det = IncrementalDetokenizer.from_new_request(tok, SamplingParams(stop=["c", "b c"]))
    assert det.update(tok.encode("xa b c", add_special_tokens=False), False) == "c"   # both end at 6: list order
    det = IncrementalDetokenizer.from_new_request(tok, SamplingParams(stop=["b c", "c"]))
    assert det.update(tok.encode("xa b c", add_special_tokens=False), False) == "b c" and det.output_text == "xa "


@pytest.mark.parametrize("stop, include, final", [(["is Paris"], False, "The capital of France "),
                                                   (["is Paris"], True, "The capital of France is Paris"),
                                                   (["@@@@@@@"], False, "The capital of France is Paris.")])
def test_streamed_text_never_passes_the_stop_cut(tok, stop, include, final):
    # vLLM's get_next_output_text: max(len(stop)) - 1 characters held back while running, released at the end.
    ids = tok.encode("The capital of France is Paris.", add_special_tokens=False)
    det = IncrementalDetokenizer.from_new_request(tok, SamplingParams(stop=stop, include_stop_str_in_output=include))
    hold = 0 if include else max(map(len, stop)) - 1
    deltas = []
    for k, t in enumerate(ids):
        finished = det.update([t], False) is not None or k == len(ids) - 1
        cumulative = det.get_next_output_text(finished, delta=False)
        deltas.append(det.get_next_output_text(finished, delta=True))
        assert final.startswith(cumulative) and "".join(deltas) == cumulative
        if not finished:
            assert cumulative == det.output_text[:max(len(det.output_text) - hold, 0)]
        else:
            break
    assert "".join(deltas) == det.output_text == final


def test_stop_strings_wait_for_min_tokens(tok):
    ids = tok.encode(" one two one two", add_special_tokens=False)
    det = IncrementalDetokenizer.from_new_request(tok, SamplingParams(stop=["one"], min_tokens=len(ids)))
    for t in ids:                       # never more than min_tokens tokens: no stop yet
        assert det.update([t], False) is None
    assert det.update(tok.encode(" three one", add_special_tokens=False), False) == "one"
    # Found only in the text added after min_tokens was passed, not in the earlier occurrences.
    assert det.output_text == " one two one two three "


@pytest.mark.parametrize("seed", [2**64, 2**63, -2**63 - 1, True])
def test_out_of_range_seed_is_rejected_up_front(seed):
    with pytest.raises(ValueError, match=r"seed must be an int64 \(in \[-2\*\*63, 2\*\*63 - 1\]"):
        SamplingParams(seed=seed)
    if seed != -2**63 - 1:
        with pytest.raises(ValueError, match="seed must be"):
            make_tiny_engine(seed=seed)


def test_request_seed_takes_vllms_range():
    """vLLM accepts any int64 seed; -1 means none (SamplingParams.__post_init__)."""
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=-5).seed == -5
    assert SamplingParams(seed=-2**63).seed == -2**63


@pytest.mark.parametrize("kw, match", [({"arrival_time": "soon"}, "arrival_time"),
                                       ({"arrival_time": float("nan")}, "arrival_time"),
                                       ({"priority": "high"}, "priority"), ({"priority": 1.5}, "priority")])
def test_bad_arrival_time_or_priority_leaves_the_priority_queue_intact(kw, match):
    eng = make_tiny_engine(scheduling_policy="priority", num_gpu_blocks=8, block_size=4)
    eng.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=3))
    with pytest.raises(ValueError, match=match):
        eng.add_request("b", [4, 5, 6], SamplingParams(temperature=0, max_tokens=3), **kw)
    outs = eng.run_to_completion(max_steps=50)
    assert list(outs) == ["a"] and eng.kv_cache_manager.num_free_blocks == 8


def test_sampling_params_priority_must_be_int():
    with pytest.raises(ValueError, match="priority"):
        SamplingParams(priority=None)


@pytest.mark.parametrize("value", [2.5, "4", -1])
def test_long_prefill_token_threshold_must_be_a_non_negative_int(value):
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        make_tiny_engine(long_prefill_token_threshold=value)


def test_abort_accepts_int_ids_and_rejects_none():
    eng = make_tiny_engine()
    eng.add_request(5, [1, 2, 3], SamplingParams(max_tokens=3))
    assert [o.outputs[0].finish_reason for o in eng.abort_request(5)] == ["abort"]
    with pytest.raises(ValueError, match="request_ids"):
        eng.abort_request(None)


def test_bad_device_is_a_value_error():
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        make_tiny_engine(device="meta")


def test_generate_priority_length_and_chat_messages_are_checked():
    from minivllm import LLM

    llm = LLM("tiny")
    with pytest.raises(ValueError, match="priority has 1 entries for 2 prompts"):
        llm.generate([[1], [2]], priority=[0], use_tqdm=False)


def test_chat_rejects_malformed_messages(real_llm):
    for bad in [{"role": "user", "content": "hi"}, [{"role": "user"}], [{"role": "user", "content": None}], []]:
        with pytest.raises(ValueError, match="message"):
            real_llm.chat(bad, use_tqdm=False)
    assert not real_llm.llm_engine.has_unfinished_requests()


def test_stop_token_text_is_left_out_like_vllm(real_llm):
    tok = real_llm.get_tokenizer()
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    first = real_llm.chat(msgs, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].outputs[0]
    stop_id = first.token_ids[1]
    for include in (False, True):
        out = real_llm.chat(msgs, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_id],
                                                 include_stop_str_in_output=include), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == first.token_ids[:2] and out.finish_reason == "stop" and out.stop_reason == stop_id
        assert out.text == tok.decode(out.token_ids if include else out.token_ids[:1])
    # EOS is a special token: with skip_special_tokens=False it would show, unless left out as a stop token.
    full = real_llm.chat(msgs, SamplingParams(temperature=0, max_tokens=16, skip_special_tokens=False),
                         use_tqdm=False)[0].outputs[0]
    assert full.finish_reason == "stop" and full.text == "The capital of France is Paris."
