"""Static batching versus continuous batching, on the same engine, driven from the client side.

The engine always batches continuously (vLLM V1: a waiting request is admitted in any step in which budget,
``max_num_seqs`` and KV blocks allow). *Static* batching, the pre-Orca way of serving, is simulated by the client:
it hands the engine ``batch_size`` requests, waits until every one of them has finished, and only then hands over
the next batch. Both drivers step the engine one step at a time and time every step, so a run yields the recorded
``SchedulerTrace`` and measured seconds. (Orca, OSDI 2022, section 3, introduced iteration-level scheduling;
vLLM's ``vllm/v1/engine/core.py`` ``EngineCore.step`` is one iteration.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Sequence, Union

from minivllm.engine.llm_engine import LLMEngine, PromptType
from minivllm.course.trace import SchedulerTrace
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams


@dataclass
class BatchingRun:
    """One run of a request mix.

    Attributes:
        request_ids: engine request ids, in the order of the prompts given.
        outputs: ``request id -> final RequestOutput``.
        trace: the engine's trace for this run (steps numbered from 0 at the run's start).
        arrivals: ``request id -> step`` at which the request reached the client: 0 for all (they all arrive at
            once), so that time spent held back by the client counts as waiting.
        step_end_seconds: wall-clock seconds from the start of the run to the end of each step.
        finish_seconds: ``request id -> seconds`` from the start of the run until the request finished.
    """

    request_ids: List[str]
    outputs: Dict[str, RequestOutput]
    trace: SchedulerTrace
    arrivals: Dict[str, int]
    step_end_seconds: List[float]
    finish_seconds: Dict[str, float]

    @property
    def num_steps(self) -> int:
        return len(self.trace)


def _check(engine: LLMEngine, prompts: Sequence[PromptType], params) -> List[SamplingParams]:
    if not isinstance(getattr(engine, "trace", None), SchedulerTrace):
        raise ValueError("engine must record a SchedulerTrace: create it as a TracedLLMEngine")
    if engine.has_unfinished_requests():
        raise ValueError(f"engine must be idle, it has {engine.get_num_unfinished_requests()} unfinished requests")
    if len(prompts) == 0:
        raise ValueError("prompts must not be empty")
    if isinstance(params, SamplingParams):
        return [params] * len(prompts)
    params = list(params)
    if len(params) != len(prompts):
        raise ValueError(f"params has {len(params)} entries for {len(prompts)} prompts")
    return params


def _drive(engine: LLMEngine, batches: List[List[int]], prompts, params) -> BatchingRun:
    first_step = len(engine.trace)
    ids: List[str] = [""] * len(prompts)
    outputs: Dict[str, RequestOutput] = {}
    ends: List[float] = []
    finish: Dict[str, float] = {}
    start = time.perf_counter()
    for batch in batches:
        for i in batch:
            ids[i] = engine.add_request(None, prompts[i], params[i])
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    outputs[o.request_id] = o
                    finish[o.request_id] = time.perf_counter() - start
            ends.append(time.perf_counter() - start)
    steps = engine.trace.steps[first_step:]
    trace = SchedulerTrace(steps=[_renumber(s, k) for k, s in enumerate(steps)])
    return BatchingRun(ids, outputs, trace, {r: 0 for r in ids}, ends, finish)


def _renumber(step, k):
    if step.step == k:
        return step
    from dataclasses import replace

    return replace(step, step=k)


def run_continuous(
    engine: LLMEngine, prompts: Sequence[PromptType], params: Union[SamplingParams, Sequence[SamplingParams]]
) -> BatchingRun:
    """Add every request at once and step until all finish: the engine's own continuous batching.

    Raises:
        ValueError: if the engine does not record a trace, is not idle, or ``prompts``/``params`` disagree.
    """
    params = _check(engine, prompts, params)
    return _drive(engine, [list(range(len(prompts)))], prompts, params)


def run_static(
    engine: LLMEngine,
    prompts: Sequence[PromptType],
    params: Union[SamplingParams, Sequence[SamplingParams]],
    batch_size: int,
) -> BatchingRun:
    """Static batching: hand over ``batch_size`` requests, wait until all finished, then the next batch.

    Raises:
        ValueError: as ``run_continuous``; also if ``batch_size`` is not in ``[1, max_num_seqs]`` (a larger batch
            could not all run at once, which static batching assumes).
    """
    params = _check(engine, prompts, params)
    limit = engine.scheduler_config.max_num_seqs
    if not isinstance(batch_size, int) or not 1 <= batch_size <= limit:
        raise ValueError(f"batch_size must be an int in [1, max_num_seqs={limit}], got {batch_size!r}")
    batches = [list(range(i, min(i + batch_size, len(prompts)))) for i in range(0, len(prompts), batch_size)]
    return _drive(engine, batches, prompts, params)


def mixed_requests(
    num_requests: int = 12,
    *,
    seed: int = 7,
    prompt_len: tuple = (16, 64),
    output_lens: Sequence[int] = (4, 6, 8, 40, 56),
    vocab_size: int = 512,
):
    """A request mix where output lengths differ a lot (most short, some long): where static batching hurts.

    Args:
        num_requests: how many requests (>= 1).
        seed: seed of the numpy generator that draws everything.
        prompt_len: ``(low, high)`` prompt lengths in tokens, both inclusive.
        output_lens: ``max_tokens`` values drawn uniformly (greedy, ``ignore_eos=True``: each request produces
            exactly that many tokens).
        vocab_size: token ids are drawn from ``[3, vocab_size)`` (the tiny model's vocabulary is 512).

    Returns:
        ``(prompts, params)``: ``{"prompt_token_ids": [...]}`` dicts and one ``SamplingParams`` per prompt.

    Raises:
        ValueError: for ``num_requests < 1``, an empty or inverted ``prompt_len``, or empty ``output_lens``.
    """
    import numpy as np

    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    lo, hi = prompt_len
    if not 1 <= lo <= hi:
        raise ValueError(f"prompt_len must be (low, high) with 1 <= low <= high, got {prompt_len}")
    if len(output_lens) == 0:
        raise ValueError("output_lens must not be empty")
    rng = np.random.default_rng(seed)
    lens = rng.integers(lo, hi + 1, num_requests).tolist()
    outs = [int(x) for x in rng.choice(list(output_lens), num_requests)]
    prompts = [{"prompt_token_ids": rng.integers(3, vocab_size, n).tolist()} for n in lens]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in outs]
    return prompts, params
