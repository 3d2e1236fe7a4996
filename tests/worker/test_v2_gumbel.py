"""Model Runner V2's stateless seeded sampling (``minivllm/worker/v2/gumbel.py``) against MurmurHash3 and against
vLLM 0.32.0's own kernel."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import torch

from minivllm.worker.v2.gumbel import gumbel_noise, gumbel_sample, murmur3_hash32

DATA = os.path.join(os.path.dirname(__file__), "data", "vllm_v2_gumbel_tokens.json")


def murmur3_reference(data: bytes, seed: int = 0) -> int:
    """MurmurHash3_x86_32 over little-endian 32-bit blocks, in plain Python ints (the published algorithm)."""
    m = 0xFFFFFFFF
    h = seed
    for i in range(0, len(data), 4):
        (k,) = struct.unpack("<I", data[i:i + 4])
        k = (k * 0xCC9E2D51) & m
        k = ((k << 15) | (k >> 17)) & m
        k = (k * 0x1B873593) & m
        h ^= k
        h = ((h << 13) | (h >> 19)) & m
        h = (h * 5 + 0xE6546B64) & m
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & m
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & m
    return h ^ (h >> 16)


def test_the_reference_is_murmur3():
    assert murmur3_reference(b"test") == 0xBA6BD213  # the published test vector
    assert murmur3_reference(b"") == 0


def test_hash_equals_murmur3_of_seed_position_and_token():
    seeds, positions = [0, 1, 12345678901234567, 2**63 - 1], [0, 5, 100000, 2**33 + 3]
    keys = torch.arange(7)
    for s in seeds:
        for p in positions:
            got = murmur3_hash32(torch.tensor([s]), torch.tensor([p]), keys)[0].tolist()
            want = [murmur3_reference(struct.pack("<IIII", s & 0xFFFFFFFF, s >> 32, p & 0xFFFFFFFF, k))
                    for k in range(7)]
            assert got == want, (s, p)


def _vllm_inputs():
    r, v = np.arange(48)[:, None], np.arange(700)[None, :]
    logits = torch.from_numpy((2.5 * np.sin(r * 7.1 + v * 0.37) + np.cos(v * 1.3)).astype(np.float32))
    seeds = torch.tensor([(i * 0x9E3779B97F4A7C15) % 2**63 for i in range(48)], dtype=torch.int64)
    pos = torch.tensor([i * 37 % 1000 for i in range(48)], dtype=torch.int64)
    temp = torch.tensor([0.5 + (i % 5) * 0.25 for i in range(48)], dtype=torch.float32)
    return logits, seeds, pos, temp


def test_tokens_equal_vllm_v2_gumbel_sample():
    # The fixture was drawn by vLLM's own kernel (see its "about"): same seeds, positions and logits, same tokens.
    with open(DATA) as f:
        want = json.load(f)["tokens"]
    logits, seeds, pos, temp = _vllm_inputs()
    assert gumbel_sample(logits / temp[:, None], seeds, pos).tolist() == want


def test_a_row_depends_only_on_its_seed_position_and_logits():
    logits, seeds, pos, temp = _vllm_inputs()
    scaled = logits / temp[:, None]
    full = gumbel_sample(scaled, seeds, pos)
    alone = [int(gumbel_sample(scaled[i:i + 1], seeds[i:i + 1], pos[i:i + 1])) for i in (0, 17, 47)]
    assert alone == [int(full[0]), int(full[17]), int(full[47])]
    shuffled = torch.tensor([5, 3, 40, 0])
    assert gumbel_sample(scaled[shuffled], seeds[shuffled], pos[shuffled]).tolist() == full[shuffled].tolist()
    # Another position or another seed draws other noise.
    n = gumbel_noise(torch.tensor([7, 7, 8]), torch.tensor([3, 4, 3]), 50)
    assert not torch.equal(n[0], n[1]) and not torch.equal(n[0], n[2])


def test_draws_follow_the_softmax():
    # 20000 positions of one seeded request over fixed logits: the frequencies are softmax(logits) within 3 sigma.
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf")]])
    n = 20000
    toks = gumbel_sample(logits.expand(n, -1), torch.full((n,), 1234), torch.arange(n))
    freq = torch.bincount(toks, minlength=5).double() / n
    p = logits.softmax(-1)[0].double()
    sigma = (p * (1 - p) / n).sqrt()
    assert freq[4] == 0
    assert bool(((freq - p).abs() <= 3 * sigma + 1e-12).all()), (freq.tolist(), p.tolist())
