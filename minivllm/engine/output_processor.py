"""From the engine core's new tokens to ``RequestOutput``s (vLLM: ``vllm/v1/engine/output_processor.py``).

The output processor keeps one ``RequestState`` per live request: its detokenizer (text, stop strings, the
held-back window of streamed text) and how its outputs are shaped (``SamplingParams.output_kind``):

* ``CUMULATIVE`` (default, as in vLLM): each output carries the text and token ids so far. ``token_ids`` is the
  request state's own growing list, handed out by reference (vLLM does the same), so a step costs O(new tokens)
  rather than a copy of the whole output; an output kept from an earlier step therefore shows later tokens too.
  ``LLM.generate`` returns these final outputs whole, and ``LLMEngine.step()`` streams them.
* ``DELTA``: text and token ids added in this step only. ``FINAL_ONLY``: one output, at the end.

Every output also carries ``new_token_ids`` and ``new_text`` (this step's additions, whatever the kind): minivllm's
shortcut for streaming without choosing a kind; vLLM's ``RequestOutput`` has no such fields.

Logprobs (``SamplingParams.logprobs`` / ``prompt_logprobs``) arrive as the model runner's ``LogprobsEntry`` rows,
beside the engine core's outputs (``process_outputs(..., logprobs=...)``); they are turned into vLLM's
``{token id: Logprob}`` dicts here, with each token's text (vLLM: ``vllm/v1/engine/logprobs.py``
``LogprobsProcessor``). Children of an ``n > 1`` request (``parallel_sampling.ParentRequest``) are gathered into
their parent's outputs.

A request that a stop string finishes is returned in ``reqs_to_abort``: the engine then finishes it in the engine
core (through the scheduler), as vLLM's ``LLMEngine.step`` does; nothing here touches the scheduler's state. A
finished request's state is dropped at once, so the processor holds only live requests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional

from minivllm.engine import EngineCoreOutput
from minivllm.engine.detokenizer import IncrementalDetokenizer
from minivllm.engine.parallel_sampling import ParentRequest
from minivllm.metrics.stats import RequestStateStats
from minivllm.outputs import CompletionOutput, Logprob, LogprobsEntry, PromptLogprobs, RequestOutput, SampleLogprobs
from minivllm.request import Request
from minivllm.sampling_params import RequestOutputKind


@dataclass
class OutputProcessorOutput:
    """``request_outputs`` to return to the caller; ``reqs_to_abort``: ids a stop string finished."""

    request_outputs: List[RequestOutput] = field(default_factory=list)
    reqs_to_abort: List[str] = field(default_factory=list)


class RequestState:
    """One live request as the output side sees it.

    Where minivllm differs from vLLM: ``num_cached_tokens`` and ``num_preemptions`` are read from the scheduler's
    ``Request`` (read only), which this process shares; vLLM sends them across a process boundary in
    ``EngineCoreOutput``.
    """

    def __init__(self, request: Request, tokenizer, parent: Optional[ParentRequest] = None, index: int = 0) -> None:
        self.request_id = request.request_id
        self.request = request
        self.parent = parent
        self.index = index
        self.tokenizer = tokenizer
        self.output_kind: RequestOutputKind = request.sampling_params.output_kind
        self.detokenizer = IncrementalDetokenizer.from_new_request(tokenizer, request.sampling_params)
        sp = request.sampling_params
        self.logprobs: Optional[SampleLogprobs] = [] if sp.logprobs is not None else None
        self.prompt_logprobs: Optional[PromptLogprobs] = None
        self.prompt_logprobs_sent = False
        self._new_logprobs: SampleLogprobs = []
        self.stats = RequestStateStats(arrival_time=time.monotonic())

    def _to_dict(self, entry: LogprobsEntry) -> Dict[int, Logprob]:
        """vLLM's ``{token id: Logprob}`` of one position: the token with its rank, then the top ones with ranks
        ``1..k`` (a token in both keeps the top entry, as vLLM's dict does); texts by ``tokenizer.decode([id])``
        (vLLM ``convert_ids_list_to_tokens`` in ``vllm/tokenizers/detokenizer_utils.py``, which also restores
        the leading spaces a SentencePiece ``decode`` strips; minivllm's byte-level BPE models strip none)."""
        ranks = [entry.rank] + list(range(1, len(entry.token_ids)))
        tok = self.tokenizer
        return {t: Logprob(lp, r, None if tok is None else (tok.decode([t]) or ""))
                for t, lp, r in zip(entry.token_ids, entry.logprobs, ranks)}

    def add_logprobs(self, sample: List[LogprobsEntry], prompt: Optional[List[Optional[LogprobsEntry]]]) -> None:
        """Take this step's sampled-token and prompt logprobs (prompt ones only the first time they come)."""
        if self.logprobs is not None:
            new = [self._to_dict(e) for e in sample]
            self.logprobs.extend(new)
            self._new_logprobs = new
        if prompt is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None if e is None else self._to_dict(e) for e in prompt]

    def make_request_output(self, new_token_ids: List[int], finish_reason: Optional[str],
                            stop_reason: Optional[object]) -> Optional[RequestOutput]:
        """The output for this step, or ``None`` (``FINAL_ONLY`` while the request runs)."""
        finished = finish_reason is not None
        if not finished and self.output_kind == RequestOutputKind.FINAL_ONLY:
            return None
        det = self.detokenizer
        new_text = det.get_next_output_text(finished, delta=True)
        if self.output_kind == RequestOutputKind.DELTA:
            text, token_ids = new_text, new_token_ids
        else:
            text, token_ids = det.get_next_output_text(finished, delta=False), det.output_token_ids
        request = self.request
        logprobs = self.logprobs
        if logprobs is not None and self.output_kind == RequestOutputKind.DELTA:
            logprobs = self._new_logprobs
        self._new_logprobs = []
        prompt_logprobs = self.prompt_logprobs
        if self.output_kind == RequestOutputKind.DELTA:  # vLLM: popped into the first delta only
            prompt_logprobs = None if self.prompt_logprobs_sent else prompt_logprobs
            self.prompt_logprobs_sent = self.prompt_logprobs_sent or prompt_logprobs is not None
        completion = CompletionOutput(self.index, text, token_ids, finish_reason, stop_reason if finished else None,
                                      logprobs)
        completions = [completion]
        request_id = self.request_id
        if self.parent is not None:
            completions, finished = self.parent.get_outputs(self.request_id, completion)
            if not completions:
                return None
            request_id = self.parent.request_id
        return RequestOutput(
            request_id=request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            prompt_logprobs=prompt_logprobs,
            finished=finished,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_preemptions=request.num_preemptions,
            new_token_ids=new_token_ids,
            new_text=new_text,
            metrics=self.stats,
        )


class OutputProcessor:
    """Detokenizes, applies stop strings and builds ``RequestOutput``s for every live request.

    Args:
        tokenizer: a transformers tokenizer, or ``None`` (token ids only, no text, no stop strings).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.request_states: Dict[str, RequestState] = {}
        self.parent_requests: Dict[str, ParentRequest] = {}

    def add_request(self, request: Request, parent: Optional[ParentRequest] = None, index: int = 0) -> None:
        """Track ``request``; a child of an ``n > 1`` request names its ``parent`` and its ``index``."""
        self.request_states[request.request_id] = RequestState(request, self.tokenizer, parent, index)
        if parent is not None:
            self.parent_requests[parent.request_id] = parent

    def has_request(self, request_id: str) -> bool:
        return request_id in self.request_states or request_id in self.parent_requests

    def process_outputs(self, engine_core_outputs: Iterable[EngineCoreOutput]) -> OutputProcessorOutput:
        """Detokenize each request's new tokens, check stop strings, build the outputs (with the logprobs each
        ``EngineCoreOutput`` carries), drop finished requests. Outputs for requests no longer here (aborted while
        the step ran) are ignored, as in vLLM."""
        result = OutputProcessorOutput()
        now = time.monotonic()
        for eco in engine_core_outputs:
            state = self.request_states.get(eco.request_id)
            if state is None:
                continue
            if eco.new_token_ids:
                stats = state.stats
                if stats.first_token_ts is None:
                    stats.first_token_ts = now
                stats.last_token_ts = now
                stats.num_generation_tokens += len(eco.new_token_ids)
            if eco.new_logprobs is not None or eco.new_prompt_logprobs is not None:
                state.add_logprobs(eco.new_logprobs or [], eco.new_prompt_logprobs)
            finish_reason, stop_reason = eco.finish_reason, eco.stop_reason
            stop_string = state.detokenizer.update(eco.new_token_ids, finish_reason == "stop")
            if stop_string is not None:
                finish_reason, stop_reason = "stop", stop_string
            out = state.make_request_output(eco.new_token_ids, finish_reason, stop_reason)
            if out is not None:
                result.request_outputs.append(out)
            if finish_reason is not None:
                del self.request_states[eco.request_id]
                self._forget_parent(state)
                if eco.finish_reason is None:  # finished here, still running in the engine core
                    result.reqs_to_abort.append(eco.request_id)
        return result

    def abort_requests(self, request_ids: Iterable[str]) -> List[RequestOutput]:
        """Drop these requests; returns a final output (``finish_reason="abort"``) for each one that was live.

        The held-back text of a stop-string window is released: no stop string completed, so it is output text.
        """
        outputs = []
        for rid in self.expand_request_ids(request_ids):
            state = self.request_states.pop(rid, None)
            out = None if state is None else state.make_request_output([], "abort", None)
            if state is not None:
                self._forget_parent(state)
            if out is not None:  # always for a live request (for a child: when it is its parent's last)
                outputs.append(out)
        return outputs

    def expand_request_ids(self, request_ids: Iterable[str]) -> List[str]:
        """The ids with each ``n > 1`` parent's id replaced by its live children's."""
        out: List[str] = []
        for rid in request_ids:
            parent = self.parent_requests.get(rid)
            out.extend([c for c in parent.child_ids if c in self.request_states] if parent is not None else [rid])
        return out

    def _forget_parent(self, state: RequestState) -> None:
        if state.parent is not None and not state.parent.child_requests:
            self.parent_requests.pop(state.parent.request_id, None)
