"""CUDA graphs for decode steps (vLLM: ``vllm/v1/worker/gpu_model_runner.py`` ``capture_model`` and
``vllm/compilation/cuda_graph.py`` ``CUDAGraphWrapper``).

A decode step of a 135M-parameter model launches about 1,800 small kernels; on a GPU, launching them from Python
takes far longer than running them. A CUDA graph records the launches of one forward pass once and replays them
with a single call. A graph replays exactly what it recorded: the same kernels on the same memory with the same
shapes. So the inputs live in *static buffers* that each step overwrites, and the batch is padded up to one of a
few captured sizes:

* the number of decode requests ``R`` is padded to the next captured batch size ``B`` (1, 2, 4, 8, 16, 24, 32,
  then steps of 16 as in vLLM's ``cudagraph_capture_sizes``);
* the block-table width is padded to the next power of two ``NB`` (the decode attention reads ``NB * block_size``
  keys per request, masked beyond each request's ``seq_len``).

Padding rows write their K/V into the *scratch block* (``ModelRunner.scratch_block_id``: one extra block at the
end of every layer's cache that the scheduler never hands out, where every block table's padding points; vLLM's
null block plays this role) and attend to one key, so they never touch a real request's cache. The attention
metadata is built by the backend's builder (``build_for_cudagraph_capture``) from the static buffers, inside the
captured region. Graphs are captured lazily, the first time a ``(B, NB)`` pair is needed, and share one memory
pool. Only pure-decode steps are replayed; steps with a prefill chunk, a KV connector or the reference attention
run eagerly. The backends that can be captured (``supports_cudagraph``) are ``TORCH_SDPA`` and ``TRITON_ATTN``
(the CUDA default, whose kernels read ``seq_lens`` and the block table from the buffers at every replay; its
launch grid and context split follow the bucket's shape ``(B, NB)``). ``capture_seconds`` records each capture.

On the CPU nothing here runs by default. ``emulate=True`` runs the same padded static-buffer forward eagerly (no
graph), which lets the CPU test suite check the padding logic token for token.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Tuple

import torch

from minivllm.attention.backend import AttentionMetadata, AttentionMetadataBuilder, CommonAttentionMetadata


def capture_sizes(max_batch: int) -> List[int]:
    """Batch sizes to capture: 1, 2, 4, 8, 16, 24, 32, 48, ... (steps of 16) up to ``max_batch`` (included)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [s for s in (1, 2, 4, 8, 16, 24, 32) if s < max_batch]
    s = 48
    while s < max_batch:
        sizes.append(s)
        s += 16
    return sizes + [max_batch]


def _next_pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


