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

Padding rows write their K/V into a *scratch block* (one extra block at the end of every layer's cache that the
scheduler never hands out; vLLM's null block plays this role) and attend to one key, so they never touch a real
request's cache. Graphs are captured lazily, the first time a ``(B, NB)`` pair is needed, and share one memory
pool. Only pure-decode steps are replayed; steps with a prefill chunk, a KV connector or the reference attention
run eagerly.

On the CPU nothing here runs by default. ``emulate=True`` runs the same padded static-buffer forward eagerly (no
graph), which lets the CPU test suite check the padding logic token for token.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from minivllm.attention.paged_attention import AttentionMetadata


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
        kv_caches: per-layer caches with one scratch block at index ``scratch_block`` (the last one).
        block_size: tokens per block.
        max_batch: largest decode batch to replay (larger ones run eagerly).
        max_blocks: widest block table to replay (wider ones run eagerly).
        emulate: run the padded forward eagerly instead of capturing (for CPU tests).
    """

    def __init__(self, model, kv_caches: List[torch.Tensor], block_size: int, max_batch: int, max_blocks: int,
                 emulate: bool = False) -> None:
        device = kv_caches[0].device
        if device.type != "cuda" and not emulate:
            raise ValueError(f"CUDA graphs need a CUDA device, the KV cache is on {device}")
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_block = kv_caches[0].shape[1] - 1
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
        self.key_pos = torch.arange(self.max_blocks * block_size, **z)
        self.rows = torch.arange(self.max_batch + 1, **z)
        self.graphs: Dict[Tuple[int, int], object] = {}
        self.outputs: Dict[Tuple[int, int], torch.Tensor] = {}
        self.pool = None
        self.num_replays = 0  # decode steps served from a graph (or, emulated, from the padded buffers)

    def bucket(self, num_reqs: int, num_blocks: int) -> Optional[Tuple[int, int]]:
        """The captured ``(B, NB)`` for a decode batch, or ``None`` if it is too large to replay."""
        if num_reqs > self.max_batch or num_blocks > self.max_blocks:
            return None
        b = next(s for s in self.sizes if s >= num_reqs)
        return b, min(_next_pow2(num_blocks), self.max_blocks)

    def _metadata(self, b: int, nb: int) -> AttentionMetadata:
        bs = self.block_size
        seq = self.seq_lens[:b]
        md = AttentionMetadata(
            query_start_loc=self.rows[: b + 1], seq_lens=seq, num_computed_tokens=seq - 1,
            block_table=self.block_table[:b, :nb], slot_mapping=self.slot_mapping[:b], positions=self.positions[:b],
            block_size=bs, query_lens=[1] * b, seq_lens_list=[], computed_list=[], query_start_list=list(range(b)),
            decode_reqs=list(range(b)), prefill_reqs=[],
        )
        md.decode_token_idx = self.rows[:b]
        md.decode_block_table = md.block_table
        md.decode_key_mask = self.key_pos[None, : nb * bs] >= seq[:, None]
        return md

    def _forward(self, b: int, nb: int) -> torch.Tensor:
        return self.model(self.input_ids[:b], self.positions[:b], self.kv_caches, self._metadata(b, nb))

    def _capture(self, key: Tuple[int, int]) -> None:
        b, nb = key
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

    def _reset_padding(self) -> None:
        self.input_ids.zero_()
        self.positions.zero_()
        self.slot_mapping.fill_(self.scratch_block * self.block_size)
        self.seq_lens.fill_(1)
        self.block_table.fill_(self.scratch_block)

    def run(self, input_ids: torch.Tensor, md: AttentionMetadata) -> Optional[torch.Tensor]:
        """Hidden states ``[R, hidden]`` of a pure-decode step, or ``None`` if this batch cannot be replayed.

        Args:
            input_ids: ``int64 [R]`` (one token per request).
            md: the step's eagerly built metadata (``decode_block_table [R, nblk]`` and ``seq_lens``).
        """
        r = input_ids.shape[0]
        nblk = md.decode_block_table.shape[1]
        key = self.bucket(r, nblk)
        if key is None:
            return None
        b, nb = key
        with torch.inference_mode():
            self._reset_padding()
            self.input_ids[:r].copy_(input_ids)
            self.positions[:r].copy_(md.positions)
            self.slot_mapping[:r].copy_(md.slot_mapping)
            self.seq_lens[:r].copy_(md.seq_lens)
            self.block_table[:r, :nblk].copy_(md.decode_block_table)
            self.num_replays += 1
            if self.emulate:
                return self._forward(b, nb)[:r]
            if key not in self.graphs:
                self._capture(key)
            self.graphs[key].replay()
            return self.outputs[key][:r]
