"""What ``LLM.generate`` returns (vLLM: ``vllm/outputs.py``) and what the model runner returns each step
(``ModelRunnerOutput``, at the end; vLLM: ``vllm/v1/outputs.py``; minivllm has no ``v1/`` level, so both live here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set


@dataclass
class CompletionOutput:
    """One completion: ``text``, ``token_ids``, and why it ended.

    ``finish_reason`` is ``"stop"`` (EOS, a stop token or a stop string), ``"length"`` (``max_tokens`` or
    ``max_model_len`` reached) or ``"abort"``; ``None`` while the request is still running.
    ``stop_reason`` is the stop string or stop token id that matched, else ``None``.
    """

    index: int
    text: str
    token_ids: List[int]
    finish_reason: Optional[str] = None
    stop_reason: Optional[object] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state as seen by the caller, after a step or at the end.

    Attributes:
        request_id, prompt, prompt_token_ids: the request.
        outputs: one ``CompletionOutput`` (minivllm has ``n=1``).
        finished: True once the request ended (finished or aborted).
        num_cached_tokens: prompt tokens served from the prefix cache at first admission.
        num_preemptions: times the request was preempted.
        new_token_ids / new_text: what this step added (for streaming, whatever the output kind; a minivllm
            shortcut, not in vLLM).

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


@dataclass
class ModelRunnerOutput:
    """What the model runner returns (vLLM ``vllm/v1/outputs.py``).

    ``sampled_token_ids[i]`` is ``[token]`` for request ``req_ids[i]``, or ``[]`` when that request's step was a
    partial prefill: a token *was* sampled from its last position, then discarded.
    """

    req_ids: List[str]
    req_id_to_index: Dict[str, int]
    sampled_token_ids: List[List[int]]
    finished_recving: Optional[Set[str]] = None
    finished_sending: Optional[Set[str]] = None
