"""The engine's data types (vLLM: ``vllm/v1/engine/__init__.py``).

As in vLLM, the scheduler returns ``EngineCoreOutput`` objects defined here (vLLM's scheduler imports
``vllm.v1.engine``). To keep that import from running up the layers, this ``__init__`` is a leaf: it holds data
types only and imports nothing of minivllm (no engine module is loaded by ``import minivllm.engine``).
``tests/package/test_import_graph.py`` places this module in the data layer, beside ``request.py`` and
``outputs.py``; the engine's modules (``llm_engine``, ``llm``, ...) sit above core and worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, List, Optional

if TYPE_CHECKING:
    from minivllm.metrics.stats import SchedulerStats
    from minivllm.outputs import LogprobsEntry


@dataclass
class EngineCoreOutput:
    """New tokens of one request after one step (vLLM ``EngineCoreOutput``).

    Attributes:
        request_id: the request.
        new_token_ids: tokens appended in this step (empty only when the request finished without one).
        finish_reason: ``"stop"``, ``"length"`` or ``"abort"`` once finished, else ``None``.
        stop_reason: the stop token id that matched, else ``None``.
        new_logprobs: with ``SamplingParams.logprobs``, one ``LogprobsEntry`` per new token (vLLM
            ``EngineCoreOutput.new_logprobs``), else ``None``.
        new_prompt_logprobs: with ``SamplingParams.prompt_logprobs``, in the step that finished the prompt: ``None``
            for the first prompt token, then one entry per prompt token (vLLM ``new_prompt_logprobs_tensors``).
    """

    request_id: str
    new_token_ids: List[int]
    finish_reason: Optional[str] = None
    stop_reason: Optional[object] = None
    new_logprobs: Optional[List["LogprobsEntry"]] = None
    new_prompt_logprobs: Optional[List[Optional["LogprobsEntry"]]] = None


@dataclass
class EngineCoreOutputs:
    """What one ``EngineCore.step()`` produced: one ``EngineCoreOutput`` per request that got tokens or finished,
    and the scheduler's ``SchedulerStats`` after it when stats are on (vLLM ``EngineCoreOutputs``)."""

    outputs: List[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: Optional["SchedulerStats"] = None