class DecodeGraphRunner:
    """Owns the static buffers and the captured graphs of pure-decode forward passes.

    Args:
        model: the ``LlamaForCausalLM``.
        kv_caches: per-layer caches.
        builder: the attention backend's metadata builder.
        scratch_block: the block padding rows write to (never handed out by the scheduler).
        max_batch: largest decode batch to replay (larger ones run eagerly).
        max_blocks: widest block table to replay (wider ones run eagerly).
        emulate: run the padded forward eagerly instead of capturing (for CPU tests).
    """

    def __init__(self, model, kv_caches: List[torch.Tensor], builder: AttentionMetadataBuilder, scratch_block: int,
                 max_batch: int, max_blocks: int, emulate: bool = False) -> None:
        device = kv_caches[0].device
        if device.type != "cuda" and not emulate:
            raise ValueError(f"CUDA graphs need a CUDA device, the KV cache is on {device}")
        self.model = model
        self.kv_caches = kv_caches
        self.builder = builder
        self.block_size = block_size = builder.block_size
        self.scratch_block = scratch_block
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.max_blocks = _next_pow2(max_blocks)
        self.emulate = emulate
        z = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(self.max_batch, **z)
        self.positions = torch.zeros(self.max_batch, **z)
        self.slot_mapping = torch.full((self.max_batch,), self.scratch_block * block_size, **z)
        self.seq_lens = torch.ones(self.max_batch, **z)
        self.block_table = torch.full((self.max_batch, self.max_blocks), self.scratch_block, **z)
        self.rows = torch.arange(self.max_batch + 1, **z)
        self.graphs: Dict[Tuple[int, int], object] = {}
        self.outputs: Dict[Tuple[int, int], torch.Tensor] = {}
        self.pool = None
        self.num_replays = 0  # decode steps served from a graph (or, emulated, from the padded buffers)
        # Seconds spent on each captured (B, NB): two warm-up forwards (which compile any Triton kernel variant
        # first seen) plus the capture itself; reported by the GPU check next to ``sizes``.
        self.capture_seconds: Dict[Tuple[int, int], float] = {}

    def bucket(self, num_reqs: int, num_blocks: int) -> Optional[Tuple[int, int]]:
        """The captured ``(B, NB)`` for a decode batch, or ``None`` if it is too large to replay."""
        if num_reqs > self.max_batch or num_blocks > self.max_blocks:
            return None
        b = next(s for s in self.sizes if s >= num_reqs)
        return b, min(_next_pow2(num_blocks), self.max_blocks)

    def _metadata(self, b: int, nb: int) -> AttentionMetadata:
        # The *_cpu lists describe the captured shape only: the values change at every replay.
        cm = CommonAttentionMetadata(
            query_start_loc=self.rows[: b + 1], seq_lens=self.seq_lens[:b], block_table_tensor=self.block_table[:b, :nb],
            slot_mapping=self.slot_mapping[:b], positions=self.positions[:b], query_start_loc_cpu=list(range(b + 1)),
            seq_lens_cpu_upper_bound=[], num_reqs=b, num_actual_tokens=b, max_query_len=1,
            max_seq_len=nb * self.block_size,
        )
        return self.builder.build_for_cudagraph_capture(cm)

    def _forward(self, b: int, nb: int) -> torch.Tensor:
        return self.model(self.input_ids[:b], self.positions[:b], self.kv_caches, self._metadata(b, nb))

    def _capture(self, key: Tuple[int, int]) -> None:
        b, nb = key
        start = time.perf_counter()
        # Warm-up and capture run on this step's inputs, already in the static buffers: they write the same K/V
        # to the same slots as the replay that follows, so they change nothing.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: lazy cuBLAS/cuDNN initialisation must not happen during capture
                self._forward(b, nb)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[key] = self._forward(b, nb)
        self.graphs[key] = graph
        torch.cuda.synchronize()
        self.capture_seconds[key] = time.perf_counter() - start

    def _reset_padding(self) -> None:
        self.input_ids.zero_()
        self.positions.zero_()
        self.slot_mapping.fill_(self.scratch_block * self.block_size)
        self.seq_lens.fill_(1)
        self.block_table.fill_(self.scratch_block)

    def run(self, input_ids: torch.Tensor, cm: CommonAttentionMetadata) -> Optional[torch.Tensor]:
        """Hidden states ``[R, hidden]`` of a pure-decode step, or ``None`` if this batch cannot be replayed.

        Args:
            input_ids: ``int64 [R]`` (one token per request).
            cm: the step's common metadata (every request has one query token).
        """
        r = input_ids.shape[0]
        nblk = -(-cm.max_seq_len // self.block_size)
        key = self.bucket(r, nblk)
        if key is None:
            return None
        b, nb = key
        with torch.inference_mode():
            self._reset_padding()
            self.input_ids[:r].copy_(input_ids)
            self.positions[:r].copy_(cm.positions)
            self.slot_mapping[:r].copy_(cm.slot_mapping)
            self.seq_lens[:r].copy_(cm.seq_lens)
            self.block_table[:r, :nblk].copy_(cm.block_table_tensor[:, :nblk])
            self.num_replays += 1
            if self.emulate:
                return self._forward(b, nb)[:r]
            if key not in self.graphs:
                self._capture(key)
            self.graphs[key].replay()
            return self.outputs[key][:r]
