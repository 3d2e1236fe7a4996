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

A request that a stop string finishes is returned in ``reqs_to_abort``: the engine then finishes it in the engine
core (through the scheduler), as vLLM's ``LLMEngine.step`` does; nothing here touches the scheduler's state. A
finished request's state is dropped at once, so the processor holds only live requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional

from minivllm.engine import EngineCoreOutput
from minivllm.engine.detokenizer import IncrementalDetokenizer
from minivllm.outputs import CompletionOutput, RequestOutput
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

    def __init__(self, request: Request, tokenizer) -> None:
        self.request_id = request.request_id
        self.request = request
        self.output_kind: RequestOutputKind = request.sampling_params.output_kind
        self.detokenizer = IncrementalDetokenizer.from_new_request(tokenizer, request.sampling_params)

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
        return RequestOutput(
            request_id=self.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[CompletionOutput(0, text, token_ids, finish_reason, stop_reason if finished else None)],
            finished=finished,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_preemptions=request.num_preemptions,
            new_token_ids=new_token_ids,
            new_text=new_text,
        )


class OutputProcessor:
    """Detokenizes, applies stop strings and builds ``RequestOutput``s for every live request.

    Args:
        tokenizer: a transformers tokenizer, or ``None`` (token ids only, no text, no stop strings).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.request_states: Dict[str, RequestState] = {}

    def add_request(self, request: Request) -> None:
        self.request_states[request.request_id] = RequestState(request, self.tokenizer)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.request_states

    def process_outputs(self, engine_core_outputs: Iterable[EngineCoreOutput]) -> OutputProcessorOutput:
        """Detokenize each request's new tokens, check stop strings, build the outputs, drop finished requests.

        Outputs for requests no longer here (aborted while the step ran) are ignored, as in vLLM.
        """
        result = OutputProcessorOutput()
        for eco in engine_core_outputs:
            state = self.request_states.get(eco.request_id)
            if state is None:
                continue
            finish_reason, stop_reason = eco.finish_reason, eco.stop_reason
            stop_string = state.detokenizer.update(eco.new_token_ids, finish_reason == "stop")
            if stop_string is not None:
                finish_reason, stop_reason = "stop", stop_string
            out = state.make_request_output(eco.new_token_ids, finish_reason, stop_reason)
            if out is not None:
                result.request_outputs.append(out)
            if finish_reason is not None:
                del self.request_states[eco.request_id]
                if eco.finish_reason is None:  # finished here, still running in the engine core
                    result.reqs_to_abort.append(eco.request_id)
        return result

    def abort_requests(self, request_ids: Iterable[str]) -> List[RequestOutput]:
        """Drop these requests; returns a final output (``finish_reason="abort"``) for each one that was live.

        The held-back text of a stop-string window is released: no stop string completed, so it is output text.
        """
        outputs = []
        for rid in request_ids:
            state = self.request_states.pop(rid, None)
            out = None if state is None else state.make_request_output([], "abort", None)
            if out is not None:  # always, for a live request: a finished one gets its output in every kind
                outputs.append(out)
        return outputs
