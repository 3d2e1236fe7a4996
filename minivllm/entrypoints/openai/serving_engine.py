"""What both serving endpoints share: the model check, error bodies, and one request's stream of deltas
(vLLM 0.32: ``GenerateBaseServing``, the base of
``vllm/entrypoints/openai/completion/serving.py`` and ``chat_completion/serving.py``).

Every check runs before the request reaches the scheduler: the model name and the sampling parameters here, the
prompt (token ids in the vocabulary, length within ``max_model_len`` and the KV cache) in ``LLMEngine.add_request``
on the engine thread, whose ``ValueError`` comes back before any stream starts. A rejected request therefore gets
its 400 and leaves the requests in flight untouched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import AsyncGenerator, List, Optional, Union

from minivllm.engine.async_llm import AsyncLLM, EngineDeadError
from minivllm.engine.llm_engine import PromptType
from minivllm.entrypoints.openai.metrics import RequestTimer, ServerMetrics
from minivllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, UsageInfo, _SamplingRequest
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

_PARAMS = {"n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop",
           "stop_token_ids", "ignore_eos", "prompt", "messages", "model", "stream_options", "logprobs", "echo"}


class RequestError(Exception):
    """A request the server refuses: ``status`` (an ``HTTPStatus``) and the parameter at fault, if any."""

    def __init__(self, message: str, param: Optional[str] = None,
                 status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status

    def to_response(self) -> ErrorResponse:
        """vLLM's error body: ``type`` is the error's class name (``BadRequestError``, ``NotFoundError``, ...),
        ``code`` the HTTP status."""
        kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                503: "ServiceUnavailableError"}.get(self.status.value, "InternalServerError")
        return ErrorResponse(error=ErrorInfo(message=self.message, type=kind, param=self.param,
                                             code=self.status.value))


def param_of(message: str) -> Optional[str]:
    """The request field a validation message is about: minivllm's messages start with the parameter's name
    (``"top_p must be in (0, 1], got 2.0"``); the prompt checks name ``prompt``, ``prompt length`` or
    ``prompt_token_ids``."""
    first = message.split(" ", 1)[0].strip(":,")
    if first.startswith("prompt"):
        return "prompt"
    return first if first in _PARAMS else None


@dataclass
class FinalResult:
    """A finished request's whole output, gathered from its deltas."""

    text: str = ""
    token_ids: List[int] = field(default_factory=list)
    prompt_token_ids: List[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None

    @property
    def usage(self) -> UsageInfo:
        n_in, n_out = len(self.prompt_token_ids), len(self.token_ids)
        return UsageInfo(prompt_tokens=n_in, completion_tokens=n_out, total_tokens=n_in + n_out)


class OpenAIServing:
    """Base of ``OpenAIServingCompletion`` and ``OpenAIServingChat``.

    Args:
        engine_client: the ``AsyncLLM`` that runs the requests.
        served_model_name: the one model name requests may ask for (``/v1/models`` lists it).
        metrics: where TTFT and inter-token latencies are observed (``None``: not recorded).
    """

    def __init__(self, engine_client: AsyncLLM, served_model_name: str,
                 metrics: Optional[ServerMetrics] = None) -> None:
        self.engine_client = engine_client
        self.served_model_name = served_model_name
        self.metrics = metrics
        self.tokenizer = engine_client.engine.tokenizer
        self.max_model_len = engine_client.engine.scheduler_config.max_model_len

    def check_model(self, request: _SamplingRequest) -> None:
        """Raises ``RequestError`` (404) for a model this server does not serve."""
        if request.model is not None and request.model != self.served_model_name:
            raise RequestError(f"The model `{request.model}` does not exist. This server serves "
                               f"`{self.served_model_name}` (see /v1/models).", "model", HTTPStatus.NOT_FOUND)

    def sampling_params(self, request: _SamplingRequest) -> SamplingParams:
        """``request.to_sampling_params()`` with its ``ValueError`` turned into a 400 naming the parameter."""
        if request.logprobs:
            raise RequestError("logprobs are not supported by minivllm's server", "logprobs")
        try:
            return request.to_sampling_params()
        except ValueError as e:
            raise RequestError(str(e), param_of(str(e))) from None

    async def start(self, prompt: PromptType, params: SamplingParams, request_id: str
                    ) -> AsyncGenerator[RequestOutput, None]:
        """Queue the request and return its stream of outputs (DELTA kind).

        Raises:
            RequestError: 400 for anything the engine's input processor rejects (the prompt over
                ``max_model_len``, a token id outside the vocabulary, ...), 503 once the engine is shut down.
        """
        try:
            queue = await self.engine_client.add_request(request_id, prompt, params)
        except ValueError as e:
            raise RequestError(str(e), param_of(str(e))) from None
        except EngineDeadError as e:
            raise RequestError(f"the engine is not running: {e}", None, HTTPStatus.SERVICE_UNAVAILABLE) from None
        return self._timed(self.engine_client.stream_outputs(queue, request_id))

    async def _timed(self, outputs: AsyncGenerator[RequestOutput, None]) -> AsyncGenerator[RequestOutput, None]:
        timer = RequestTimer(self.metrics, time.perf_counter())
        try:
            async for out in outputs:
                timer.on_tokens(time.perf_counter(), len(out.outputs[0].token_ids))
                yield out
        finally:
            await outputs.aclose()  # aborts the request if it has not finished

    @staticmethod
    async def collect(outputs: AsyncGenerator[RequestOutput, None]) -> FinalResult:
        """Gather a request's deltas into its ``FinalResult`` (the non-streaming responses)."""
        result = FinalResult()
        texts: List[str] = []
        try:
            async for out in outputs:
                result.prompt_token_ids = out.prompt_token_ids
                texts.append(out.outputs[0].text)
                result.token_ids.extend(out.outputs[0].token_ids)
                if out.finished:
                    result.finish_reason = out.outputs[0].finish_reason
                    stop = out.outputs[0].stop_reason
                    result.stop_reason = stop if isinstance(stop, (int, str)) else None
        finally:
            await outputs.aclose()
        result.text = "".join(texts)
        return result
