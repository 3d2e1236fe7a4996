"""Token embedding and LM head, split over the vocabulary (vLLM:
``vllm/model_executor/layers/vocab_parallel_embedding.py``).

Rank r of N holds rows ``[r * n, min((r + 1) * n, vocab_size))`` of the ``[vocab_size, hidden_size]`` table,
``n = ceil(vocab_size / N)``; the last rank's missing rows are zero padding. The embedding looks up the tokens
that fall in its rows, zeroes the others, and an all-reduce adds the ranks' rows (exactly one rank contributes
each token's row). The LM head's logits are gathered (``LogitsProcessor``).

Where minivllm differs from vLLM: vLLM first pads the vocabulary to a multiple of 64 (``pad_vocab_size``), also on
one device, for kernel alignment; minivllm pads only to a multiple of N, so a single-device table is the whole
vocabulary with no padding.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from minivllm.distributed.communication_op import tensor_model_parallel_all_reduce
from minivllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size


class VocabParallelEmbedding(nn.Embedding):
    """``input_ids int64 [T]`` -> rows of the table, ``[T, hidden_size]``; ``weight [num_embeddings_per_partition,
    hidden_size]`` is this rank's slice (the whole table on one rank).

    Attributes:
        org_vocab_size: the whole vocabulary; vocab_start_index / vocab_end_index: this rank's rows of it.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.org_vocab_size = num_embeddings
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = min(self.vocab_start_index + self.num_embeddings_per_partition, num_embeddings)
        super().__init__(self.num_embeddings_per_partition, embedding_dim)

    def reset_parameters(self) -> None:
        # On the meta device (the loaders build there) there is nothing to fill, and ``normal_`` there goes through
        # torch's reference implementation, whose import of ``torch._dynamo`` cost 1.1 s and 143 MiB of resident
        # memory (triton's library included) in every process that loads a model, without a number drawn.
        if not self.weight.is_meta:
            super().reset_parameters()

    def shard_loaded_weight(self, param_name: str, loaded_weight: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the whole ``[vocab_size, hidden_size]`` table, zero-padded to
        ``num_embeddings_per_partition`` rows."""
        shard = loaded_weight[self.vocab_start_index:self.vocab_end_index]
        pad = self.num_embeddings_per_partition - shard.shape[0]
        return F.pad(shard, (0, 0, 0, pad)) if pad else shard

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(input_)
        mask = (input_ >= self.vocab_start_index) & (input_ < self.vocab_end_index)
        out = F.embedding((input_ - self.vocab_start_index) * mask, self.weight)
        out.mul_(mask.unsqueeze(-1).to(out.dtype))
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The LM head's weight, split by vocabulary rows as the embedding; ``LogitsProcessor`` multiplies by it and
    gathers the ranks' logits, nothing calls ``forward`` (as in vLLM).

    Its weight is first filled as ``nn.Linear`` fills its own (Kaiming-uniform): the head used to be an
    ``nn.Linear``, and building a model must draw the same numbers from torch's global generator as before, or
    every later seeded-by-hand result in the notebooks would move. Real and dummy weights replace it anyway.
    """

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:  # as VocabParallelEmbedding.reset_parameters
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> "ParallelLMHead":
        """Share ``embed_tokens``' weight (``tie_word_embeddings``; the same rows on every rank); returns ``self``."""
        self.weight = embed_tokens.weight
        return self

    def forward(self, input_):
        raise RuntimeError("ParallelLMHead: the LM head's weight is applied by LogitsProcessor, not by forward")
