"""Request and response bodies of the OpenAI API, as pydantic models (vLLM 0.32: ``vllm/entrypoints/openai/*/protocol.py``).

Only the fields minivllm serves are declared; unknown fields are ignored, as vLLM does (it logs a warning). Types
are checked by pydantic (a wrong type is a 400 naming the field); value ranges are checked by ``SamplingParams``
when ``to_sampling_params`` builds it, so the server and the offline ``LLM`` share one set of limits and messages.

The fields that can be long (``prompt``, ``messages``, ``stop``, ``stop_token_ids``) are checked first by a plain
loop that stops at the first bad item: pydantic would report every bad item of a union of lists (1.9 million
errors and 17 s on the event loop for a 1.9 MB list of ids ending in a string). Before that loop the long fields
are refused by their length alone, so that no request body (up to the server's ``max_body_bytes``, 5 MB for
SmolLM2) holds the event loop in a check of millions of items: ``stop`` takes at most ``MAX_STOP_STRINGS`` (4)
strings, as vLLM's server does; inside the server a token-id prompt and a conversation may not be longer than
``max_model_len`` (``prompt_token_limit``), and ``stop_token_ids`` and ``logit_bias`` may not name more ids than
the vocabulary has (``vocab_size_limit``), bounds vLLM does not have (see each).

The penalties (``frequency_penalty``, ``presence_penalty``, ``repetition_penalty``), ``logit_bias``, ``n``,
``seed`` (any int64; ``-1`` = none), and logprobs are served as vLLM serves them: completions take ``logprobs``
(an int) and vLLM's extra ``prompt_logprobs``, and answer with the legacy ``logprobs`` object ``{tokens,
token_logprobs, top_logprobs, text_offset}``; chat takes ``logprobs: true`` and ``top_logprobs`` and answers with
``{"content": [{token, logprob, bytes, top_logprobs}]}`` (vLLM ``_create_completion_logprobs`` /
``_create_chat_logprobs``). Fields vLLM honours but minivllm's engine does not (``response_format``, ``tools``,
``tool_choice``) are declared so that a value other than the neutral one is refused with a 400 naming the field,
not silently ignored.

Where minivllm differs from vLLM: a completion takes one prompt (a string, a list of token ids, or a list holding
one of those), not a batch.
"""

from __future__ import annotations

import time
import uuid
from contextvars import ContextVar
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from minivllm.sampling_params import RequestOutputKind, SamplingParams


def random_uuid() -> str:
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    """``{"error": {"message", "type", "param", "code"}}``: the body of every error (vLLM's shape)."""

    error: ErrorInfo


