"""Per-request sampling and stopping parameters (vLLM: ``vllm/sampling_params.py``)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Union

_GREEDY_EPS = 1e-5

# The largest n (vLLM 0.32: VLLM_MAX_N_SEQUENCES, default 16384): one request may not fan out without bound.
MAX_N_SEQUENCES = 16384


class RequestOutputKind(enum.Enum):
    """What each ``RequestOutput`` of a running request carries (vLLM: ``vllm/sampling_params.py``).

    ``CUMULATIVE`` (the default, as in vLLM): the whole text and token ids so far. ``DELTA``: only what this step
    added. ``FINAL_ONLY``: nothing until the request finishes, then one output with everything.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """How one request picks its next tokens and when it stops.

    Args:
        n: Number of completions. With ``n > 1`` the engine fans the request out into ``n`` child requests and
            gathers their outputs into one ``RequestOutput`` (vLLM: ``vllm/v1/engine/parallel_sampling.py``);
            greedy sampling needs ``n == 1``, as in vLLM (``_verify_greedy_sampling``).
        presence_penalty: Subtracted from the logit of every token that already appears in the *output*
            (OpenAI's definition, vLLM ``apply_penalties``). In ``[-2, 2]``; ``0`` disables it.
        frequency_penalty: Subtracted once per occurrence in the *output*. In ``[-2, 2]``; ``0`` disables it.
        repetition_penalty: For every token in the prompt *or* the output, a positive logit is divided by it, a
            negative one multiplied (vLLM ``apply_repetition_penalties_torch``). ``> 0`` and finite; ``1``
            disables it.
        logit_bias: ``{token id: bias}`` added to the logits before sampling (vLLM ``LogitBiasLogitsProcessor``);
            biases are clamped to ``[-100, 100]`` as in vLLM's ``SamplingParams.from_optional``. Ids outside the
            vocabulary are refused when the request is added (``InputProcessor``).
        logprobs: Number of top log-probabilities to return per sampled token, besides the sampled token's own
            (with its rank). From the raw logits, before penalties, bias and temperature (vLLM's default
            ``logprobs_mode="raw_logprobs"``). ``None``: none; ``-1``: the whole vocabulary; ``True`` means 1.
        prompt_logprobs: The same for every prompt position (the first entry is ``None``), returned with the
            request's first output.
        skip_reading_prefix_cache: Do not read the prefix cache for this request (its blocks are still cached
            for others). ``None`` means ``prompt_logprobs is not None``, as in vLLM 0.32's ``__post_init__``
            (https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/sampling_params.py#L622): a cache hit would
            skip prompt positions whose logprobs are asked for.
        temperature: Softmax temperature. ``0`` means greedy (argmax). Must be ``>= 0``.
        top_p: Nucleus sampling: keep the smallest set of tokens whose probability sums to at least ``top_p``.
            Must be in ``(0, 1]``; ``1`` disables it.
        top_k: Keep exactly the ``top_k`` most likely tokens (ties with the k-th broken by lowest token id, so
            ``top_k=1`` is greedy, as in vLLM's Triton kernel; vLLM's PyTorch fallback, on its CPU build, keeps
            every tie). ``0`` or ``-1`` disables it (vLLM accepts both); otherwise it must be ``>= 1``.
        min_p: Drop tokens whose probability is below ``min_p`` times the top token's. In ``[0, 1]``.
        seed: Seed of this request's own ``torch.Generator``. With a seed the sampled text does not depend on
            the batch it runs in, on chunked prefill or on preemption. Any int64 (vLLM takes any int; ``-1`` means
            no seed, as in vLLM's ``__post_init__``).
        max_tokens: Maximum number of generated tokens (``>= 1``). ``None`` means "up to ``max_model_len``".
        min_tokens: EOS and ``stop_token_ids`` are suppressed until this many tokens were generated (EOS also
            with ``ignore_eos``, as in vLLM).
        stop: Stop strings. Generation stops when the detokenized output contains one; the text is cut before
            it unless ``include_stop_str_in_output``. Any number here, as in vLLM; the server takes at most
            4, vLLM's ``VLLM_MAX_STOP_STRINGS`` (``protocol.MAX_STOP_STRINGS``): each is looked for after every
            step.
        stop_token_ids: Extra token ids that end generation (the token is kept in ``token_ids``); kept once each,
            in their order, as vLLM 0.32 keeps them
            (https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/sampling_params.py#L579-L582). The server
            refuses more than the vocabulary has ids before looking at them (``protocol.vocab_size_limit``).
        ignore_eos: Keep generating after EOS (benchmarks use this).
        include_stop_str_in_output: Keep the matched stop string at the end of the text.
        skip_special_tokens: Drop special tokens when detokenizing.
        priority: Used by the ``priority`` scheduling policy: a *lower* value is served first (vLLM's rule).
        output_kind: a ``RequestOutputKind``: whole outputs so far (``CUMULATIVE``, the default), deltas
            (``DELTA``) or only the final output (``FINAL_ONLY``).

    Raises:
        ValueError: naming the parameter, its value and the limit, for any out-of-range value. Checked here,
            at construction, so a bad request never reaches the engine.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    # Empty by default; None is accepted too (vLLM's default) and becomes an empty list in __post_init__, so the
    # declared types are what every reader after construction sees.
    stop: Union[str, Sequence[str]] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: Optional[Dict[int, float]] = None
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_reading_prefix_cache: Optional[bool] = None
    # Filled by the engine: the tokenizer's EOS id (None for models without one).
    eos_token_id: Optional[int] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.seed == -1 and not isinstance(self.seed, bool):  # vLLM: -1 means "no seed"
            self.seed = None
        if self.logprobs is True:  # vLLM's __post_init__
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        if self.skip_reading_prefix_cache is None:
            self.skip_reading_prefix_cache = self.prompt_logprobs is not None
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
            bias: Dict[int, float] = {}
            for tok, b in self.logit_bias.items():
                try:
                    t = int(tok)
                    if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b):
                        raise TypeError
                except (TypeError, ValueError):
                    raise ValueError(f"logit_bias must map integer token ids to finite numbers, got {tok!r}: {b!r}")
                bias[t] = min(100.0, max(-100.0, float(b)))  # vLLM's clamp (SamplingParams.from_optional)
            self.logit_bias = bias
        self._verify()
        # Kept once each, in order, as vLLM 0.32's __post_init__ does: a repeated id stops nothing more, but the
        # scheduler looks for the last token in this list after every step (check_stop in core/sched/utils.py).
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))

    def _verify(self) -> None:
        def bad(name: str, value, limit: str) -> ValueError:
            return ValueError(f"{name} must be {limit}, got {value!r}")

        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise bad("n", self.n, "an int >= 1")
        if self.n > MAX_N_SEQUENCES:  # vLLM: VLLM_MAX_N_SEQUENCES, default 16384 (sampling_params.py)
            raise bad("n", self.n, f"at most {MAX_N_SEQUENCES}")
        for name, lo, hi in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
                raise bad(name, v, f"in [{lo:g}, {hi:g}]")
        rp = self.repetition_penalty
        if isinstance(rp, bool) or not isinstance(rp, (int, float)) or not math.isfinite(rp) or rp <= 0:
            raise bad("repetition_penalty", rp, "a finite number > 0 (1 disables it)")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or (v < 0 and v != -1)):
                raise bad(name, v, "None, an int >= 0, or -1 (the whole vocabulary)")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", self.temperature, ">= 0 (0 means greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:  # also rejects NaN
            raise bad("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise bad("top_k", self.top_k, ">= 1, or 0 / -1 to disable it")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, ">= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, ">= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or not -2**63 <= self.seed < 2**63
        ):
            raise bad("seed", self.seed, "an int64 (in [-2**63, 2**63 - 1]; -1 means none) or None")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise bad("priority", self.priority, "an int (lower values are served first)")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", self.output_kind, "a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise bad("stop", s, "a non-empty string")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                raise bad("stop_token_ids", t, "non-negative token ids")
        if self.n > 1 and self.greedy:  # vLLM _verify_greedy_sampling
            raise bad("n", self.n, "1 when using greedy sampling (temperature 0)")

    @property
    def needs_penalties(self) -> bool:
        """Any of the three penalties is set (vLLM ``SamplingMetadata.no_penalties`` is its negation)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_processing(self) -> bool:
        """The row cannot take the plain greedy fast path: penalties, a bias or logprobs to compute."""
        return self.needs_penalties or bool(self.logit_bias) or self.logprobs is not None

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature below 1e-5, as in vLLM)."""
        return self.temperature < _GREEDY_EPS

    def clone(self) -> "SamplingParams":
        """A copy the engine may fill (``eos_token_id``) without touching the caller's object."""
        # A new object with the same fields (copy.copy's generic path was most of an n=16384 fan-out).
        c = object.__new__(type(self))
        c.__dict__.update(self.__dict__)
        c.stop = list(self.stop)
        c.stop_token_ids = list(self.stop_token_ids)
        if self.logit_bias is not None:
            c.logit_bias = dict(self.logit_bias)
        return c
