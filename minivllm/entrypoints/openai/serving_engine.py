"""What both serving endpoints share: the model check, error bodies, the prompt's tokenization and one request's
stream of deltas (vLLM 0.32: ``GenerateBaseServing``, the base of
``vllm/entrypoints/openai/completion/serving.py`` and ``chat_completion/serving.py``).

Every check runs before the request reaches the scheduler. Here, in the API server: the model name, the sampling
parameters, and the prompt's length against ``max_model_len``, first by a bound that needs no tokenizer (a list of
more ids than ``max_model_len``; a text longer than ``max_model_len * max_chars_per_token`` characters, vLLM's
``_text_len_check`` in ``vllm/renderers/params.py``), then on the token ids. Text is tokenized (and a chat
rendered) in a one-thread pool, as vLLM's renderer does (``vllm/renderers/base.py``), so that the event loop keeps
sending other streams' tokens meanwhile; the engine gets token ids. The rest (ids in the vocabulary, the KV
cache's size) is checked by ``LLMEngine.add_request`` on the engine thread, whose ``ValueError`` comes back before
any stream starts. A rejected request therefore gets its 400 and leaves the requests in flight untouched.

An engine that dies (its thread raised) ends every open request with an error, not an ``"abort"``: a whole
response is a 500, a stream gets an error event before ``[DONE]`` (vLLM: ``EngineDeadError``); the server then
shuts down (``api_server.run_server``).
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, AsyncGenerator, Callable, Dict, List, Optional, Union

from minivllm.engine.async_llm import AsyncLLM, EngineDeadError
from minivllm.engine.llm_engine import PromptType
from minivllm.entrypoints.openai.metrics import RequestTimer, ServerMetrics
from minivllm.entrypoints.openai.protocol import (ChatCompletionLogProb, ChatCompletionLogProbs,
                                                  ChatCompletionLogProbsContent, CompletionLogProbs, ErrorInfo,
                                                  ErrorResponse, UsageInfo, _SamplingRequest)
from minivllm.outputs import Logprob, PromptLogprobs, RequestOutput, SampleLogprobs
from minivllm.sampling_params import SamplingParams

# vLLM bounds what an error message echoes (``_MAX_ERROR_CHARS`` in
# ``vllm/entrypoints/serve/exception_handling/handlers/validation.py``): a 5 MB bad field must not make a 5 MB error.
MAX_ERROR_CHARS = 1000

_PARAMS = {"n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop",
           "stop_token_ids", "ignore_eos", "prompt", "messages", "model", "stream_options", "logprobs", "echo",
           "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "prompt_logprobs",
           "top_logprobs"}


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
                405: "MethodNotAllowedError", 413: "RequestEntityTooLargeError", 415: "UnsupportedMediaTypeError",
                499: "ClientClosedRequestError", 503: "ServiceUnavailableError"}.get(self.status.value)
        if kind is None:  # a client error is never labelled a server error
            kind = "BadRequestError" if self.status.value < 500 else "InternalServerError"
        return ErrorResponse(error=ErrorInfo(message=truncate(self.message), type=kind, param=self.param,
                                             code=self.status.value))


def error_event(e: RequestError) -> str:
    """An error inside a stream that already started (vLLM sends one ``data:`` event with the error body)."""
    return f"data: {json.dumps(e.to_response().model_dump())}\n\n"


def truncate(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` cut to ``limit`` characters, marked as vLLM marks it."""
    return text if len(text) <= limit else text[:limit] + "...[truncated]"


class EngineDeadRequestError(RequestError):
    """The engine died under this request (vLLM's ``EngineDeadError``): a 500; the server shuts down."""

    def __init__(self) -> None:
        super().__init__("the engine died (EngineDeadError: its loop raised; see the server's log); the server is "
                         "shutting down", None, HTTPStatus.INTERNAL_SERVER_ERROR)