class ModelCard(OpenAIBaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "minivllm"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(OpenAIBaseModel):
    object: str = "list"
    data: List[ModelCard] = Field(default_factory=list)


class StreamOptions(OpenAIBaseModel):
    include_usage: Optional[bool] = False


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


# The serving model's max_model_len while a request body is validated (set per request by api_server's
# RequestBodyGuard; None outside a server). A token-id prompt longer than it is refused by len() before its ids are
# checked one by one: a 5 MB body of "1," holds 2.4 million ids, whose checks (ours, then pydantic's list[int])
# held the event loop 0.45 s. vLLM checks the length after validating the request (``_token_len_check`` in
# ``vllm/renderers/params.py``); minivllm checks it first, with the same outcome for every request: a 400.
prompt_token_limit: ContextVar[Optional[int]] = ContextVar("prompt_token_limit", default=None)


# The serving model's vocabulary size while a request body is validated (set per request by api_server's
# RequestBodyGuard; None outside a server). ``stop_token_ids`` and ``logit_bias`` may not hold more entries than
# the vocabulary has ids, checked by len() before anything looks at an item. vLLM 0.32 has no such bound: its
# server validates every item (pydantic's list[int] / dict[str, float]), ``SamplingParams.from_optional`` converts
# every ``logit_bias`` key, and ``_validate_stop_token_ids`` / ``_validate_logit_bias`` then refuse any id outside
# the vocabulary (https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/sampling_params.py#L1047-L1090).
# minivllm adds it because one 5 MB body holds 2.6 million stop token ids or 470,000 logit_bias keys, whose checks
# held the event loop, and so every other stream: a neighbour's longest gap of 0.5-0.7 s and 1.8-2.3 s (live,
# SmolLM2's 5 MB body limit, a 2-core AMD EPYC at load 5; 0.25-0.29 s and 0.54-0.60 s at load 3), against
# 0.22-0.29 s and 0.72-1.09 s (0.14-0.15 s and 0.21-0.26 s) with the bound; what is left is mostly json.loads
# itself (0.65-0.79 s for the 470,000 keys at load 5), which no bound on a field avoids. A request past the bound names an id outside the vocabulary, which vLLM refuses
# too, or names one id more than once (copies of a valid stop token id, which vLLM keeps once; a logit_bias id
# spelt both "1" and "01"), which vLLM serves and minivllm refuses.
vocab_size_limit: ContextVar[Optional[int]] = ContextVar("vocab_size_limit", default=None)

# vLLM 0.32's ``VLLM_MAX_STOP_STRINGS`` (default 4): the most stop strings a request to the server may have, a
# bound its protocol puts on ``stop`` (``StopParam``, ``Field(max_length=...)``:
# https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/entrypoints/generate/base/protocol.py#L26-L28). The
# detokenizer looks for every stop string after each step, and 1.3 million of them in a 5 MB body (a two-token
# request) gave a neighbour stream gaps of 0.9-1.1 s at load 5 (0.28-0.31 s at load 3); refused, 0.16-0.25 s
# (0.07-0.08 s, its baseline). minivllm has no setting for it (vLLM reads the environment
# variable); the offline ``SamplingParams`` takes any number, as vLLM's does.
MAX_STOP_STRINGS = 4


def _check_count(value: Any, name: str, limit: Optional[int], what: str) -> None:
    """Raises ``ValueError`` naming ``name`` and ``limit`` when the list or dict ``value`` has more than ``limit``
    entries (``None``: no limit); by ``len()`` alone, before any entry is looked at."""
    if limit is not None and isinstance(value, (list, dict)) and len(value) > limit:
        raise ValueError(f"{name} has {len(value)} entries, more than the {limit} allowed ({what})")


def _check_prompt_length(ids: Any) -> None:
    limit = prompt_token_limit.get()
    if limit is not None and isinstance(ids, list) and len(ids) > limit:
        raise ValueError(f"prompt length ({len(ids)} tokens) is longer than max_model_len ({limit})")


def _first_bad(items: List[Any], ok) -> Optional[int]:
    for i, item in enumerate(items):
        if not ok(item):
            return i
    return None


def _is_token_id(t: Any) -> bool:
    return type(t) is int  # not bool, not float: the engine takes ints only


def _check_token_ids(value: Any, name: str) -> Any:
    if isinstance(value, list):
        bad = _first_bad(value, _is_token_id)
        if bad is not None:
            raise ValueError(f"{name}[{bad}] must be a token id (an int), got {type(value[bad]).__name__}")
    return value


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: it can never be matched or tokenized
        return False
    return True


def _check_strings(value: Any, name: str) -> Any:
    if isinstance(value, list):
        bad = _first_bad(value, lambda x: isinstance(x, str))
        if bad is not None:
            raise ValueError(f"{name}[{bad}] must be a string, got {type(value[bad]).__name__}")
        bad = _first_bad(value, _encodable)
        if bad is not None:
            raise ValueError(f"{name}[{bad}] is not valid Unicode (a lone surrogate)")
    elif isinstance(value, str) and not _encodable(value):
        raise ValueError(f"{name} is not valid Unicode (a lone surrogate)")
    return value


# The neutral values of each field vLLM 0.32's server honours and minivllm's engine does not implement (vLLM's
# defaults; vllm/entrypoints/openai/completion/protocol.py and chat_completion/protocol.py): a request that sets
# one otherwise gets a 400 naming it, rather than having it silently ignored. Fields an endpoint lacks are skipped.
UNSUPPORTED_FIELDS: Dict[str, Tuple[Any, ...]] = {
    "response_format": (None, {"type": "text"}), "tools": (None, []), "tool_choice": (None, "none"),
    "allowed_token_ids": (None, []), "bad_words": (None, []), "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,), "truncate_prompt_tokens": (None,),
    "priority": (0,), "structured_outputs": (None,), "guided_json": (None,), "guided_regex": (None,),
    "guided_choice": (None,), "guided_grammar": (None,), "suffix": (None, ""),
    "functions": (None, []), "function_call": (None, "none"), "continue_final_message": (False,),
    "chat_template": (None,), "chat_template_kwargs": (None, {}),
    "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0), "logprob_token_ids": (None, []),
    "return_tokens_as_token_ids": (None, False), "return_token_offsets": (None, False), "cache_salt": (None,),
    "truncation_side": (None,), "thinking_token_budget": (None,), "repetition_detection": (None,),
    "watermarking": (None,), "prompt_embeds": (None,), "stream_interval": (None, 1),
    "documents": (None, []), "mm_processor_kwargs": (None, {}), "reasoning_effort": (None,),
    "include_reasoning": (None, True), "parallel_tool_calls": (None, True), "return_prompt_text": (None, False),
    "chat_prompt_logprobs": (None,), "echo": (False,),
}


class _SamplingRequest(OpenAIBaseModel):
    """The sampling fields common to both endpoints (OpenAI's, plus vLLM's extras ``top_k``, ``min_p``,
    ``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ``return_token_ids``)."""

    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    return_token_ids: bool = False  # vLLM's extra: token ids in each choice (and the prompt's in the response)
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None  # vLLM's extra
    logit_bias: Optional[Dict[str, float]] = None
    # Refused unless neutral (see UNSUPPORTED_FIELDS): the engine has no grammars, tools, bad words, allowed-token
    # masks or truncation, the server no --scheduling-policy (priority) and no template choice.
    response_format: Optional[Dict[str, Any]] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Union[str, Dict[str, Any]]] = None
    allowed_token_ids: Optional[List[int]] = None
    bad_words: Optional[List[str]] = None
    include_stop_str_in_output: Any = False
    skip_special_tokens: Any = True
    spaces_between_special_tokens: Any = True
    truncate_prompt_tokens: Optional[int] = None
    priority: Any = 0
    structured_outputs: Optional[Dict[str, Any]] = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    logprob_token_ids: Any = None
    return_tokens_as_token_ids: Any = None
    return_token_offsets: Any = None
    cache_salt: Any = None
    truncation_side: Any = None
    thinking_token_budget: Any = None
    repetition_detection: Any = None
    watermarking: Any = None
    prompt_embeds: Any = None
    stream_interval: Any = None

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _stop_token_ids(cls, value: Any) -> Any:
        _check_count(value, "stop_token_ids", vocab_size_limit.get(), "the vocabulary's size; see vocab_size_limit")
        return _check_token_ids(value, "stop_token_ids")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        _check_count(value, "stop", MAX_STOP_STRINGS, "stop strings a request may have, vLLM's "
                     "VLLM_MAX_STOP_STRINGS default")
        return _check_strings(value, "stop")

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, value: Any) -> Any:
        _check_count(value, "logit_bias", vocab_size_limit.get(), "the vocabulary's size; see vocab_size_limit")
        return value

    def unsupported_field(self) -> Optional[Tuple[str, Any]]:
        """``(name as the client sent it, value)`` of the first field set to a value minivllm cannot honour."""
        fields = type(self).model_fields
        for name, neutral in UNSUPPORTED_FIELDS.items():
            if name in fields and getattr(self, name) not in neutral:
                return fields[name].alias or name, getattr(self, name)
        return None

    def _max_tokens(self) -> Optional[int]:
        raise NotImplementedError

    def _logprobs(self) -> Tuple[Optional[int], Optional[int]]:
        """``(logprobs, prompt_logprobs)`` for ``SamplingParams`` (each endpoint its own fields)."""
        raise NotImplementedError

    def to_sampling_params(self) -> SamplingParams:
        """The ``SamplingParams`` of this request; DELTA outputs when streaming, else FINAL_ONLY.

        Defaults are OpenAI's (temperature 1, top_p 1); ``max_tokens=None`` means up to ``max_model_len``, and a
        larger ``max_tokens`` is capped at ``max_model_len`` minus the prompt, as vLLM 0.32's server does
        (``get_max_tokens`` in ``vllm/entrypoints/serve/utils/api_utils.py``).

        Raises:
            ValueError: a value out of range, naming the parameter and the limit (from ``SamplingParams``).
        """
        logprobs, prompt_logprobs = self._logprobs()
        kwargs: Dict[str, Any] = dict(
            n=self.n, seed=self.seed, logprobs=logprobs, prompt_logprobs=prompt_logprobs, max_tokens=self._max_tokens(), min_tokens=self.min_tokens,
            stop=self.stop or (), stop_token_ids=self.stop_token_ids or (), ignore_eos=self.ignore_eos,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        )
        for name in ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        if self.logit_bias:
            bias: Dict[int, float] = {}
            for t, b in self.logit_bias.items():
                # A token id has at most 19 digits; longer keys (int() refuses past 4,300) are not token ids.
                digits = t.strip().lstrip("+-")
                if not digits.isdigit() or len(digits) > 19:
                    raise ValueError(f"logit_bias keys must be token ids (integers as strings), got {t[:100]!r}")
                bias[int(t)] = b
            kwargs["logit_bias"] = bias
        return SamplingParams(**kwargs)


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``. ``prompt``: a string, a list of token ids, or a one-element list of either."""

    prompt: Union[str, List[int], List[str], List[List[int]]]
    max_tokens: Optional[int] = 16
    echo: bool = False  # refused (serving_completion.py)
    suffix: Optional[str] = None  # refused unless neutral (UNSUPPORTED_FIELDS)
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None  # vLLM's extra

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        if not isinstance(value, list) or not value:
            return value
        if isinstance(value[0], str):
            return _check_strings(value, "prompt")
        if isinstance(value[0], list):
            for ids in value[:2]:  # one prompt is served; a second is refused as a batch (serving_completion)
                _check_prompt_length(ids)
            bad = _first_bad(value, lambda x: isinstance(x, list))
            if bad is not None:
                raise ValueError(f"prompt[{bad}] must be a list of token ids, got {type(value[bad]).__name__}")
            for i, ids in enumerate(value):
                _check_token_ids(ids, f"prompt[{i}]")
            return value
        _check_prompt_length(value)
        return _check_token_ids(value, "prompt")

    def _max_tokens(self) -> Optional[int]:
        return self.max_tokens

    def _logprobs(self) -> Tuple[Optional[int], Optional[int]]:
        return self.logprobs, self.prompt_logprobs


class ChatMessage(OpenAIBaseModel):
    role: str
    content: Optional[Union[str, List[Dict[str, Any]]]] = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> Any:
        if isinstance(value, list):
            bad = _first_bad(value, lambda x: isinstance(x, dict))
            if bad is not None:
                raise ValueError(f"content[{bad}] must be a content part (an object), got {type(value[bad]).__name__}")
        return value


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return "an object with keys " + ", ".join(repr(k) for k in list(value)[:8])[:200]
    return type(value).__name__


def _is_message(m: Any) -> bool:
    return (isinstance(m, dict) and isinstance(m.get("role"), str)
            and (m.get("content") is None or isinstance(m["content"], (str, list))))


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` (OpenAI's newer name) wins over ``max_tokens``."""

    messages: List[ChatMessage]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    add_generation_prompt: bool = True
    functions: Optional[List[Dict[str, Any]]] = None  # refused unless neutral (UNSUPPORTED_FIELDS)
    function_call: Any = None
    continue_final_message: Any = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    echo: Any = False  # refused unless neutral, as the rest (UNSUPPORTED_FIELDS)
    documents: Any = None
    mm_processor_kwargs: Any = None
    reasoning_effort: Any = None
    include_reasoning: Any = None
    parallel_tool_calls: Any = None
    return_prompt_text: Any = None
    # vLLM's chat takes prompt_logprobs too; minivllm's chat endpoint does not serve it (its completions do)
    chat_prompt_logprobs: Any = Field(default=None, alias="prompt_logprobs")
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = 0

    @field_validator("messages", mode="before")
    @classmethod
    def _messages(cls, value: Any) -> Any:
        limit = prompt_token_limit.get()
        if limit is not None and isinstance(value, list) and len(value) > limit:
            # Before pydantic builds a ChatMessage for each (0.64 s on the event loop for 160,000) and the
            # template renders them: a chat template spends at least one token on each message (ChatML, the
            # GGUF's, three: <|im_start|>, the role, <|im_end|>). vLLM renders them first.
            raise ValueError(f"{len(value)} messages cannot fit in max_model_len ({limit}) tokens: the chat "
                             "template spends at least one token on each")
        if isinstance(value, list):
            bad = _first_bad(value, _is_message)
            if bad is not None:
                raise ValueError(f"messages[{bad}] must be an object with a string 'role' and a string, list or "
                                 f"null 'content', got {_describe(value[bad])}")
        return value

    def _max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _logprobs(self) -> Tuple[Optional[int], Optional[int]]:
        """vLLM's chat rules (``ChatCompletionRequest.check_logprobs`` / ``to_sampling_params``)."""
        top = self.top_logprobs
        if top is not None and top < 0 and top != -1:
            raise ValueError(f"top_logprobs must be a non-negative int or -1, got {top}")
        if top and not self.logprobs:
            raise ValueError("top_logprobs: when using `top_logprobs`, `logprobs` must be set to true")
        return (top or 0) if self.logprobs else None, None


