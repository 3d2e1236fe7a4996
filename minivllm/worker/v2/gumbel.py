"""Stateless seeded sampling of Model Runner V2 (vLLM: ``vllm/v1/worker/gpu/sample/gumbel.py``, v0.32.0).

Gumbel-max: ``argmax(logits / temperature + g)`` with ``g = -log(-log(u))`` and ``u`` uniform in (0, 1) is a draw
from ``softmax(logits / temperature)``. Model Runner V2 takes ``u`` not from a random *stream* but from a hash of
``(seed, position, token id)``: the noise of every vocabulary entry at every position is fixed by the request's
seed alone. So nothing is saved, restored or rewound: a partial prefill's discarded draw changes nothing, and a
request that is preempted, rebuilt from scratch and recomputed draws exactly the same noise at the same position.
``position`` is the position of the token whose logits are sampled (the last scheduled token of the step).

The hash is MurmurHash3 (32-bit, seed 0) of four 32-bit words: the low and high halves of the seed, the low half
of the position and the token id; ``u = (hash + 0.5) / 2**32`` and ``g = -log(-log(1 - u))``. That is the structure of vLLM's
``murmur3_hash32`` / ``murmur3_uniform32``; vLLM computes it in a Triton kernel, minivllm in int64 PyTorch
arithmetic on the CPU or GPU (every product is split so it fits in 63 bits), and ``u`` and ``g`` in float64.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_C1, _C2 = 0xCC9E2D51, 0x1B873593
_F1, _F2 = 0x85EBCA6B, 0xC2B2AE35


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """``(a * c) mod 2**32`` for ``a`` in [0, 2**32) (int64), without overflowing int64."""
    lo = a * (c & 0xFFFF)
    hi = ((a * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _MASK32


def _mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    k = _mul32(_rotl32(_mul32(k, _C1), 15), _C2)
    h = _rotl32(h ^ k, 13)
    return (h * 5 + 0xE6546B64) & _MASK32


def murmur3_hash32(seed: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """MurmurHash3 of ``(seed, pos, key)`` for every row and key.

    Args:
        seed: ``int64 [R]`` request seeds (any int64; both 32-bit halves are hashed).
        pos: ``int64 [R]`` token positions (the low 32 bits are hashed).
        keys: ``int64 [V]`` token ids.

    Returns:
        ``int64 [R, V]`` hashes in ``[0, 2**32)``.
    """
    seed_lo = (seed & _MASK32).unsqueeze(1)
    seed_hi = ((seed >> 32) & _MASK32).unsqueeze(1)
    h = torch.zeros_like(seed_lo)
    h = _mix(h, seed_lo)
    h = _mix(h, seed_hi)
    h = _mix(h, (pos & _MASK32).unsqueeze(1))
    h = _mix(h.expand(-1, keys.shape[0]), (keys & _MASK32).unsqueeze(0))
    h = h ^ 16  # the input length in bytes
    h = h ^ (h >> 16)
    h = _mul32(h, _F1)
    h = h ^ (h >> 13)
    h = _mul32(h, _F2)
    return h ^ (h >> 16)


def gumbel_noise(seed: torch.Tensor, pos: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``float64 [R, vocab_size]`` Gumbel(0, 1) noise, a pure function of ``(seed[r], pos[r], token id)``."""
    keys = torch.arange(vocab_size, dtype=torch.int64, device=seed.device)
    u = (murmur3_hash32(seed, pos, keys).to(torch.float64) + 0.5) * 2.0**-32
    # -log(-log(1 - u)), as vLLM: the winning tail (large noise) comes from u near 0, where floats are dense.
    return -torch.log(-torch.log1p(-u))


def gumbel_sample(logits: torch.Tensor, seed: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """One token per row: ``argmax(logits + gumbel_noise(seed, pos))``.

    Args:
        logits: ``[R, V]`` logits already divided by the temperature and masked (``-inf``) by top-k / top-p /
            min-p; any float dtype.
        seed, pos: ``int64 [R]`` (see ``gumbel_noise``).

    Returns:
        ``int64 [R]`` token ids. Rows are independent: a row's token does not depend on the other rows.
    """
    noise = gumbel_noise(seed, pos, logits.shape[-1])
    return (logits.to(torch.float64) + noise).argmax(-1)