def engine_dead(engine_client: AsyncLLM) -> bool:
    """True once the engine's thread died by an error, not by ``shutdown()`` (whose aborts are normal ends):
    ``AsyncLLM.dead_error`` is set (vLLM's ``EngineClient.errored`` with its ``dead_error``)."""
    return engine_client.dead_error is not None


def param_of(message: str) -> Optional[str]:
    """The request field a validation message is about: minivllm's messages start with the parameter's name
    (``"top_p must be in (0, 1], got 2.0"``); the prompt checks name ``prompt``, ``prompt length`` or
    ``prompt_token_ids``."""
    first = message.split(" ", 1)[0].strip(":,")
    if first.startswith("prompt") and first != "prompt_logprobs":
        return "prompt"
    return first if first in _PARAMS else None


@dataclass
class FinalResult:
    """One choice of a finished request, gathered from its outputs (``index``: the completion's, for ``n > 1``)."""

    text: str = ""
    token_ids: List[int] = field(default_factory=list)
    prompt_token_ids: List[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    index: int = 0
    logprobs: Optional[SampleLogprobs] = None
    prompt_logprobs: Optional[PromptLogprobs] = None

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
                 metrics: Optional[ServerMetrics] = None, executor: Optional[Executor] = None) -> None:
        self.engine_client = engine_client
        self.served_model_name = served_model_name
        self.metrics = metrics
        self.tokenizer = engine_client.engine.tokenizer
        self.max_model_len = engine_client.engine.scheduler_config.max_model_len
        self.max_chars_per_token = max_chars_per_token(self.tokenizer)
        # One thread: a Hugging Face tokenizer is not safe to call from several at once; the engine thread only
        # decodes.
        self.executor = executor or ThreadPoolExecutor(1, thread_name_prefix="minivllm-tokenize")

    async def run_in_executor(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the tokenizer thread; a ``RequestError`` it raises comes back here."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def check_length(self, num_tokens: int) -> None:
        """Raises ``RequestError`` (400, ``prompt``) for a prompt of more than ``max_model_len`` tokens."""
        if num_tokens > self.max_model_len:
            raise RequestError(f"prompt length ({num_tokens} tokens) is longer than max_model_len "
                               f"({self.max_model_len})", "prompt")

    def check_text_length(self, text: str, param: str = "prompt") -> None:
        """Before tokenizing: a text of more than ``max_model_len * max_chars_per_token`` characters cannot fit
        (vLLM 0.32: ``TokenizeParams._text_len_check`` in ``vllm/renderers/params.py``)."""
        limit = self.max_model_len * self.max_chars_per_token
        if self.max_chars_per_token and len(text) > limit:
            raise RequestError(f"prompt length: the text has {len(text)} characters, more than the {limit} that "
                               f"max_model_len ({self.max_model_len}) tokens of at most {self.max_chars_per_token} "
                               "characters each can hold", param)

    def tokenize(self, text: str, param: str = "prompt") -> List[int]:
        """The token ids of ``text`` as the engine would make them (``add_special_tokens=False``); on the
        tokenizer thread. Raises ``RequestError`` (400) for text the tokenizer refuses or one over
        ``max_model_len``."""
        self.check_text_length(text, param)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate ("\ud800"): JSON allows it, UTF-8 and tokenizers don't
            raise RequestError(f"{param} is not valid Unicode: a lone surrogate U+{ord(text[e.start]):04X} at "
                               f"character {e.start}", param) from None
        if self.tokenizer is None:
            raise RequestError(f"{param}: this model has no tokenizer; pass token ids", param)
        try:
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        except (ValueError, TypeError, OverflowError) as e:  # vLLM answers these with a 400 (error_response.py)
            raise RequestError(f"{param}: the tokenizer refused it: {e}", param) from None
        self.check_length(len(ids))
        return ids

    def check_model(self, request: _SamplingRequest) -> None:
        """Raises ``RequestError`` (404) for a model this server does not serve."""
        if request.model is not None and request.model != self.served_model_name:
            raise RequestError(f"The model `{request.model}` does not exist. This server serves "
                               f"`{self.served_model_name}` (see /v1/models).", "model", HTTPStatus.NOT_FOUND)

    def sampling_params(self, request: _SamplingRequest) -> SamplingParams:
        """``request.to_sampling_params()`` with its ``ValueError`` turned into a 400 naming the parameter."""
        unsupported = request.unsupported_field()
        if unsupported is not None:
            name, value = unsupported
            raise RequestError(f"{name} is not supported by minivllm's server (its engine has no structured "
                               f"outputs, tools, bad words, allowed-token masks, beam search or prompt truncation, "
                               f"and it serves one scheduling policy and one chat template); got {name}="
                               f"{truncate(repr(value), 200)}", name)
        if request.stream_options is not None and not request.stream:  # vLLM's check, its words
            raise RequestError("Stream options can only be defined when `stream=True`.", "stream_options")
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
            # The exception's traceback holds AsyncLLM.add_request's frame, whose future holds the exception:
            # a cycle that would keep the prompt (in the engine's frames) alive until a garbage collection.
            e.__traceback__ = None
            raise RequestError(str(e), param_of(str(e))) from None
        except EngineDeadError as e:
            e.__traceback__ = None
            raise RequestError(f"the engine is not running: {e}", None, HTTPStatus.SERVICE_UNAVAILABLE) from None
        # Known now (the server hands the engine token ids), so an abort before any output still counts them.
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt if isinstance(prompt, list) else None
        return self._timed(self.engine_client.stream_outputs(queue, request_id), len(ids) if ids else 0)

    async def _timed(self, outputs: AsyncGenerator[RequestOutput, None],
                     num_prompt_tokens: int = 0) -> AsyncGenerator[RequestOutput, None]:
        timer = RequestTimer(self.metrics, time.perf_counter())
        finished = False
        try:
            async for out in outputs:
                if out.finished and out.outputs[0].finish_reason == "abort" and engine_dead(self.engine_client):
                    raise EngineDeadRequestError()
                num_prompt_tokens, finished = len(out.prompt_token_ids) or num_prompt_tokens, out.finished
                timer.on_tokens(time.perf_counter(), sum(len(c.token_ids) for c in out.outputs), out.metrics)
                if finished:
                    timer.on_finished(time.perf_counter(), num_prompt_tokens, out.outputs[0].finish_reason)
                yield out
        finally:
            if not finished:  # the client left (or the engine died): counted as vLLM counts an abort
                timer.on_finished(time.perf_counter(), num_prompt_tokens, "abort")
            await outputs.aclose()  # aborts the request if it has not finished

    @staticmethod
    async def collect(outputs: AsyncGenerator[RequestOutput, None]) -> List[FinalResult]:
        """Gather a request's outputs into one ``FinalResult`` per choice, by index (the non-streaming responses;
        their outputs are ``FINAL_ONLY``, but deltas are gathered too)."""
        results: Dict[int, FinalResult] = {}
        texts: Dict[int, List[str]] = {}
        try:
            async for out in outputs:
                for c in out.outputs:
                    result = results.setdefault(c.index, FinalResult(index=c.index))
                    result.prompt_token_ids = out.prompt_token_ids
                    if out.prompt_logprobs is not None:
                        result.prompt_logprobs = out.prompt_logprobs
                    texts.setdefault(c.index, []).append(c.text)
                    result.token_ids.extend(c.token_ids)
                    if c.logprobs is not None:
                        result.logprobs = (result.logprobs or []) + list(c.logprobs)
                    if c.finish_reason is not None:
                        result.finish_reason = c.finish_reason
                        result.stop_reason = c.stop_reason if isinstance(c.stop_reason, (int, str)) else None
        finally:
            await outputs.aclose()
        for i, result in results.items():
            result.text = "".join(texts[i])
        return [results[i] for i in sorted(results)]


def usage_of(results: List[FinalResult]) -> UsageInfo:
    """The usage of all choices: the prompt once, every choice's tokens (vLLM's ``num_generated_tokens``)."""
    n_in = len(results[0].prompt_token_ids) if results else 0
    n_out = sum(len(r.token_ids) for r in results)
    return UsageInfo(prompt_tokens=n_in, completion_tokens=n_out, total_tokens=n_in + n_out)


def _token_text(tokenizer: Any, token_id: int, lp: Optional[Logprob]) -> str:
    """vLLM ``_get_decoded_token``: the token's text, or ``token_id:<id>`` where there is none (no tokenizer)."""
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id])


