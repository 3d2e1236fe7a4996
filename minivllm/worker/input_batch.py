"""What the model runner keeps about its requests between steps, and one step's inputs (vLLM:
``vllm/v1/worker/gpu_input_batch.py`` ``CachedRequestState`` and ``InputBatch``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from minivllm.attention.backend import AttentionMetadata, CommonAttentionMetadata
from minivllm.outputs import LogprobsEntry
from minivllm.sampling_params import SamplingParams
from minivllm.worker.block_table import BlockTable


@dataclass
class CachedRequestState:
    """What the runner remembers about a request between steps (vLLM ``CachedRequestState``).

    ``in_progress_prompt_logprobs``: with ``prompt_logprobs``, the entries of the prompt chunks run so far (vLLM
    ``in_progress_prompt_logprobs_cpu``); handed out in ``ModelRunnerOutput.prompt_logprobs_dict`` by the step
    whose chunk completes the prompt, after which ``prompt_logprobs_done`` is set.
    """

    req_id: str
    token_ids: List[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: List[int]
    num_computed_tokens: int
    generator: Optional[torch.Generator]
    eos_token_id: Optional[int] = None
    in_progress_prompt_logprobs: List[Optional[LogprobsEntry]] = field(default_factory=list)
    prompt_logprobs_done: bool = False

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class InputBatch:
    """The runner's requests as rows of a persistent ``BlockTable`` (vLLM ``InputBatch``).

    A request keeps its row from its first step until it finishes or is preempted; freed rows are reused. vLLM
    also keeps token ids, sampling parameters and the like in per-row arrays and condenses the rows so that a
    step's requests are rows ``0 .. num_reqs - 1``; minivllm keeps those in ``CachedRequestState`` and gathers the
    step's rows from the table (``BlockTable.gather``), which is cheap at its batch sizes.

    Args:
        block_size, max_num_blocks_per_req, pad_block_id: of the ``BlockTable``.
    """

    def __init__(self, block_size: int, max_num_blocks_per_req: int, pad_block_id: int) -> None:
        self.block_table = BlockTable(block_size, max_num_blocks_per_req, pad_block_id)
        self.req_id_to_index: Dict[str, int] = {}
        self._free_rows: List[int] = []

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add_request(self, req_id: str, block_ids: List[int]) -> int:
        """Give ``req_id`` a row holding ``block_ids`` (a new row, or a resumed request's old one); returns it."""
        row = self.req_id_to_index.get(req_id)
        if row is None:
            row = self._free_rows.pop() if self._free_rows else len(self.req_id_to_index)
            self.req_id_to_index[req_id] = row
        self.block_table.add_row(block_ids, row)
        return row

    def append_blocks(self, req_id: str, block_ids: List[int]) -> None:
        """Append this step's new blocks to ``req_id``'s row."""
        self.block_table.append_row(block_ids, self.req_id_to_index[req_id])

    def remove_request(self, req_id: str) -> None:
        """Free ``req_id``'s row (no-op for an unknown request)."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is not None:
            self.block_table.clear_row(row)
            self._free_rows.append(row)


@dataclass
class ModelInputs:
    """One step's flattened batch, as ``ModelRunner._prepare_inputs`` returns it (``T`` tokens, ``R`` requests).

    Attributes:
        req_ids: ``R`` request ids in batch order (the ``SchedulerOutput``'s).
        states: their ``CachedRequestState``, same order.
        input_ids: ``int64 [T]``.
        common_attn_metadata: the batch as every attention backend sees it (positions, slots, block table, ...).
        attn_metadata: the runner's backend's metadata, built from it by ``execute_model`` for an eager step
            (``None`` before that, and for a step replayed from a CUDA graph, which builds its own).
        logits_indices: ``int64 [R]``: the last scheduled token of each request (``query_start_loc[1:] - 1``).
        discard: ``R`` bools, True where the sampled token is thrown away (a partial prefill).
    """

    req_ids: List[str]
    states: List[CachedRequestState]
    input_ids: torch.Tensor
    common_attn_metadata: CommonAttentionMetadata
    attn_metadata: Optional[AttentionMetadata]
    logits_indices: torch.Tensor
    discard: List[bool]
