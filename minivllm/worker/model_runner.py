"""vLLM's V1 model runner (``vllm/v1/worker/gpu_model_runner.py``): the request state it keeps and how it samples.

Everything else a step does (inputs, attention metadata, forward, logits, connector and CUDA-graph hooks) is in
``ModelRunnerBase`` (``model_runner_base.py``), shared with Model Runner V2 (``v2/model_runner.py``).

What is V1's own, as in vLLM:

* a preempted request keeps its state in the runner; when it resumes, the scheduler sends it as a resumed entry
  of ``scheduled_cached_reqs`` with all its tokens and a whole new block table;
* a partial-prefill row is sampled like every row and its token discarded; a seeded request's generator is
  restored afterwards, so the discarded draw leaves its random stream untouched (vLLM rewinds the Philox offset
  on the GPU; CPU generators have no offset, so the state is saved instead).
"""

from __future__ import annotations

from typing import List, Tuple

import torch

from minivllm.core.sched.output import SchedulerOutput
from minivllm.worker.input_batch import CachedRequestState, ModelInputs
from minivllm.worker.model_runner_base import ModelRunnerBase, StepInputs

__all__ = ["CachedRequestState", "ModelRunner", "StepInputs"]


class ModelRunner(ModelRunnerBase):
    """vLLM's V1 model runner (see the module docstring). Args: as ``ModelRunnerBase``."""

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            self.input_batch.remove_request(rid)
        for new in so.scheduled_new_reqs:
            sp = new.sampling_params
            gen = None
            if sp.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(sp.seed)
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, list(new.prompt_token_ids), len(new.prompt_token_ids), sp, [],
                new.num_computed_tokens, gen, sp.eos_token_id,
            )
        cached = so.scheduled_cached_reqs
        for rid in cached.resumed_req_ids:
            self.requests[rid].token_ids = list(cached.all_token_ids[rid])
        self._apply_block_updates(so)

    def _sample(self, inputs: ModelInputs, logits: torch.Tensor) -> Tuple[torch.Tensor, List[List[int]], List[bool]]:
        """Sample one token per row and keep the ones that count (the V1 runner's way).

        Returns ``(sampled int64 [R], out_ids, discarded)``: ``out_ids[i]`` is ``[token]``, or ``[]`` where the row
        was a partial prefill (``discarded[i]``); kept tokens are appended to the runner's own request state.
        """
        states, discard = inputs.states, inputs.discard
        # Partial prefills are sampled too (simpler than masking them out of the batch, as in vLLM) and their
        # token discarded. A seeded request's generator is restored afterwards, so the discarded draw leaves its
        # random stream untouched: the first real token is the same whether or not the prompt was chunked.
        # (vLLM rewinds the Philox offset on GPU; CPU generators have no offset, so the state is saved instead.)
        saved = {i: states[i].generator.get_state() for i in range(len(states)) if discard[i] and states[i].generator is not None}
        sampled = self.sampler(logits, self._sampling_metadata(states))
        for i, state in saved.items():
            states[i].generator.set_state(state)
        sampled_list = sampled.tolist()
        out_ids: List[List[int]] = []
        for i, s in enumerate(states):
            if discard[i]:
                out_ids.append([])
            else:
                s.token_ids.append(sampled_list[i])
                out_ids.append([sampled_list[i]])
        return sampled, out_ids, discard
