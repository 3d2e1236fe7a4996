"""The ``attention_backend`` engine argument takes a backend of one's own (issue 26): an ``AttentionBackend`` subclass
is the backend the model runner uses, chosen once at start-up by ``minivllm.attention.selector``; a bad value is
refused before anything is built, naming the parameter and the choices."""

from __future__ import annotations

from typing import Type

import pytest
import torch

from minivllm import LLMEngine, SamplingParams
from minivllm.attention.backend import AttentionImpl
from minivllm.attention.backends.reference import ReferenceAttentionBackend, ReferenceAttentionImpl
from minivllm.attention.selector import BACKENDS, get_attn_backend
from minivllm.engine.arg_utils import EngineArgs

PROMPTS = {"a": [1, 2, 3, 4, 5, 6, 7], "b": list(range(20, 45)), "c": [9, 8, 7]}


class CountingImpl(ReferenceAttentionImpl):
    """The reference attention, counting forward calls and the query tokens they computed."""

    calls = 0
    tokens = 0

    def forward(self, query, key, value, kv_cache, attn_metadata):
        CountingImpl.calls += 1
        CountingImpl.tokens += query.shape[0]
        return super().forward(query, key, value, kv_cache, attn_metadata)


class CountingBackend(ReferenceAttentionBackend):
    """A backend of one's own: the reference backend's metadata, a counting implementation."""

    @staticmethod
    def get_name() -> str:
        return "COUNTING"

    @staticmethod
    def get_impl_cls() -> Type[AttentionImpl]:
        return CountingImpl


def greedy_run(attention_backend):
    eng = LLMEngine("tiny", block_size=4, num_gpu_blocks=40, max_num_batched_tokens=16,
                    attention_backend=attention_backend)
    for rid, prompt in PROMPTS.items():
        eng.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    out = {rid: list(o.outputs[0].token_ids) for rid, o in eng.run_to_completion().items()}
    return eng, out


def test_a_backend_class_is_the_one_the_runner_uses_and_gives_the_same_greedy_tokens():
    CountingImpl.calls = CountingImpl.tokens = 0
    eng, out = greedy_run(CountingBackend)
    assert eng.model_runner.attn_backend is CountingBackend
    layers = eng.model.model.layers
    assert all(type(layer.self_attn.impl) is CountingImpl for layer in layers)
    # every layer ran in every step: 35 prompt tokens and 3 x 5 decode tokens, per layer
    assert CountingImpl.tokens == len(layers) * (sum(map(len, PROMPTS.values())) + 3 * 5)
    assert CountingImpl.calls % len(layers) == 0 and CountingImpl.calls > 0
    _, by_name = greedy_run("reference")
    _, default = greedy_run(None)
    assert out == by_name == default
    assert sorted(out) == ["a", "b", "c"] and all(len(t) == 6 for t in out.values())


@pytest.mark.parametrize("bad", ["FLASH_ATTN", 3, dict, ReferenceAttentionImpl])
def test_a_bad_attention_backend_is_refused_before_anything_is_built(bad):
    with pytest.raises(ValueError, match=r"attention_backend must be one of \[.*'REFERENCE'.*\].*AttentionBackend"):
        EngineArgs("tiny", attention_backend=bad).create_engine_config()
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        get_attn_backend(torch.device("cpu"), torch.float32, bad)


def test_names_still_choose_the_built_in_backends():
    assert get_attn_backend(torch.device("cpu"), torch.float32, "torch_sdpa") is BACKENDS["TORCH_SDPA"]
    assert get_attn_backend(torch.device("cpu"), torch.float32, CountingBackend) is CountingBackend
    EngineArgs("tiny", attention_backend="Reference").create_engine_config()
