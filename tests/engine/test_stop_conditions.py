"""Which stop condition wins, and what text a stopped request gets (vLLM 0.32: ``vllm/v1/core/sched/utils.py``
``check_stop``; ``vllm/v1/engine/detokenizer.py`` and ``output_processor.py`` for the text).

vLLM tests EOS, then ``stop_token_ids``, then the length (``max_model_len`` or ``max_tokens``). So a token that is
both the last one ``max_tokens`` allows and EOS or a stop token finishes the request as ``"stop"``, and, as for any
``"stop"`` by token, its text is left out of the output unless ``include_stop_str_in_output``.
"""

import pytest

from minivllm import SamplingParams
from minivllm.core.sched.utils import check_stop
from minivllm.request import Request, RequestStatus
from tests.conftest import make_tiny_engine

EOS = 2


def _request(outputs, prompt_len=3, **params):
    sp = SamplingParams(**params)
    r = Request("r", list(range(10, 10 + prompt_len)), sp, eos_token_id=EOS)
    r.append_output_token_ids(list(outputs))
    return r


@pytest.mark.parametrize("limit", ["max_tokens", "max_model_len"])
def test_eos_as_last_allowed_token_is_stop(limit):
    r = _request([5, 6, EOS], max_tokens=3 if limit == "max_tokens" else 100)
    assert check_stop(r, max_model_len=6 if limit == "max_model_len" else 100)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.get_finished_reason() == "stop"
    assert r.stop_reason is None  # EOS leaves stop_reason None, as in vLLM


@pytest.mark.parametrize("limit", ["max_tokens", "max_model_len"])
def test_stop_token_as_last_allowed_token_is_stop(limit):
    r = _request([5, 6, 7], max_tokens=3 if limit == "max_tokens" else 100, stop_token_ids=[7])
    assert check_stop(r, max_model_len=6 if limit == "max_model_len" else 100)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 7


def test_ignored_eos_at_the_limit_is_length():
    r = _request([5, 6, EOS], max_tokens=3, ignore_eos=True)
    assert check_stop(r, max_model_len=100)
    assert r.get_finished_reason() == "length" and r.stop_reason is None


def test_engine_stop_token_at_max_tokens_is_stop():
    eng = make_tiny_engine()
    prompt = [5, 6, 7, 8]
    eng.add_request("free", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    free = eng.run_to_completion()["free"].outputs[0].token_ids
    last = free[3]
    assert last not in free[:3]  # the greedy tiny model's 4th token is new (else pick another position)
    eng.add_request("cut", prompt, SamplingParams(temperature=0, max_tokens=4, stop_token_ids=[last], ignore_eos=True))
    out = eng.run_to_completion()["cut"].outputs[0]
    assert out.token_ids == free[:4]
    assert (out.finish_reason, out.stop_reason) == ("stop", last)


def test_stop_token_text_left_out_at_max_tokens(real_llm):
    """The text of a stop token that is also the last allowed token is left out, like any stop token's."""
    tok = real_llm.get_tokenizer()
    prompt = "The capital of France is"
    free = real_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0]
    ids = free.token_ids
    # The first token after the first one that is new and visible (" Paris", "." ...).
    n = next(i + 1 for i in range(1, len(ids)) if ids[i] not in ids[:i] and tok.decode([ids[i]]).strip())
    stop_id = ids[n - 1]
    for include in (False, True):
        out = real_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, stop_token_ids=[stop_id],
                                                         include_stop_str_in_output=include), use_tqdm=False)
        o = out[0].outputs[0]
        assert o.token_ids == free.token_ids[:n]
        assert (o.finish_reason, o.stop_reason) == ("stop", stop_id)
        assert o.text == tok.decode(o.token_ids if include else o.token_ids[: n - 1])


def test_eos_at_max_tokens_text(real_llm):
    """EOS as the last allowed token: "stop"; with special tokens shown, its text only with
    include_stop_str_in_output (vLLM detokenizes the stop token only then)."""
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    free = real_llm.chat(msgs, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0].outputs[0]
    assert free.finish_reason == "stop" and free.token_ids[-1] == real_llm.llm_engine.eos_token_id
    n = len(free.token_ids)
    for include in (False, True):
        sp = SamplingParams(temperature=0, max_tokens=n, skip_special_tokens=False, include_stop_str_in_output=include)
        o = real_llm.chat(msgs, sp, use_tqdm=False)[0].outputs[0]
        assert o.token_ids == free.token_ids
        assert (o.finish_reason, o.stop_reason) == ("stop", None)
        assert o.text == free.text + ("<|im_end|>" if include else "")


def test_min_tokens_masks_eos_even_with_ignore_eos(real_llm):
    """vLLM's min_tokens processor bans every id of ``all_stop_token_ids``, which holds EOS even with
    ``ignore_eos=True`` (``SamplingParams.update_from_generation_config``)."""
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    eos = real_llm.llm_engine.eos_token_id
    free = real_llm.chat(msgs, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0].outputs[0]
    n = len(free.token_ids)  # EOS is its last token
    sp = SamplingParams(temperature=0, max_tokens=n + 2, min_tokens=n + 2, ignore_eos=True)
    o = real_llm.chat(msgs, sp, use_tqdm=False)[0].outputs[0]
    assert o.token_ids[: n - 1] == free.token_ids[: n - 1]
    assert eos not in o.token_ids and len(o.token_ids) == n + 2 and o.finish_reason == "length"
    # Past min_tokens, ignore_eos lets EOS through without stopping.
    sp = SamplingParams(temperature=0, max_tokens=n + 2, min_tokens=n - 1, ignore_eos=True)
    o = real_llm.chat(msgs, sp, use_tqdm=False)[0].outputs[0]
    assert o.token_ids[: n] == free.token_ids and o.finish_reason == "length"


def test_min_tokens_masks_stop_token_ids_for_greedy(real_llm):
    prompt = "The capital of France is"
    free = real_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0]
    stop_id = free.token_ids[1]
    o = real_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, min_tokens=3, stop_token_ids=[stop_id]),
                          use_tqdm=False)[0].outputs[0]
    assert o.token_ids[0] == free.token_ids[0] and o.token_ids[1] != stop_id
    assert stop_id not in o.token_ids[:3]
