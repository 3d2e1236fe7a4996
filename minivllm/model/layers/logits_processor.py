"""Hidden states -> logits (vLLM: ``vllm/model_executor/layers/logits_processor.py``, ``LogitsProcessor``)."""

from __future__ import annotations

import torch
import torch.nn as nn

from minivllm.distributed.communication_op import tensor_model_parallel_all_gather
from minivllm.model.layers.vocab_parallel_embedding import VocabParallelEmbedding
from minivllm.model.packed_linear import PackedWeight


class LogitsProcessor(nn.Module):
    """``hidden [N, hidden_size]`` -> float32 ``logits [N, vocab_size]`` through the LM head's weight.

    The model runner passes only the rows it samples from (the last scheduled token of each request), because the
    ``hidden x vocab`` product is the single biggest matmul of a step. Under tensor parallelism each rank multiplies
    by its vocabulary rows and an all-gather joins the slices (vLLM gathers the same way, to every rank on the CPU;
    the padding columns past ``vocab_size`` are cut). In bfloat16 on the CPU (and float32 under
    ``MINIVLLM_CPU_KERNELS_FP32=1``, the default) the head's weight is packed once (``packed_linear``: for oneDNN in
    bfloat16, for ``packed_gemm`` in float32, one row included where it is built); the packed copy lives here
    because a tied head *is* the embedding table, which is never multiplied anywhere else, and the table itself
    stays (the embedding reads its rows; vLLM keeps it too, ``remove_weight=False``). No scaling or soft cap (Llama
    uses neither).
    """

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self._packed_weight = PackedWeight()  # the attribute name packed_linear.Linear uses

    def forward(self, lm_head: VocabParallelEmbedding, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self._packed_weight.linear(hidden_states, lm_head.weight)
        if lm_head.tp_size > 1:
            logits = tensor_model_parallel_all_gather(logits, dim=-1)[:, : self.vocab_size]
        return logits.float()
