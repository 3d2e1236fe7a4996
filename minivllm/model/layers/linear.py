"""The projections of a decoder layer in vLLM's fused layout (vLLM: ``vllm/model_executor/layers/linear.py``).

minivllm runs on one device, so the "Parallel" in the names is vLLM's and nothing is sharded: each class is one
``nn.Linear`` (``weight [out_features, in_features]``) that knows how its rows are stacked. The forward is
``packed_linear.Linear``'s (a oneDNN-packed weight in bfloat16 on the CPU). Unlike vLLM's layers, which return
``(output, output_bias)``, these return the output alone: no bias is ever fused into a later op here.
"""

from __future__ import annotations

from typing import List

from minivllm.model.packed_linear import Linear


class QKVParallelLinear(Linear):
    """The q, k and v projections as one matrix: rows ``[q (num_heads * head_size) | k | v (num_kv_heads *
    head_size each)]``, so ``x [T, hidden] -> [T, q_size + 2 * kv_size]`` in one multiply."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False) -> None:
        self.head_size = head_size
        self.num_heads = total_num_heads
        self.num_kv_heads = total_num_kv_heads
        super().__init__(hidden_size, (total_num_heads + 2 * total_num_kv_heads) * head_size, bias=bias)


class MergedColumnParallelLinear(Linear):
    """Several projections of the same input stacked by rows (Llama: ``output_sizes = [intermediate] * 2`` for
    gate and up): ``x [T, input_size] -> [T, sum(output_sizes)]``."""

    def __init__(self, input_size: int, output_sizes: List[int], bias: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(self.output_sizes), bias=bias)


class RowParallelLinear(Linear):
    """A projection back to the hidden size (``o_proj``, ``down_proj``): ``x [T, input_size] -> [T,
    output_size]``. (In vLLM its input is split across tensor-parallel ranks and the outputs are summed.)"""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias=bias)
