"""The projections of a decoder layer, split over tensor-parallel ranks (vLLM:
``vllm/model_executor/layers/linear.py``).

Megatron-LM's split (Shoeybi et al. 2019, section 3): a *column-parallel* layer gives each rank a slice of the
output features (rows of ``weight [out_features, in_features]``), so its input is whole and its output is the
rank's slice; a *row-parallel* layer gives each rank a slice of the input features (columns of ``weight``), takes
that slice of the input, and the ranks' partial outputs are summed with one all-reduce. A column layer followed
by a row layer (qkv -> o, gate_up -> down) therefore needs no communication between them, and one all-reduce at
the end: two per decoder layer.

Each class is an ``nn.Linear`` (``packed_linear.Linear``: a packed weight on the CPU, for oneDNN in bfloat16 and
for ``packed_gemm`` in float32 under ``MINIVLLM_CPU_KERNELS_FP32=1``) of the rank's shape. In a group of one (``parallel_state``) every
shape is the whole layer's and nothing is reduced: exactly the single-device layer. Weights are sharded at load
time: ``LlamaForCausalLM.load_weights`` takes the whole checkpoint tensor and keeps the slice
``shard_loaded_weight`` returns.

Where minivllm differs from vLLM: vLLM's ``weight_loader(param, loaded_weight)`` copies the slice into an
allocated parameter; here ``shard_loaded_weight`` returns it and the loader assigns it (the model is built on
the meta device, without memory). The layers return the output alone, not vLLM's ``(output, output_bias)``.
"""

from __future__ import annotations

from typing import List

import torch

from minivllm.distributed.communication_op import tensor_model_parallel_all_reduce
from minivllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from minivllm.model.packed_linear import Linear


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    """``numerator // denominator``; raises ``ValueError`` naming ``what`` when it does not divide evenly."""
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


class ColumnParallelLinear(Linear):
    """``x [T, input_size]`` (whole on every rank) -> ``[T, output_size / N]``: rank r holds output rows
    ``[r * output_size / N, (r + 1) * output_size / N)``. (vLLM's ``gather_output=True`` is not needed here: every
    column layer feeds a row layer.)"""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.input_size, self.output_size = input_size, output_size
        super().__init__(input_size, divide(output_size, self.tp_size, "output_size"), bias=bias)

    def _row_ranges(self) -> List[tuple]:
        """``(start, length)`` of this rank's rows in the whole weight, one per stacked part."""
        n = self.out_features
        return [(self.tp_rank * n, n)]

    def shard_loaded_weight(self, param_name: str, loaded_weight: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the whole ``weight [output_size, input_size]`` (or ``bias [output_size]``)."""
        return torch.cat([loaded_weight.narrow(0, start, length) for start, length in self._row_ranges()])


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input stacked by rows (Llama: ``output_sizes =
    [intermediate] * 2`` for gate and up): each part is split, so rank r holds ``[gate_r | up_r]`` and its
    ``SiluAndMul`` pairs the right halves. ``x [T, input_size] -> [T, sum(output_sizes) / N]``."""

    def __init__(self, input_size: int, output_sizes: List[int], bias: bool = False) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        self.output_sizes = list(output_sizes)
        for size in self.output_sizes:
            divide(size, tp_size, "output_sizes")
        super().__init__(input_size, sum(self.output_sizes), bias=bias)

    def _row_ranges(self) -> List[tuple]:
        ranges, offset = [], 0
        for size in self.output_sizes:
            n = size // self.tp_size
            ranges.append((offset + self.tp_rank * n, n))
            offset += size
        return ranges


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections as one matrix, split by heads: the whole weight's rows are ``[q
    (total_num_heads * head_size) | k | v (total_num_kv_heads * head_size each)]``; rank r holds its
    ``num_heads = total_num_heads / N`` query heads and ``num_kv_heads`` KV heads, ``x [T, hidden] -> [T,
    (num_heads + 2 * num_kv_heads) * head_size]``.

    KV heads (vLLM's rule): split when ``total_num_kv_heads`` divides by N; when N is a multiple of
    ``total_num_kv_heads``, each rank holds one KV head and ``num_kv_head_replicas = N / total_num_kv_heads``
    ranks hold the same one (rank r holds KV head ``r // num_kv_head_replicas``). Either way rank r's query heads
    use exactly the KV heads it holds: query head h uses KV head ``h // (total_num_heads / total_num_kv_heads)``.

    Raises:
        ValueError: when the heads cannot be split that way (``EngineArgs`` checks first, with the model's
            numbers: ``minivllm.config.ParallelConfig.verify_with_model_config``).
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size, "total_num_heads")
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, total_num_kv_heads, "total_num_kv_heads")
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size, "total_num_kv_heads")
            self.num_kv_head_replicas = 1
        # The whole layer's output size, as vLLM passes it to ColumnParallelLinear.
        output_size = (self.num_heads + 2 * self.num_kv_heads) * tp_size * head_size
        super().__init__(hidden_size, output_size, bias=bias)

    def _row_ranges(self) -> List[tuple]:
        hs = self.head_size
        q_total, kv_total = self.total_num_heads * hs, self.total_num_kv_heads * hs
        kv_shard_rank = self.tp_rank // self.num_kv_head_replicas
        q_len, kv_len = self.num_heads * hs, self.num_kv_heads * hs
        return [(self.tp_rank * q_len, q_len),
                (q_total + kv_shard_rank * kv_len, kv_len),
                (q_total + kv_total + kv_shard_rank * kv_len, kv_len)]


class RowParallelLinear(Linear):
    """A projection back to the hidden size (``o_proj``, ``down_proj``): rank r holds input columns ``[r *
    input_size / N, (r + 1) * input_size / N)``, takes that slice of the input, ``x [T, input_size / N] -> [T,
    output_size]``, and the ranks' partial products are summed by an all-reduce (then the bias, once)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.input_size, self.output_size = input_size, output_size
        super().__init__(divide(input_size, self.tp_size, "input_size"), output_size, bias=bias)

    def shard_loaded_weight(self, param_name: str, loaded_weight: torch.Tensor) -> torch.Tensor:
        """This rank's columns of the whole ``weight [output_size, input_size]``; the bias is whole."""
        if param_name == "bias":
            return loaded_weight
        n = self.in_features
        return loaded_weight.narrow(1, self.tp_rank * n, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(x)
        out = tensor_model_parallel_all_reduce(self.linear(x, None))
        return out if self.bias is None else out + self.bias
