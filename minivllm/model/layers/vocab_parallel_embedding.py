"""Token embedding and LM head (vLLM: ``vllm/model_executor/layers/vocab_parallel_embedding.py``).

One device, so nothing is split over the vocabulary and the vocabulary is not padded (vLLM pads it to a multiple
of 64 for its tensor-parallel shards).
"""

from __future__ import annotations

import math

import torch.nn as nn


class VocabParallelEmbedding(nn.Embedding):
    """``input_ids int64 [T]`` -> rows of ``weight [vocab_size, hidden_size]``, ``[T, hidden_size]``."""


class ParallelLMHead(VocabParallelEmbedding):
    """The LM head's weight ``[vocab_size, hidden_size]``; ``LogitsProcessor`` multiplies by it, nothing calls
    ``forward`` (as in vLLM).

    Its weight is first filled as ``nn.Linear`` fills its own (Kaiming-uniform): the head used to be an
    ``nn.Linear``, and building a model must draw the same numbers from torch's global generator as before, or
    every later seeded-by-hand result in the notebooks would move. Real and dummy weights replace it anyway.
    """

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> "ParallelLMHead":
        """Share ``embed_tokens``' weight (``tie_word_embeddings``); returns ``self``."""
        self.weight = embed_tokens.weight
        return self

    def forward(self, input_):
        raise RuntimeError("ParallelLMHead: the LM head's weight is applied by LogitsProcessor, not by forward")
