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


def test_stop_strings_are_tried_in_list_order(tok):
    det = IncrementalDetokenizer(tok, SamplingParams(stop=["b", "a"]))
    text, stop = det.update(tok.encode("xa b c", add_special_tokens=False))
    assert stop == "b" and det.output_text == "xa "


def test_stop_strings_wait_for_min_tokens(tok):
    ids = tok.encode(" one two one two", add_special_tokens=False)
    det = IncrementalDetokenizer(tok, SamplingParams(stop=["one"], min_tokens=len(ids)))
    for t in ids:                       # never more than min_tokens tokens: no stop yet
        assert det.update([t])[1] is None
    assert det.update(tok.encode(" three one", add_special_tokens=False))[1] == "one"
    # Found only in the text added after min_tokens was passed, not in the earlier occurrences.
    assert det.output_text == " one two one two three "
