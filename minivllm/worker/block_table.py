"""Block tables and the slot mapping (vLLM: ``vllm/v1/worker/block_table.py`` at v0.32.0).

A request's *block table* lists the ids of its KV blocks in position order; the token at position ``p`` lives in
block ``block_table[p // block_size]`` at offset ``p % block_size``, i.e. at *slot*
``block_table[p // block_size] * block_size + p % block_size`` of the cache seen as ``[num_blocks * block_size]``
rows (PagedAttention, Kwon et al., SOSP 2023, section 4.1). ``compute_slot_mapping`` below is the one place that
formula is written, under vLLM's one name: notebook 03 teaches it for one request, ``BlockTable.compute_slot_mapping``
calls it for every step the engine runs.

Padding: the rows of a step's ``[num_reqs, max_blocks]`` table are padded with ``pad_block_id``, the *scratch
block* (``ModelRunner.scratch_block_id``): one block at the end of every layer's cache that the scheduler never
hands out. Nothing reads a padding entry (attention stops at each request's ``seq_len``), and the CUDA-graph
padding rows write their keys and values there, so padding never touches a block that a request owns. vLLM
reserves block 0 of the pool instead (``BlockPool``'s ``null_block``); minivllm keeps its block ids and free-block
counts as the notebooks show them and puts the scratch block outside the pool.
"""

from __future__ import annotations

from typing import Any, List, Sequence, overload

import numpy as np
import torch

from minivllm.attention.backend import CommonAttentionMetadata


@overload
def compute_slot_mapping(block_table: Sequence[int], positions: Sequence[int], block_size: int,
                         req_indices: None = None) -> List[int]: ...


@overload
def compute_slot_mapping(block_table: np.ndarray, positions: np.ndarray, block_size: int,
                         req_indices: np.ndarray) -> np.ndarray: ...


