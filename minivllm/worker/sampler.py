"""Turn each request's logits row into one token (vLLM: ``vllm/v1/sample/sampler.py``).

Order of operations, as in vLLM: ``min_tokens`` masking (EOS and stop tokens get ``-inf`` until enough tokens
exist; EOS also with ``ignore_eos``, because vLLM's ``MinTokensLogitsProcessor`` bans every id of
``SamplingParams.all_stop_token_ids``, which holds EOS either way), then greedy rows take the argmax; random rows apply temperature, top-k, top-p and min-p, and draw with the
exponential race ``argmax(p / q), q ~ Exp(1)``, which equals a categorical draw from ``p``. A request with a
``seed`` draws ``q`` from its own ``torch.Generator``, so its tokens do not depend on which other requests share
the batch.

Before the masking, as in vLLM 0.32 (``Sampler.forward`` in ``vllm/v1/sample/sampler.py``): rows that ask for
``logprobs`` get them from the *raw* logits (``logprobs_mode="raw_logprobs"``: ``log_softmax`` before any bias,
penalty or temperature); then the non-argmax-invariant logits processors (``min_tokens``, ``logit_bias``:
``vllm/v1/sample/logits_processor/builtin.py``), then the penalties (``apply_penalties``,
``vllm/model_executor/layers/utils.py``: repetition over prompt and output tokens, frequency and presence over
output tokens only). Rows with none of these, and all-greedy batches, take the same path as before.

Model Runner V2 draws statelessly instead (``minivllm/worker/v2/sampler.py``: Gumbel-max with noise hashed from
the request's seed and the sampled position); it overrides ``Sampler.random_draw`` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from minivllm.outputs import LogprobsEntry
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
    prompt_token_ids: Optional[List[List[int]]] = None
    output_token_ids: Optional[List[List[int]]] = None


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor) -> List[LogprobsEntry]:
    """vLLM ``Sampler.gather_logprobs``: ``logprobs float32 [N, vocab]``, ``token_ids int64 [N]``; ``num_logprobs``
    top entries per row (``-1``: the whole vocabulary, sorted, where vLLM returns it unsorted)."""
    k = logprobs.shape[-1] if num_logprobs == -1 else min(num_logprobs, logprobs.shape[-1])
    top_lp, top_ids = torch.topk(logprobs, k, dim=-1)
    tok_lp = logprobs.gather(-1, token_ids[:, None])
    ranks = (logprobs >= tok_lp).sum(-1)
    ids = torch.cat((token_ids[:, None], top_ids), 1).tolist()
    lps = torch.cat((tok_lp, top_lp), 1).tolist()
    return [LogprobsEntry(i, lp, int(r)) for i, lp, r in zip(ids, lps, ranks.tolist())]


def apply_penalties(row: torch.Tensor, prompt_ids: List[int], output_ids: List[int], presence: float,
                    frequency: float, repetition: float) -> torch.Tensor:
    """vLLM ``apply_penalties`` on one float32 row ``[vocab]`` (returns a new tensor).

    Repetition (``apply_repetition_penalties_torch``): every token in the prompt or the output has its logit
    divided by ``repetition`` when positive, multiplied when not. Then, over the output tokens only,
    ``logit -= frequency * count + presence * (count > 0)`` (OpenAI's definition).
    """
    vocab = row.shape[-1]
    row = row.clone()
    out_counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=vocab)[:vocab]
    if repetition != 1.0:
        seen = out_counts > 0
        if prompt_ids:
            seen = seen | (torch.bincount(torch.tensor(prompt_ids, dtype=torch.long), minlength=vocab)[:vocab] > 0)
        pen = torch.where(seen, torch.tensor(repetition, dtype=row.dtype), torch.tensor(1.0, dtype=row.dtype))
        row *= torch.where(row > 0, 1.0 / pen, pen)
    if frequency != 0.0:
        row -= frequency * out_counts.to(row.dtype)
    if presence != 0.0:
        row -= presence * (out_counts > 0).to(row.dtype)
    return row


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
        self.last_logprobs: List[Optional[LogprobsEntry]] = []

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """``logits: float32 [num_reqs, vocab]`` -> ``int64 [num_reqs]`` token ids.

        ``self.last_logprobs[i]`` is then row ``i``'s ``LogprobsEntry`` when its request asked for ``logprobs``,
        else ``None`` (vLLM returns them in ``SamplerOutput.logprobs_tensors``).
        """
        self.last_logprobs = [None] * logits.shape[0]
        if md.all_greedy:
            return logits.argmax(-1)
        out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        for i, sp in enumerate(md.params):
            row = logits[i]
            raw_logprobs = row.float().log_softmax(-1) if sp.logprobs is not None else None
            if md.num_output_tokens[i] < sp.min_tokens:
                banned = list(sp.stop_token_ids)
                if md.eos_token_ids[i] is not None:  # also with ignore_eos, as vLLM's all_stop_token_ids
                    banned.append(md.eos_token_ids[i])
                if banned:
                    row = row.clone()
                    row[banned] = float("-inf")
            if sp.logit_bias:
                row = row.clone()
                ids = torch.tensor(list(sp.logit_bias), dtype=torch.long, device=row.device)
                row[ids] += torch.tensor(list(sp.logit_bias.values()), dtype=row.dtype, device=row.device)
            if sp.needs_penalties:
                assert md.prompt_token_ids is not None and md.output_token_ids is not None, (
                    "penalties need the rows' prompt and output token ids")
                row = apply_penalties(row, md.prompt_token_ids[i], md.output_token_ids[i], sp.presence_penalty,
                                      sp.frequency_penalty, sp.repetition_penalty)
            if sp.greedy:
                out[i] = row.argmax()
            else:
                out[i] = self.random_draw(
                    apply_top_k_top_p_min_p(row / sp.temperature, sp.top_k, sp.top_p, sp.min_p), i, md)
            if raw_logprobs is not None and sp.logprobs is not None:
                self.last_logprobs[i] = gather_logprobs(raw_logprobs[None], sp.logprobs, out[i:i + 1])[0]
        return out

    def random_draw(self, row: torch.Tensor, i: int, md: SamplingMetadata) -> torch.Tensor:
        """One token from a masked, temperature-scaled float32 row ``[vocab]``: the exponential race with row
        ``i``'s own generator, or the shared one."""
        probs = row.softmax(-1)
        gen = md.generators[i] or self.shared_generator
        q = torch.empty_like(probs).exponential_(generator=gen)
        return (probs / q).argmax()
