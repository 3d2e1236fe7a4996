"""Streaming outputs from ``LLMEngine.step()``: stop strings held back, output kinds, finished requests dropped.

vLLM 0.32 (``vllm/v1/engine/detokenizer.py``, ``get_next_output_text``) holds back the last
``max(len(s) for s in stop) - 1`` characters of a running request's text, so no streamed text (delta or cumulative)
ever shows characters that a stop string completed later cuts away; the window is released as new text pushes it
out, or when the request finishes. With ``include_stop_str_in_output=True`` nothing is held back.
"""

import pytest

from minivllm import LLMEngine, SamplingParams
from minivllm.model.tokenizer import apply_chat_template

MSGS = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def eng(real_llm):
    return real_llm.llm_engine


def _prompt(eng):
    return {"prompt_token_ids": apply_chat_template(eng.tokenizer, MSGS)}


def _stream(eng, params):
    """Step one request to the end; returns every ``RequestOutput`` it produced, in order, each with
    ``(text, number of token ids, new_text, finished)`` taken when it was returned (cumulative outputs share one
    growing token list, so the count must be read at once)."""
    rid = eng.add_request(None, _prompt(eng), params)
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.request_id == rid]
        if outs:
            o = outs[-1]
            o.snapshot = (o.outputs[0].text, len(o.outputs[0].token_ids), o.new_text, o.finished)
    return outs


def _snapshot(outs):
    return [o.snapshot for o in outs]


def greedy(**kw):
    kw.setdefault("max_tokens", 16)
    return SamplingParams(temperature=0, **kw)


def test_stop_string_never_streams_past_the_cut(eng):
    # Without a stop: "The capital of France is Paris." The stop "is Paris" starts in the token " is", which is
    # emitted one step before " Paris" completes the stop string: that " is" must never be streamed.
    full = _stream(eng, greedy())[-1].outputs[0].text
    assert full == "The capital of France is Paris."
    eng.add_request("cut", _prompt(eng), greedy(stop=["is Paris"]))
    deltas, final = [], None
    while eng.has_unfinished_requests():
        for o in eng.step():
            deltas.append(o.new_text)
            assert final is None or not o.finished
            assert full.startswith(o.outputs[0].text)
            if o.finished:
                final = o.outputs[0]
            else:  # mid-stream cumulative text is a prefix of the final text
                assert "The capital of France ".startswith(o.outputs[0].text), o.outputs[0].text
    assert (final.text, final.finish_reason, final.stop_reason) == ("The capital of France ", "stop", "is Paris")
    assert "".join(deltas) == final.text


@pytest.mark.parametrize("include", [False, True])
def test_held_back_window_is_released_at_finish(eng, include):
    # A stop string that never matches: 7 characters, so 6 are held back while the request runs (none with
    # include_stop_str_in_output), and all come out when it finishes by length.
    outs = _snapshot(_stream(eng, greedy(stop=["@@@@@@@"], include_stop_str_in_output=include)))
    tok = eng.tokenizer
    final_text, n, _, finished = outs[-1]
    assert finished and final_text == "The capital of France is Paris." and "".join(d for *_, d, _ in outs) == final_text
    ids = _stream(eng, greedy())[-1].outputs[0].token_ids
    hold = 0 if include else 6
    for text, n, _, finished in outs[:-1]:
        decoded = tok.decode(ids[:n], skip_special_tokens=True)
        assert not finished and text == decoded[: max(len(decoded) - hold, 0)]
    if not include:  # the last step (EOS, no text of its own) released the window
        assert len(final_text) - len(outs[-2][0]) == hold


def test_delta_outputs_add_up_and_final_only_returns_one_output(eng):
    from minivllm.sampling_params import RequestOutputKind

    cumulative = _stream(eng, greedy(stop=["France is"]))
    final = cumulative[-1].outputs[0]
    assert final.text == "The capital of " and final.finish_reason == "stop"
    delta = _stream(eng, greedy(stop=["France is"], output_kind=RequestOutputKind.DELTA))
    assert "".join(o.outputs[0].text for o in delta) == final.text
    assert [t for o in delta for t in o.outputs[0].token_ids] == final.token_ids
    assert all(len(o.outputs[0].token_ids) <= 1 for o in delta)
    [only] = _stream(eng, greedy(stop=["France is"], output_kind=RequestOutputKind.FINAL_ONLY))
    assert only.finished and only.outputs[0].text == final.text and only.outputs[0].token_ids == final.token_ids


def test_abort_releases_the_held_back_text(eng):
    eng.add_request("a", _prompt(eng), greedy(stop=["@@@@@@@"], max_tokens=8))
    streamed = ""
    for _ in range(4):
        for o in eng.step():
            streamed += o.new_text
    [out] = eng.abort_request("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    n = len(out.outputs[0].token_ids)
    assert n == 4  # the prefill step's token, then one per step
    text = eng.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    assert streamed + out.new_text == out.outputs[0].text == text
    assert streamed == text[:-6]  # the window of len("@@@@@@@") - 1 characters came out only now


def test_finished_requests_are_dropped_and_outputs_are_not_copied_per_step():
    eng = LLMEngine("tiny", enable_prefix_caching=False)
    eng.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=5))
    lists = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            lists.append(o.outputs[0].token_ids)
            if not o.finished:
                assert eng.get_request("a").num_output_tokens == len(o.outputs[0].token_ids)
    assert len(lists) == 5 and all(x is lists[0] for x in lists)  # one growing list handed out, no copies
    with pytest.raises(KeyError, match="'a' is not a live request"):
        eng.get_request("a")
    assert not eng.output_processor.request_states and not eng.engine_core.scheduler.requests
