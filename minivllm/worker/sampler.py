"""Turn each request's logits row into one token (vLLM: ``vllm/v1/sample/sampler.py``).

Order of operations, as in vLLM: ``min_tokens`` masking (EOS and stop tokens get ``-inf`` until enough tokens
exist; EOS also with ``ignore_eos``, because vLLM's ``MinTokensLogitsProcessor`` bans every id of
``SamplingParams.all_stop_token_ids``, which holds EOS either way), then greedy rows take the argmax; random rows apply temperature, top-k, top-p and min-p, and draw with the
exponential race ``argmax(p / q), q ~ Exp(1)``, which equals a categorical draw from ``p``. A request with a
``seed`` draws ``q`` from its own ``torch.Generator``, so its tokens do not depend on which other requests share
the batch.

Model Runner V2 draws statelessly instead (``minivllm/worker/v2/sampler.py``: Gumbel-max with noise hashed from
the request's seed and the sampled position); it overrides ``Sampler.random_draw`` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from minivllm.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    """Per-row sampling inputs for one step.

    Attributes:
        params: the ``SamplingParams`` of each row's request.
        generators: the request's own generator, or ``None`` to use the engine's shared one.
        num_output_tokens: tokens each request has generated so far (for ``min_tokens``).
        eos_token_ids: each request's EOS id (or ``None``).
        all_greedy: every row is greedy and no row needs ``min_tokens`` masking (the fast path).
        seeds / positions: Model Runner V2 only: each row's seed and the position of the token whose logits it
            is (the last scheduled one); random rows then draw by Gumbel-max from them, not from a generator.
    """

    params: List[SamplingParams]
    generators: List[Optional[torch.Generator]]
    num_output_tokens: List[int]
    eos_token_ids: List[Optional[int]]
    all_greedy: bool
    seeds: Optional[List[int]] = None
    positions: Optional[List[int]] = None


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Mask one row ``[vocab]`` of temperature-scaled float32 logits with ``-inf`` outside the kept set.

    * top-k keeps exactly ``top_k`` tokens: of the tokens tied with the k-th largest logit, the lowest token ids,
      so that ``top_k=1`` is the greedy argmax (which also takes the first of tied maxima). This is what vLLM's
      Triton top-k/top-p kernel does (``vllm/v1/sample/ops/topk_topp_triton.py``, the GPU default), and what
      vLLM issue #5404 asked for. vLLM's PyTorch fallback (``apply_top_k_only`` in
      ``vllm/v1/sample/ops/topk_topp_sampler.py``, what its CPU build runs) differs: it keeps every token tied
      with the k-th, so there ``top_k=1`` can sample a token other than the argmax.
    * top-p keeps the smallest prefix of the tokens sorted by logit, ties in token-id order, whose probability
      reaches ``top_p`` (the top token always stays).
    * min-p drops tokens whose probability is below ``min_p`` times the top one (ties with the top all stay).

    Returns a new tensor (``logits`` is not modified).
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        keep = logits > kth
        # torch.topk does not say which of the tied tokens it picks: take the lowest ids, as many as needed.
        ties = (logits == kth).nonzero().flatten()[: top_k - int(keep.sum())]
        keep[ties] = True
        logits = logits.masked_fill(~keep, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, stable=True)  # ties: lower token id first
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass *before* it already reaches top_p (the top token always stays).
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.clone()
        logits[idx[drop]] = float("-inf")
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return logits


class Sampler:
    """Samples one token per row. ``shared_generator`` serves requests without a seed."""

    def __init__(self, shared_generator: torch.Generator) -> None:
        self.shared_generator = shared_generator

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """``logits: float32 [num_reqs, vocab]`` -> ``int64 [num_reqs]`` token ids."""
        if md.all_greedy:
            return logits.argmax(-1)
        out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        for i, sp in enumerate(md.params):
            row = logits[i]
            if md.num_output_tokens[i] < sp.min_tokens:
                banned = list(sp.stop_token_ids)
                if md.eos_token_ids[i] is not None:  # also with ignore_eos, as vLLM's all_stop_token_ids
                    banned.append(md.eos_token_ids[i])
                if banned:
                    row = row.clone()
                    row[banned] = float("-inf")
            if sp.greedy:
                out[i] = row.argmax()
                continue
            out[i] = self.random_draw(apply_top_k_top_p_min_p(row / sp.temperature, sp.top_k, sp.top_p, sp.min_p),
                                      i, md)
        return out

    def random_draw(self, row: torch.Tensor, i: int, md: SamplingMetadata) -> torch.Tensor:
        """One token from a masked, temperature-scaled float32 row ``[vocab]``: the exponential race with row
        ``i``'s own generator, or the shared one."""
        probs = row.softmax(-1)
        gen = md.generators[i] or self.shared_generator
        q = torch.empty_like(probs).exponential_(generator=gen)
        return (probs / q).argmax()
