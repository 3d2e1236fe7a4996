"""The step-by-step engine front: InputProcessor -> EngineCore -> OutputProcessor (vLLM: ``vllm/v1/engine/llm_engine.py``).

``add_request`` validates and tokenizes (``InputProcessor``) and queues the ``Request`` in the ``EngineCore``;
``step`` runs one engine-core step (schedule -> execute -> update) and turns its new tokens into ``RequestOutput``s
(``OutputProcessor``: text, stop strings, output kinds), then finishes in the core the requests that a stop string
ended. Finished requests are dropped everywhere: the engine's memory does not grow with the number of requests ever
served. Where minivllm differs from vLLM (one process, no engine-core client), see ``minivllm.engine.core``.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Dict, Iterable, List, Optional, Union

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.core import EngineCore, StepObserver
from minivllm.engine.input_processor import InputProcessor, PromptType
from minivllm.engine.output_processor import OutputProcessor
from minivllm.metrics.stats import SchedulerStats
from minivllm.engine.parallel_sampling import ParentRequest
from minivllm.outputs import RequestOutput
from minivllm.request import Request, RequestStatus
from minivllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minivllm.model.llama import LlamaForCausalLM
    from minivllm.worker.model_runner import ModelRunner

__all__ = ["LLMEngine", "PromptType"]


class LLMEngine:
    """Step-by-step engine with vLLM's configuration names.

    Args:
        model: see ``EngineArgs`` (``None`` = SmolLM2-135M-Instruct, a path, ``"tiny"`` or a ``LlamaForCausalLM``).
        **engine_kwargs: the fields of ``EngineArgs`` (``block_size``, ``num_gpu_blocks``,
            ``max_num_batched_tokens``, ``max_num_seqs``, ``max_model_len``, ``enable_chunked_prefill``,
            ``enable_prefix_caching``, ``dtype``, ``device``, ``kv_connector``, ...).

    Attributes:
        vllm_config, model_config (a ``ModelConfig``, as in vLLM), hf_config (the model's ``LlamaConfig``,
        ``model_config.hf_config``), cache_config, scheduler_config: the settings.
        tokenizer: loaded here, in the front end, as vLLM's ``InputProcessor`` loads it (``None`` for a model
        without one).
        input_processor, engine_core, output_processor: the three layers.
        scheduler, kv_cache_manager: the engine core's parts, for inspection between steps.
        model_runner, model: the driver worker's ``ModelRunner`` and model (one device, or this rank under
        ``torchrun``), for inspection; with worker processes they live there: use
        ``engine_core.model_executor.collective_rpc``.

    Raises:
        ValueError: for any inconsistent setting, naming the parameter and the limit.
    """

    def __init__(self, model=None, **engine_kwargs) -> None:
        args = EngineArgs(model, **engine_kwargs)
        config = args.create_engine_config()
        self.vllm_config = config
        self.model_config, self.cache_config, self.scheduler_config = (
            config.model_config, config.cache_config, config.scheduler_config)
        self.hf_config = config.hf_config
        self.dtype, self.device = config.dtype, config.device
        self.kv_connector = args.kv_connector
        self.tokenizer = engine_kwargs.get("tokenizer")
        if self.tokenizer is None and config.model_config.tokenizer is not None:
            from minivllm.model.tokenizer import load_tokenizer
            self.tokenizer = load_tokenizer(config.model_config.tokenizer)

        self.engine_core = EngineCore(config, model=args.given_model(), kv_connector=args.kv_connector)
        self.input_processor = InputProcessor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.scheduler = self.engine_core.scheduler
        self.kv_cache_manager = self.engine_core.kv_cache_manager
        # The last step's SchedulerStats, when the scheduler's log_stats is on (vLLM hands them to its loggers).
        self.scheduler_stats: Optional[SchedulerStats] = None
        self._counter = itertools.count()

    @property
    def model_runner(self) -> "ModelRunner":
        """The driver worker's model runner (minivllm's inspection handle; vLLM reaches it as
        ``model_executor.driver_worker.worker.model_runner``).

        Raises:
            AttributeError: when the runners live in worker processes (``MultiprocExecutor``).
        """
        worker = getattr(self.engine_core.model_executor, "driver_worker", None)
        if worker is None or worker.model_runner is None:
            raise AttributeError("this engine's model runners live in its worker processes "
                                 "(tensor_parallel_size > 1): reach them with "
                                 "engine.engine_core.model_executor.collective_rpc(fn), fn(worker) -> value")
        return worker.model_runner

    @property
    def model(self) -> "LlamaForCausalLM":
        """The driver worker's model (this rank's share under ``torchrun``); see ``model_runner``."""
        return self.model_runner.model

    # ---- requests -------------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def eos_token_id(self) -> Optional[int]:
        return self.input_processor.eos_token_id

    def add_request(
        self,
        request_id: Optional[str],
        prompt: PromptType,
        params: Optional[SamplingParams] = None,
        arrival_time: Optional[float] = None,
        priority: Optional[int] = None,
        cache_salt: Optional[str] = None,
    ) -> str:
        """Validate and queue one request (``None`` as id: the engine picks a free one). Returns its id.

        Every check runs before any engine state changes, so a rejected request leaves requests in flight
        untouched (see ``InputProcessor.process_inputs`` for the checks). With ``params.n > 1`` the request is fanned
        out into ``n`` children ``f"{i}_{request_id}"`` (``engine/parallel_sampling.py``), all validated first;
        its outputs carry ``request_id`` and the children's completions, each with its ``index``, and
        ``abort_request(request_id)`` aborts them all.

        Raises:
            ValueError: ``request_id`` used by an unfinished request, or anything ``process_inputs`` rejects.
        """
        live = self.engine_core.scheduler.requests
        if request_id is None:
            request_id = str(next(self._counter))
            while request_id in live:
                request_id = str(next(self._counter))
        request_id = str(request_id)
        if request_id in live or self.output_processor.has_request(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        if isinstance(params, SamplingParams) and params.n > 1:
            # vLLM's fan-out (v1/engine/llm_engine.py add_request + parallel_sampling.ParentRequest): n child
            # requests, all validated before any is queued.
            parent = ParentRequest(request_id, params)
            children: List[Request] = []
            for index in range(params.n):
                child_id, child_params = parent.get_child_info(index)
                if child_id in live or self.output_processor.has_request(child_id):
                    raise ValueError(f"request_id {child_id!r} (child {index} of {request_id!r}) is already in use")
                if not children:  # the prompt is tokenized and checked once, for the first child
                    children.append(self.input_processor.process_inputs(child_id, prompt, child_params,
                                                                        arrival_time, priority, cache_salt))
                else:
                    children.append(self.input_processor.child_request(children[0], child_id, child_params.seed))
            for index, child in enumerate(children):
                self.output_processor.add_request(child, parent, index)
                self.engine_core.add_request(child)
            return request_id
        request = self.input_processor.process_inputs(request_id, prompt, params, arrival_time, priority, cache_salt)
        self.output_processor.add_request(request)
        self.engine_core.add_request(request)
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
        request_ids = self.output_processor.expand_request_ids(str(r) for r in request_ids)
        # Only final outputs: a parent of n children gets one, with all n completions, not one per child.
        outputs = [o for o in self.output_processor.abort_requests(request_ids) if o.finished]
        self.engine_core.abort_requests(request_ids)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.engine_core.scheduler.get_num_unfinished_requests()

    def get_request(self, request_id: str) -> Request:
        """The live ``Request`` (waiting, running or preempted).

        Raises:
            KeyError: for an unknown id or a request that already finished: the engine keeps no finished
                requests; its last ``RequestOutput`` (from ``step``, ``run_to_completion`` or ``abort_request``)
                has the tokens, the text and the counters.
        """
        request = self.engine_core.scheduler.requests.get(request_id)
        if request is None:
            raise KeyError(f"{request_id!r} is not a live request: finished and aborted requests are dropped; "
                           "read their final RequestOutput instead")
        return request

    def add_step_observer(self, observer: StepObserver) -> None:
        """Have ``observer`` watch every later step (``on_schedule``, ``on_step_end``: see ``engine.core``)."""
        self.engine_core.step_observers.append(observer)

    # ---- the loop -------------------------------------------------------------------------------------------
    def step(self) -> List[RequestOutput]:
        """Run one step; returns an output for each request that produced tokens or finished in it.

        With ``output_kind=FINAL_ONLY`` a running request returns nothing until it finishes.
        """
        core_outputs = self.engine_core.step()
        if core_outputs.scheduler_stats is not None:
            self.scheduler_stats = core_outputs.scheduler_stats
        processed = self.output_processor.process_outputs(core_outputs.outputs)
        self.engine_core.finish_requests(processed.reqs_to_abort, RequestStatus.FINISHED_STOPPED)
        for observer in self.engine_core.step_observers:
            observer.on_step_end(self.engine_core, core_outputs, processed.request_outputs)
        return processed.request_outputs

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
        return self.engine_core.scheduler.reset_prefix_cache(reset_running_requests)

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any (``EngineCore.shutdown``); idempotent. They are also
        stopped when the engine is garbage-collected or the process exits."""
        self.engine_core.shutdown()

    @property
    def num_preemptions(self) -> int:
        """Preemptions since the engine started."""
        return self.engine_core.scheduler.stats.num_preemptions
