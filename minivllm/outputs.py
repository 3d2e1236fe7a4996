"""What ``LLM.generate`` returns (vLLM: ``vllm/outputs.py``) and what the model runner returns each step
(``ModelRunnerOutput``, at the end; vLLM: ``vllm/v1/outputs.py``; minivllm has no ``v1/`` level, so both live here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

from minivllm.metrics.stats import RequestStateStats


@dataclass
class LogprobsEntry:
    """The logprobs of one token position (vLLM ``LogprobsLists`` row).

    Attributes:
        token_ids: the token (sampled, or the prompt's) first, then the top ``k`` ids, best first.
        logprobs: float log-probabilities of those ids (natural log), same order.
        rank: the first token's rank in the row (1 = most likely; ``1 + #tokens with a strictly higher logprob``
            counted as vLLM's ``batched_count_greater_than``: tokens with logprob ``>=`` its own).
    """

    token_ids: List[int]
    logprobs: List[float]
    rank: int


@dataclass
class Logprob:
    """One token's entry in a logprobs dict (vLLM ``vllm/logprobs.py`` ``Logprob``): its natural-log
    probability, its rank (1 = most likely) and its text (``None`` without a tokenizer)."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# vLLM's SampleLogprobs / PromptLogprobs: one dict {token id: Logprob} per position (the prompt's first is None).
SampleLogprobs = List[Dict[int, Logprob]]
PromptLogprobs = List[Optional[Dict[int, Logprob]]]


@dataclass
class CompletionOutput:
    """One completion: ``text``, ``token_ids``, and why it ended.

    ``finish_reason`` is ``"stop"`` (EOS, a stop token or a stop string), ``"length"`` (``max_tokens`` or
    ``max_model_len`` reached) or ``"abort"``; ``None`` while the request is still running.
    ``stop_reason`` is the stop string or stop token id that matched, else ``None``.
    ``logprobs``: with ``SamplingParams.logprobs``, one ``{token id: Logprob}`` per token of ``token_ids`` (the
    sampled token and the top ones), following ``output_kind`` as ``token_ids`` does; else ``None``.
    """

    index: int
    text: str
    token_ids: List[int]
    finish_reason: Optional[str] = None
    stop_reason: Optional[object] = None
    logprobs: Optional[SampleLogprobs] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state as seen by the caller, after a step or at the end.

    Attributes:
        request_id, prompt, prompt_token_ids: the request.
        outputs: one ``CompletionOutput`` per completion: ``n`` of them for ``SamplingParams.n > 1`` (each with
            its ``index``; while streaming, only the ones that changed), else one.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``, one entry per prompt token (the first
            ``None``), in the request's first output (and in every ``CUMULATIVE`` / final one); else ``None``.
        finished: True once the request ended (finished or aborted).
        num_cached_tokens: prompt tokens served from the prefix cache at first admission.
        num_preemptions: times the request was preempted.
        new_token_ids / new_text: what this step added (for streaming, whatever the output kind; a minivllm
            shortcut, not in vLLM).
        metrics: the request's ``RequestStateStats`` (arrival, first and latest token times; vLLM
            ``RequestOutput.metrics``), so that time to first token is known even when only the final output is
            delivered; ``None`` for an output made outside the engine (an abort the front end reports).

    ``outputs[0].text`` and ``token_ids`` follow ``SamplingParams.output_kind``: everything so far
    (``CUMULATIVE``, the default; ``token_ids`` is then the engine's growing list, not a copy), this step's part
    (``DELTA``), or everything in the one final output (``FINAL_ONLY``). While a request with stop strings runs,
    the last ``max(len(s) for s in stop) - 1`` characters of text are held back (see ``engine/detokenizer.py``).
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    outputs: List[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    new_token_ids: List[int] = field(default_factory=list)
    new_text: str = ""
    prompt_logprobs: Optional[PromptLogprobs] = None
    metrics: Optional[RequestStateStats] = field(default=None, compare=False, repr=False)


@dataclass
class ModelRunnerOutput:
    """What the model runner returns (vLLM ``vllm/v1/outputs.py``).

    ``sampled_token_ids[i]`` is ``[token]`` for request ``req_ids[i]``, or ``[]`` when that request's step was a
    partial prefill: a token *was* sampled from its last position, then discarded.
    ``logprobs[i]``: the ``LogprobsEntry`` of request ``i``'s sampled token when it asked for ``logprobs``, else
    ``None`` (``logprobs`` is ``None`` when no request did). ``prompt_logprobs_dict[req_id]``: a request's prompt
    logprobs (``None`` first, then one entry per prompt token), in the step whose chunk finished its prompt (vLLM
    ``prompt_logprobs_dict``, filled from ``in_progress_prompt_logprobs_cpu``).
    """

    req_ids: List[str]
    req_id_to_index: Dict[str, int]
    sampled_token_ids: List[List[int]]
    finished_recving: Optional[Set[str]] = None
    finished_sending: Optional[Set[str]] = None
    logprobs: Optional[List[Optional[LogprobsEntry]]] = None
    prompt_logprobs_dict: Dict[str, List[Optional[LogprobsEntry]]] = field(default_factory=dict)
