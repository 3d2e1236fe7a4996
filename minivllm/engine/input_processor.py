"""Prompt and parameter validation, tokenization, and the ``Request`` (vLLM: ``vllm/v1/engine/input_processor.py``).

Every check runs before anything is queued, so a rejected request changes no engine state and never disturbs the
requests in flight. Where minivllm differs from vLLM: vLLM's input processor builds an ``EngineCoreRequest`` that is
sent (possibly to another process) and turned into a ``Request`` by the engine core; minivllm runs everything in
one process and builds the ``Request`` here.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from minivllm.config import VllmConfig
from minivllm.i18n import _
from minivllm.utils.math_utils import cdiv
from minivllm.core.kv_cache_utils import get_request_block_hasher
from minivllm.request import Request
from minivllm.sampling_params import SamplingParams

PromptType = Union[str, Sequence[int], Dict[str, Any]]



# vLLM's ModelConfig.max_logprobs default: the most logprobs / prompt_logprobs a request may ask for (-1, the whole
# vocabulary, is therefore refused too unless the vocabulary is that small). minivllm has no setting for it.
MAX_LOGPROBS = 20

class InputProcessor:
    """Turns ``(request_id, prompt, params)`` into a validated ``Request``.

    Args:
        vllm_config: the engine's config (limits, block size, pool size, vocabulary), its pool already sized.
        tokenizer: a transformers tokenizer, or ``None`` (token-id prompts only).
    """

    def __init__(self, vllm_config: VllmConfig, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size: int = vllm_config.hf_config.vocab_size
        self.max_model_len = vllm_config.scheduler_config.max_model_len
        cache = vllm_config.cache_config
        assert cache.num_gpu_blocks is not None  # set by EngineCore._initialize_kv_caches
        self.block_size, self.num_gpu_blocks = cache.block_size, cache.num_gpu_blocks
        caching_or_connector = cache.enable_prefix_caching or vllm_config.kv_transfer_config is not None
        self._block_hasher: Optional[Callable] = get_request_block_hasher(self.block_size) if caching_or_connector else None
        tok_eos = getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer is not None else None
        self.eos_token_id: Optional[int] = tok_eos if tok_eos is not None else vllm_config.hf_config.eos_token_id

    def tokenize(self, prompt: Any) -> Tuple[Optional[str], List[int]]:
        """``(prompt text or None, token ids)`` of a ``PromptType``; raises ``ValueError`` for anything else."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return self.tokenize(list(prompt["prompt_token_ids"]))
            return self.tokenize(prompt.get("prompt"))
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids ({'prompt_token_ids': [...]})")
            return prompt, list(self.tokenizer.encode(prompt, add_special_tokens=False))
        if isinstance(prompt, torch.Tensor) and prompt.dim() == 1 and not prompt.is_floating_point():
            prompt = prompt.tolist()
        if isinstance(prompt, (list, tuple)):
            for t in prompt:
                if not isinstance(t, numbers.Integral) or isinstance(t, bool):
                    raise ValueError(f"prompt_token_ids must be ints, got {t!r} ({type(t).__name__})")
            return None, [int(t) for t in prompt]
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def child_request(self, request: Request, child_id: str, seed: Optional[int]) -> Request:
        """Child ``child_id`` of a request ``process_inputs`` already validated (``n > 1``): the same prompt and
        settings, its own ``seed`` and token list, with nothing checked or tokenized again (vLLM validates the
        parent once in its front end, then fans out)."""
        params = request.sampling_params.clone()
        params.n, params.seed = 1, seed
        child = Request(
            child_id, list(request.prompt_token_ids), params, arrival_time=request.arrival_time,
            priority=request.priority, eos_token_id=self.eos_token_id, prompt=request.prompt,
            cache_salt=request.cache_salt,
        )
        if self._block_hasher is not None:
            # Same prompt, same salt: the same block hashes; hashing them again per child cost most of a big n.
            child.block_hashes = list(request.block_hashes)
            child._block_hasher = self._block_hasher
        return child

    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: Optional[SamplingParams] = None,
        arrival_time: Optional[float] = None,
        priority: Optional[int] = None,
        cache_salt: Optional[str] = None,
    ) -> Request:
        """Validate and build the ``Request`` (the caller checks that ``request_id`` is free).

        ``prompt + max_tokens`` beyond ``max_model_len`` is *capped*, not rejected (as in vLLM's ``LLM`` class):
        generation stops at ``max_model_len`` tokens with ``finish_reason == "length"``. The caller's
        ``params`` is not modified: the request gets a copy with ``eos_token_id`` and ``max_tokens`` filled in.

        Raises:
            ValueError: params not a ``SamplingParams``; empty prompt; a token id outside ``[0, vocab_size)``; a
                prompt longer than ``max_model_len``; a prompt that needs more KV blocks than the pool has; a stop
                token id or ``logit_bias`` id outside the vocabulary; ``logprobs`` / ``prompt_logprobs`` over
                ``MAX_LOGPROBS``; a bad ``arrival_time`` or ``priority``; stop strings without a
                tokenizer.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        text, ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("prompt must contain at least one token, got an empty prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids contains {bad[0]}, outside the vocabulary [0, {self.vocab_size})")
        bs, num_blocks = self.block_size, self.num_gpu_blocks
        need = cdiv(len(ids), bs)
        # Checked before max_model_len (which is <= the cache's capacity) so that the message names the cause.
        # Both messages are translated (minivllm.i18n): notebook 10 provokes the first on purpose.
        if need > num_blocks:
            raise ValueError(_(
                "prompt of {tokens} tokens needs {need} KV blocks of block_size={block_size} but the whole cache has "
                "num_gpu_blocks={num_blocks} ({capacity} tokens): it could never be scheduled").format(
                    tokens=len(ids), need=need, block_size=bs, num_blocks=num_blocks, capacity=num_blocks * bs))
        if len(ids) > self.max_model_len:
            raise ValueError(_("prompt length ({tokens} tokens) is longer than max_model_len ({max_model_len})").format(
                tokens=len(ids), max_model_len=self.max_model_len))
        # Both are kept once per id (SamplingParams), so more entries than the vocabulary has ids means one
        # outside it: said by len() before a scan of each (on the engine thread, under AsyncLLM).
        for name, listed in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ())):
            if len(listed) > self.vocab_size:
                raise ValueError(f"{name} has {len(listed)} distinct token ids, more than the vocabulary's "
                                 f"{self.vocab_size}: some are outside it")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids contains {bad[0]}, outside the vocabulary [0, {self.vocab_size})")
        if params.logit_bias:  # vLLM SamplingParams._validate_logit_bias
            bad = [t for t in params.logit_bias if not 0 <= t < self.vocab_size]
            if bad:
                # vLLM lists every bad id; the first 10 name the fault without a message of megabytes.
                more = f" (and {len(bad) - 10} more)" if len(bad) > 10 else ""
                raise ValueError(f"logit_bias: token_id(s) {bad[:10]}{more} in logit_bias contain out-of-vocab token "
                                 f"ids. Vocabulary size: {self.vocab_size}")
        for name in ("logprobs", "prompt_logprobs"):  # vLLM SamplingParams._validate_logprobs
            num = getattr(params, name)
            requested = self.vocab_size if num == -1 else num
            if num is not None and requested > MAX_LOGPROBS:
                whole = " (-1: the whole vocabulary)" if num == -1 else ""
                raise ValueError(f"{name}: requested {requested} logprobs{whole}, which is greater than max allowed: "
                                 f"{MAX_LOGPROBS}")
        if arrival_time is not None and (not isinstance(arrival_time, numbers.Real) or isinstance(arrival_time, bool)
                                         or arrival_time != arrival_time):
            raise ValueError(f"arrival_time must be a number of seconds (or None), got {arrival_time!r}")
        if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool)):
            raise ValueError(f"priority must be an int (lower values are served first), got {priority!r}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")

        params = params.clone()
        params.eos_token_id = self.eos_token_id
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - len(ids)
        return Request(
            request_id, ids, params, arrival_time=arrival_time,
            priority=params.priority if priority is None else priority,
            eos_token_id=self.eos_token_id, block_hasher=self._block_hasher, prompt=text, cache_salt=cache_salt,
        )
