"""Sampling parameters at their limits, with tied logits (vLLM 0.32: ``vllm/v1/sample/ops/topk_topp_triton.py``,
the top-k/top-p kernel that keeps exactly k; ``topk_topp_sampler.py``, whose PyTorch fallback keeps ties)."""

import pytest
import torch

from minivllm import SamplingParams
from minivllm.worker.sampler import Sampler, SamplingMetadata, apply_top_k_top_p_min_p
from tests.conftest import make_tiny_engine

V = 64


def _tied_row():
    row = torch.full((V,), -3.0)
    row[[7, 20, 41]] = 2.0  # three tokens tied for the top
    row[[3, 50]] = 1.0  # two tied for fourth
    return row


def _sample(row, sp, seed):
    md = SamplingMetadata([sp], [torch.Generator().manual_seed(seed)], [0], [None], all_greedy=False)
    return int(Sampler(torch.Generator().manual_seed(0))(row[None].clone(), md)[0])


def _kept(row, **kw):
    out = apply_top_k_top_p_min_p(row.clone(), kw.get("top_k", 0), kw.get("top_p", 1.0), kw.get("min_p", 0.0))
    return torch.isfinite(out).nonzero().flatten().tolist()


def test_top_k_1_with_tied_logits_equals_greedy():
    row = _tied_row()
    greedy = int(row.argmax())
    assert greedy == 7  # argmax takes the first of the tied tokens
    drawn = {_sample(row, SamplingParams(temperature=1.0, top_k=1), seed) for seed in range(40)}
    assert drawn == {greedy}


@pytest.mark.parametrize("k,kept", [(1, [7]), (2, [7, 20]), (3, [7, 20, 41]), (4, [3, 7, 20, 41]),
                                    (5, [3, 7, 20, 41, 50])])
def test_top_k_keeps_exactly_k_lowest_ids_among_ties(k, kept):
    assert _kept(_tied_row(), top_k=k) == kept


def test_top_p_tie_at_the_boundary_keeps_the_lowest_ids():
    row = torch.full((V,), float("-inf"))
    row[[9, 4, 30]] = 0.0  # three tokens of probability 1/3 each
    assert _kept(row, top_p=0.5) == [4, 9]  # two are needed to reach 0.5: the lowest ids
    assert _kept(row, top_p=0.2) == [4]  # one is enough: the argmax
    assert _kept(row, top_p=1.0) == [4, 9, 30]


def test_tiny_top_p_and_top_k_1_equal_greedy_in_the_engine():
    prompt = [5, 6, 7, 8, 9]
    runs = {"greedy": SamplingParams(temperature=0, max_tokens=12),
            "top_k=1": SamplingParams(temperature=1.5, top_k=1, seed=3, max_tokens=12),
            "top_p tiny": SamplingParams(temperature=1.5, top_p=1e-6, seed=4, max_tokens=12)}
    eng = make_tiny_engine()
    for rid, sp in runs.items():
        eng.add_request(rid, prompt, sp)
    final = eng.run_to_completion()
    ref = final["greedy"].outputs[0].token_ids
    assert len(ref) == 12
    for rid in runs:
        assert final[rid].outputs[0].token_ids == ref, rid


def test_min_p_1_keeps_every_token_tied_with_the_top():
    # min_p is a threshold on probability, so ties at the top all stay (vLLM: probs < min_p * max_prob are dropped).
    assert _kept(_tied_row(), min_p=1.0) == [7, 20, 41]