def compute_slot_mapping(block_table: Any, positions: Any, block_size: int, req_indices: Any = None) -> Any:
    """Cache slots of tokens: ``block_table[row, p // block_size] * block_size + p % block_size`` (vLLM's name,
    ``BlockTable.compute_slot_mapping``; the one place the formula is written).

    Args:
        block_table: one request's block ids (``req_indices=None``: as notebook 03 writes it, with Python lists in
            and out), or ``int64 [num_rows, max_blocks]`` block ids of several requests.
        positions: each token's position in its request (``int64 [num_tokens]``).
        block_size: tokens per block.
        req_indices: ``int64 [num_tokens]``, the row of ``block_table`` of each token; ``None`` for one request.

    Returns:
        ``List[int]`` for one request, else ``int64 [num_tokens]``.

    Raises:
        IndexError: a position lies past the table's width.
    """
    pos = np.asarray(positions, dtype=np.int64)
    table = np.asarray(block_table, dtype=np.int64)
    if req_indices is None:
        table, rows = table.reshape(1, -1), np.zeros_like(pos)
    else:
        rows = req_indices
    slots = table[rows, pos // block_size] * block_size + pos % block_size
    return slots.tolist() if req_indices is None else slots


class BlockTable:
    """Per-request rows of block ids, kept between steps (vLLM ``BlockTable``).

    Row ``i`` holds the block ids of the request at row ``i`` of the ``InputBatch``; ``num_blocks_per_row[i]`` of
    them are real, the rest are ``pad_block_id``. Rows are added as requests arrive and grow by the blocks each
    ``SchedulerOutput`` hands out (``append_row``); a resumed request gets a whole new row (``add_row``).

    Differences from vLLM: the table lives in a growing numpy array on the host and the step's rows are gathered
    and copied to the device in ``compute_slot_mapping``'s caller (vLLM keeps pinned CPU and GPU copies of a
    fixed ``[max_num_reqs, max_num_blocks_per_req]`` table and computes the slot mapping with a Triton kernel).

    Args:
        block_size: tokens per block.
        max_num_blocks_per_req: width of a row; ``append_row`` past it raises ``ValueError``.
        pad_block_id: the block id of padding entries (the scratch block).
    """

    def __init__(self, block_size: int, max_num_blocks_per_req: int, pad_block_id: int) -> None:
        self.block_size = block_size
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.pad_block_id = pad_block_id
        self.block_table_np = np.full((16, max_num_blocks_per_req), pad_block_id, dtype=np.int64)
        self.num_blocks_per_row = np.zeros(16, dtype=np.int64)

    def _ensure_rows(self, num_rows: int) -> None:
        old = self.block_table_np.shape[0]
        if num_rows <= old:
            return
        new = max(num_rows, 2 * old)
        table = np.full((new, self.max_num_blocks_per_req), self.pad_block_id, dtype=np.int64)
        table[:old] = self.block_table_np
        self.block_table_np = table
        self.num_blocks_per_row = np.concatenate([self.num_blocks_per_row, np.zeros(new - old, dtype=np.int64)])

    def append_row(self, block_ids: Sequence[int], row_idx: int) -> None:
        """Append ``block_ids`` to row ``row_idx``.

        Raises:
            ValueError: the row would hold more than ``max_num_blocks_per_req`` blocks (nothing is written).
        """
        if not block_ids:
            return
        self._ensure_rows(row_idx + 1)
        start = int(self.num_blocks_per_row[row_idx])
        end = start + len(block_ids)
        if end > self.max_num_blocks_per_req:
            raise ValueError(
                f"block table row {row_idx} would hold {end} blocks, more than max_num_blocks_per_req "
                f"({self.max_num_blocks_per_req})"
            )
        self.block_table_np[row_idx, start:end] = block_ids
        self.num_blocks_per_row[row_idx] = end

    def add_row(self, block_ids: Sequence[int], row_idx: int) -> None:
        """Replace row ``row_idx`` by ``block_ids`` (a new or resumed request)."""
        self.clear_row(row_idx)
        self.append_row(block_ids, row_idx)

    def clear_row(self, row_idx: int) -> None:
        """Reset row ``row_idx`` to padding (its request finished or was preempted)."""
        self._ensure_rows(row_idx + 1)
        self.block_table_np[row_idx, : self.num_blocks_per_row[row_idx]] = self.pad_block_id
        self.num_blocks_per_row[row_idx] = 0

    def row(self, row_idx: int) -> List[int]:
        """The real block ids of row ``row_idx``."""
        return self.block_table_np[row_idx, : self.num_blocks_per_row[row_idx]].tolist()

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """``int64 [len(rows), max_blocks]``: the given rows, cut to the widest of them (a copy)."""
        width = max(int(self.num_blocks_per_row[rows].max()), 1) if len(rows) else 1
        return self.block_table_np[rows, :width]

    def compute_slot_mapping(self, rows: np.ndarray, req_indices: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """``int64 [num_tokens]`` slots of a step's tokens (vLLM ``BlockTable.compute_slot_mapping``).

        Args:
            rows: ``int64 [num_reqs]`` the block-table row of each scheduled request, in batch order.
            req_indices: ``int64 [num_tokens]`` index into ``rows`` of each token's request.
            positions: ``int64 [num_tokens]``.
        """
        return compute_slot_mapping(self.block_table_np, positions, self.block_size, rows[req_indices])


def create_common_attn_metadata(
    block_tables: List[List[int]],
    num_computed_tokens: List[int],
    query_lens: List[int],
    block_size: int,
    pad_block_id: int = 0,
    device=None,
) -> CommonAttentionMetadata:
    """A step's ``CommonAttentionMetadata`` from per-request lists, as the model runner builds it from its
    ``BlockTable`` (for tests, exercises and notebooks; vLLM: ``tests/v1/attention/utils.py``
    ``create_common_attn_metadata``).

    Args:
        block_tables: each request's block ids; must cover ``num_computed + query_len`` tokens.
        num_computed_tokens: context length of each request (>= 0).
        query_lens: tokens computed this step per request (>= 0; a request with 0 has no rows this step).
        block_size: tokens per block.
        pad_block_id: block id of the padding entries of shorter rows (never read).
        device: device of the tensors.

    Raises:
        ValueError: lengths differ, a ``query_len < 0``, ``num_computed < 0``, or a block table too short.
    """
    if not len(block_tables) == len(num_computed_tokens) == len(query_lens):
        raise ValueError("block_tables, num_computed_tokens and query_lens must have one entry per request")
    for i, (bt, c, q) in enumerate(zip(block_tables, num_computed_tokens, query_lens)):
        if q < 0:
            raise ValueError(f"query_lens[{i}] must be >= 0, got {q}")
        if c < 0:
            raise ValueError(f"num_computed_tokens[{i}] must be >= 0, got {c}")
        if len(bt) * block_size < c + q:
            raise ValueError(
                f"block_table has {len(bt)} blocks of {block_size} tokens, too few for {c + q} tokens"
            )
    width = max(len(b) for b in block_tables)
    table = np.array([list(b) + [pad_block_id] * (width - len(b)) for b in block_tables], dtype=np.int64)
    positions = np.concatenate([np.arange(c, c + q) for c, q in zip(num_computed_tokens, query_lens)])
    req_indices = np.repeat(np.arange(len(query_lens)), query_lens)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    seq = [c + q for c, q in zip(num_computed_tokens, query_lens)]
    t = lambda a: torch.as_tensor(np.asarray(a, dtype=np.int64)).to(device)  # noqa: E731
    return CommonAttentionMetadata(
        query_start_loc=t(qsl), seq_lens=t(seq), block_table_tensor=t(table),
        slot_mapping=t(compute_slot_mapping(table, positions, block_size, req_indices)), positions=t(positions),
        query_start_loc_cpu=qsl, seq_lens_cpu_upper_bound=seq,
        num_reqs=len(query_lens), num_actual_tokens=qsl[-1], max_query_len=max(query_lens), max_seq_len=max(seq),
    )