def completion_logprobs(tokenizer: Any, token_ids: List[int], logprobs: SampleLogprobs, num_top: int,
                        initial_text_offset: int = 0) -> CompletionLogProbs:
    """The legacy completions ``logprobs`` object (vLLM ``OpenAIServingCompletion._create_completion_logprobs``):
    each token's text and logprob (floored at -9999), its ``num_top + 1`` first entries (the sampled token, then
    the top ones: OpenAI's "up to logprobs + 1"), and text offsets from ``initial_text_offset``."""
    out = CompletionLogProbs()
    last_len = 0
    for tid, step in zip(token_ids, logprobs):
        lp = step.get(tid)
        token = _token_text(tokenizer, tid, lp)
        out.tokens.append(token)
        out.token_logprobs.append(None if lp is None else max(lp.logprob, -9999.0))
        out.top_logprobs.append({_token_text(tokenizer, t, p): max(p.logprob, -9999.0)
                                 for i, (t, p) in enumerate(step.items()) if num_top >= i})
        out.text_offset.append(initial_text_offset if not out.text_offset else out.text_offset[-1] + last_len)
        last_len = len(token)
    return out


def chat_logprobs(tokenizer: Any, token_ids: List[int], logprobs: SampleLogprobs,
                  top_logprobs: int) -> ChatCompletionLogProbs:
    """Chat's ``{"content": [...]}`` (vLLM ``OpenAIServingChat._create_chat_logprobs``): each token with its
    logprob and UTF-8 bytes, and the first ``top_logprobs`` entries of its dict (``_get_top_logprobs``, which
    takes them in the dict's order: the sampled token first)."""
    content = []
    for tid, step in zip(token_ids, logprobs):
        lp = step.get(tid)
        token = _token_text(tokenizer, tid, lp)
        tops = [ChatCompletionLogProb(token=(t_text := _token_text(tokenizer, t, p)),
                                      logprob=max(p.logprob, -9999.0),
                                      bytes=list(t_text.encode("utf-8", errors="replace")))
                for i, (t, p) in enumerate(step.items()) if top_logprobs and (top_logprobs == -1 or i < top_logprobs)]
        content.append(ChatCompletionLogProbsContent(
            token=token, logprob=-9999.0 if lp is None else max(lp.logprob, -9999.0),
            bytes=list(token.encode("utf-8", errors="replace")), top_logprobs=tops))
    return ChatCompletionLogProbs(content=content)


def prompt_logprobs_json(prompt_logprobs: Optional[PromptLogprobs]) -> Optional[List[Optional[Dict[int, Dict[str, Any]]]]]:
    """vLLM's ``prompt_logprobs`` of a completion choice: ``{token id: {logprob, rank, decoded_token}}`` per
    prompt position, ``None`` first."""
    if prompt_logprobs is None:
        return None
    return [None if d is None else {t: {"logprob": max(p.logprob, -9999.0), "rank": p.rank,
                                        "decoded_token": p.decoded_token} for t, p in d.items()}
            for d in prompt_logprobs]


def max_chars_per_token(tokenizer: Any) -> int:
    """The longest vocabulary entry, in characters (0 without a tokenizer): no token covers more of a text
    (vLLM 0.32: ``max_chars_per_token`` in ``vllm/tokenizers/hf.py``)."""
    if tokenizer is None or not hasattr(tokenizer, "get_vocab"):
        return 0
    return max((len(t) for t in tokenizer.get_vocab()), default=0)