class _ResponseChoice(OpenAIBaseModel):
    """The fields every choice shares, completion or chat, whole or streamed (vLLM's protocol repeats them)."""

    index: int = 0
    logprobs: Optional[Any] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    token_ids: Optional[List[int]] = None


class _Response(OpenAIBaseModel):
    """The envelope every response and stream chunk shares; ``object`` is set by each subclass."""

    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: Optional[UsageInfo] = None


class CompletionLogProbs(OpenAIBaseModel):
    """The legacy completions ``logprobs`` object (vLLM ``CompletionLogProbs``)."""

    text_offset: List[int] = Field(default_factory=list)
    token_logprobs: List[Optional[float]] = Field(default_factory=list)
    tokens: List[str] = Field(default_factory=list)
    top_logprobs: List[Optional[Dict[str, float]]] = Field(default_factory=list)


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: Optional[List[int]] = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: List[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: Optional[List[ChatCompletionLogProbsContent]] = None


class CompletionResponseChoice(_ResponseChoice):
    text: str
    prompt_logprobs: Optional[List[Optional[Dict[int, Dict[str, Any]]]]] = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: List[CompletionResponseChoice]
    prompt_token_ids: Optional[List[int]] = None


class CompletionStreamResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: List[CompletionResponseChoice]


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: Optional[str] = None


class ChatCompletionResponseChoice(_ResponseChoice):
    message: ChatResponseMessage


class ChatCompletionResponse(_Response):
    """A whole chat completion; unlike the stream chunks, it always carries ``usage``."""

    object: Literal["chat.completion"] = "chat.completion"
    choices: List[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_token_ids: Optional[List[int]] = None


class DeltaMessage(OpenAIBaseModel):
    role: Optional[str] = None
    content: Optional[str] = None


class ChatCompletionResponseStreamChoice(_ResponseChoice):
    delta: DeltaMessage


class ChatCompletionStreamResponse(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: List[ChatCompletionResponseStreamChoice]
