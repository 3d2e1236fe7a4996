"""Seeded request mixes for benchmarks: the same numbers every time for the same arguments.

The main workload is the one vLLM's ``benchmarks/benchmark_throughput.py`` calls "random": prompts of random
token ids (so no tokenizer and no dataset are needed), greedy decoding and ``ignore_eos`` so that every request
produces exactly ``max_tokens`` tokens, whatever the model says. That makes the work identical across engines.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Sequence, Tuple

import numpy as np

from minivllm.sampling_params import SamplingParams

# Token ids below this are the special tokens of SmolLM2 (<|endoftext|>, <|im_start|>, ...); prompts avoid them.
FIRST_TOKEN_ID = 17


@dataclass
class Workload:
    """A list of requests that all arrive at time 0.

    Attributes:
        name: short label used in tables and JSON.
        prompts: the prompt token ids of each request.
        max_tokens: output tokens of each request (greedy, ``ignore_eos``: exactly this many are generated).
        params: how it was drawn (for the JSON record).
    """

    name: str
    prompts: List[List[int]]
    max_tokens: List[int]
    params: Dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.max_tokens):
            raise ValueError(f"prompts ({len(self.prompts)}) and max_tokens ({len(self.max_tokens)}) differ in length")
        if not self.prompts:
            raise ValueError("a workload needs at least one request")

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)

    def sampling_params(self) -> List[SamplingParams]:
        """Greedy, ``ignore_eos``, one ``SamplingParams`` per request."""
        return [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in self.max_tokens]

    def subset(self, n: int) -> "Workload":
        """The first ``n`` requests (a warm-up or a smaller run of the same mix)."""
        return Workload(f"{self.name}[:{n}]", self.prompts[:n], self.max_tokens[:n], dict(self.params, subset=n))

    def summary(self) -> Dict:
        """Counts and drawing parameters (no token ids) for reports."""
        return {"name": self.name, "num_requests": self.num_requests, "prompt_tokens": self.num_prompt_tokens,
                "output_tokens": self.num_output_tokens, **self.params}

    def to_dict(self) -> Dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Dict) -> "Workload":
        return cls(d["name"], [list(p) for p in d["prompts"]], list(d["max_tokens"]), dict(d.get("params", {})))


def _check_range(name: str, r: Sequence[int]) -> Tuple[int, int]:
    if len(r) != 2 or not 1 <= r[0] <= r[1]:
        raise ValueError(f"{name} must be (low, high) with 1 <= low <= high, got {tuple(r)}")
    return int(r[0]), int(r[1])


def _check_vocab(vocab_size: int) -> int:
    if vocab_size <= FIRST_TOKEN_ID:
        raise ValueError(f"vocab_size must be > {FIRST_TOKEN_ID}, got {vocab_size}")
    return vocab_size


def random_workload(
    num_requests: int = 64,
    prompt_len: Sequence[int] = (100, 300),
    output_len: Sequence[int] = (32, 128),
    vocab_size: int = 49152,
    seed: int = 0,
) -> Workload:
    """Random prompts: lengths uniform in ``prompt_len``, ids uniform in ``[17, vocab_size)``, ``max_tokens``
    uniform in ``output_len`` (both ranges inclusive), drawn from ``numpy.random.default_rng(seed)``.

    Raises:
        ValueError: for ``num_requests < 1``, an empty or inverted range, or a vocabulary of 17 tokens or fewer.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    plo, phi = _check_range("prompt_len", prompt_len)
    olo, ohi = _check_range("output_len", output_len)
    _check_vocab(vocab_size)
    rng = np.random.default_rng(seed)
    lens = rng.integers(plo, phi + 1, num_requests)
    outs = rng.integers(olo, ohi + 1, num_requests)
    prompts = [rng.integers(FIRST_TOKEN_ID, vocab_size, n).tolist() for n in lens]
    params = {"kind": "random", "prompt_len": [plo, phi], "output_len": [olo, ohi], "seed": seed,
              "vocab_size": vocab_size}
    return Workload("random", prompts, [int(m) for m in outs], params)


def shared_prefix_workload(
    num_requests: int = 64,
    prefix_len: int = 256,
    suffix_len: Sequence[int] = (16, 64),
    output_len: Sequence[int] = (32, 128),
    vocab_size: int = 49152,
    seed: int = 0,
) -> Workload:
    """Every prompt starts with the same ``prefix_len`` tokens (a system prompt), then a random suffix with length
    uniform in ``suffix_len``: the case prefix caching is for (vLLM ``benchmarks/benchmark_prefix_caching.py``).

    Raises:
        ValueError: as ``random_workload``; also for ``prefix_len < 1``.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if prefix_len < 1:
        raise ValueError(f"prefix_len must be >= 1, got {prefix_len}")
    slo, shi = _check_range("suffix_len", suffix_len)
    olo, ohi = _check_range("output_len", output_len)
    _check_vocab(vocab_size)
    rng = np.random.default_rng(seed)
    prefix = rng.integers(FIRST_TOKEN_ID, vocab_size, prefix_len).tolist()
    lens = rng.integers(slo, shi + 1, num_requests)
    outs = rng.integers(olo, ohi + 1, num_requests)
    prompts = [prefix + rng.integers(FIRST_TOKEN_ID, vocab_size, n).tolist() for n in lens]
    params = {"kind": "shared_prefix", "prefix_len": prefix_len, "suffix_len": [slo, shi],
              "output_len": [olo, ohi], "seed": seed, "vocab_size": vocab_size}
    return Workload("shared_prefix", prompts, [int(m) for m in outs], params)


def latency_workload(prompt_len: int = 160, output_len: int = 64, vocab_size: int = 49152, seed: int = 0) -> Workload:
    """One request (batch 1): ``prompt_len`` random tokens, ``output_len`` new tokens.

    Raises:
        ValueError: for a length below 1 or a vocabulary of 17 tokens or fewer.
    """
    if prompt_len < 1 or output_len < 1:
        raise ValueError(f"prompt_len and output_len must be >= 1, got {prompt_len}, {output_len}")
    _check_vocab(vocab_size)
    rng = np.random.default_rng(seed)
    prompt = rng.integers(FIRST_TOKEN_ID, vocab_size, prompt_len).tolist()
    params = {"kind": "latency", "prompt_len": prompt_len, "output_len": output_len, "seed": seed,
              "vocab_size": vocab_size}
    return Workload("latency", [prompt], [output_len], params)
