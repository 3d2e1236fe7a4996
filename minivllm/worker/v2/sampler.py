"""Model Runner V2's sampler (vLLM 0.32: ``vllm/v1/worker/gpu/sample/``): the V1 sampler's masking, then a
stateless draw.

A random row draws by Gumbel-max with noise hashed from its request's seed and the position of the token whose
logits it is (``gumbel.py``), so nothing is saved or rewound and chunking or preemption cannot change a seeded
request's tokens. Every request has a seed under V2 (``ModelRunnerV2`` gives one to a request without).
"""

from __future__ import annotations

import torch

from minivllm.worker.sampler import Sampler, SamplingMetadata
from minivllm.worker.v2.gumbel import gumbel_sample


class GumbelSampler(Sampler):
    """``Sampler`` whose random draw is ``gumbel_sample(row, seed, position)``; needs ``SamplingMetadata.seeds``
    and ``positions``."""

    def random_draw(self, row: torch.Tensor, i: int, md: SamplingMetadata) -> torch.Tensor:
        assert md.seeds is not None and md.positions is not None, "Model Runner V2 gives every row a seed"
        seed_pos = torch.tensor([[md.seeds[i]], [md.positions[i]]], dtype=torch.long, device=row.device)
        return gumbel_sample(row[None], seed_pos[0], seed_pos[1])[0]
