"""Model Runner V2 (vLLM 0.32: ``vllm/v1/worker/gpu/model_runner.py``, ``input_batch.py``, ``sample/``).

What changes from the V1 runner (``minivllm/worker/model_runner.py``), as in vLLM:

* Preempted requests are forgotten (``finish_requests`` frees the finished *and* the preempted ones), and a
  resumed request comes back as a new request whose ``prefill_token_ids`` are its prompt plus its outputs so far
  (the scheduler's ``use_v2_model_runner``). ``prefill_len`` is their number; ``num_prompt_tokens`` stays the
  prompt's, so ``min_tokens`` and output counts are still right.
* A partial-prefill row is sampled like every row and dropped by ``num_sampled = 0`` (vLLM: ``seq_len <
  prefill_len``, ``get_num_sampled_and_rejected`` in ``input_batch.py``), not by a discard mask with a generator
  to restore. minivllm decides it once per row for both runners (``minivllm.request.is_partial_prefill``): a
  V2 request's tokens are its ``prefill_len`` tokens until its first sampled token, so the rule is the same.
* Sampling is stateless: Gumbel-max with noise hashed from the request's seed and the sampled position
  (``minivllm/worker/v2/gumbel.py``). Nothing is saved or rewound, so chunking and preemption cannot change a
  seeded request's tokens. A request without ``SamplingParams.seed`` gets a random 63-bit seed when it is added
  (vLLM: ``np.random.randint`` in ``SamplingStates.add_request``; minivllm draws it from the runner's generator,
  seeded with the engine's ``seed``, so a run is reproducible). An unseeded request that is preempted is added
  again and gets a new seed, as in vLLM.

Everything else (inputs, attention, KV cache, connector calls, CUDA graphs) is shared with the V1 runner in
``ModelRunnerBase`` (``minivllm/worker/model_runner_base.py``); V2 does not derive from V1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch

from minivllm.core.sched.output import SchedulerOutput
from minivllm.worker.input_batch import CachedRequestState, ModelInputs
from minivllm.worker.model_runner_base import ModelRunnerBase
from minivllm.worker.v2.sampler import GumbelSampler


@dataclass
class RequestStateV2(CachedRequestState):
    """``CachedRequestState`` plus V2's per-request ``seed`` and ``prefill_len`` (vLLM ``RequestState``)."""

    seed: int = 0
    prefill_len: int = 0


class ModelRunnerV2(ModelRunnerBase):
    """Model Runner V2's request lifecycle and sampling (see the module docstring). Args: as ``ModelRunnerBase``.
    """

    sampler_cls = GumbelSampler

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in set(so.finished_req_ids) | set(so.preempted_req_ids):
            self.requests.pop(rid, None)
            self.input_batch.remove_request(rid)
        for new in so.scheduled_new_reqs:
            sp = new.sampling_params
            token_ids = list(new.prefill_token_ids if new.prefill_token_ids is not None else new.prompt_token_ids)
            seed = sp.seed
            if seed is None:
                g = self.shared_generator
                seed = int(torch.randint(0, 2**63 - 1, (1,), generator=g, device=g.device))
            seed = (seed + 2**63) % 2**64 - 2**63  # an int64 (an n > 1 child's seed + index may pass 2**63 - 1)
            self.requests[new.req_id] = RequestStateV2(
                new.req_id, token_ids, new.prompt_len, sp, [], new.num_computed_tokens, None, sp.eos_token_id,
                seed=seed, prefill_len=len(token_ids),
            )
        assert not so.scheduled_cached_reqs.resumed_req_ids, (
            "Model Runner V2 gets resumed requests as new ones (SchedulerConfig.use_v2_model_runner)")
        self._apply_block_updates(so)

    def _sample(self, inputs: ModelInputs, logits: torch.Tensor) -> Tuple[torch.Tensor, List[List[int]], List[bool]]:
        """Sample every row from (seed, position); keep ``num_sampled`` tokens: 0 for a partial prefill, else 1."""
        states = [s for s in inputs.states if isinstance(s, RequestStateV2)]
        assert len(states) == len(inputs.states)
        seq_lens = inputs.common_attn_metadata.seq_lens_cpu_upper_bound
        smd = self._sampling_metadata(
            states, generators=[None] * len(states), seeds=[s.seed for s in states],
            positions=[n - 1 for n in seq_lens],  # the position of the token whose logits are sampled
        )
        sampled = self.sampler(logits, smd)
        sampled_list = sampled.tolist()
        num_sampled = [0 if partial else 1 for partial in inputs.discard]
        out_ids: List[List[int]] = []
        for i, s in enumerate(states):
            kept = sampled_list[i:i + num_sampled[i]]
            s.token_ids.extend(kept)
            out_ids.append(kept)
        return sampled, out_ids, [k == 0 for k in num_sampled]
