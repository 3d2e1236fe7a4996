"""BlockTable and InputBatch (minivllm/worker): rows kept between steps, the one slot-mapping formula, padding."""

import numpy as np
import pytest

from minivllm.worker.block_table import BlockTable, compute_slot_mapping
from minivllm.worker.input_batch import InputBatch


def test_rows_grow_reset_and_pad_with_the_scratch_block():
    bt = BlockTable(block_size=4, max_num_blocks_per_req=5, pad_block_id=99)
    bt.add_row([7, 2], 0)
    bt.add_row([3], 1)
    bt.append_row([9], 0)
    assert bt.row(0) == [7, 2, 9] and bt.row(1) == [3]
    assert bt.gather(np.array([1, 0])).tolist() == [[3, 99, 99], [7, 2, 9]]
    bt.add_row([4, 4], 0)  # a resumed request: a whole new row
    assert bt.block_table_np[0].tolist() == [4, 4, 99, 99, 99]
    bt.clear_row(1)
    assert bt.row(1) == [] and bt.block_table_np[1].tolist() == [99] * 5


def test_append_past_the_row_width_raises_before_writing():
    bt = BlockTable(block_size=4, max_num_blocks_per_req=3, pad_block_id=0)
    bt.add_row([5, 6], 2)
    with pytest.raises(ValueError, match="max_num_blocks_per_req"):
        bt.append_row([7, 8], 2)
    assert bt.row(2) == [5, 6]


def test_batch_slot_mapping_equals_the_one_request_formula():
    bt = BlockTable(block_size=4, max_num_blocks_per_req=8, pad_block_id=0)
    tables = {3: [7, 2, 9], 0: [1, 11], 5: [4]}
    for row, blocks in tables.items():
        bt.add_row(blocks, row)
    rows = np.array([3, 0, 5])
    positions = [[4, 5, 6, 7, 8, 9], [6], [0, 1, 2]]
    req_indices = np.repeat(np.arange(3), [len(p) for p in positions])
    slots = bt.compute_slot_mapping(rows, req_indices, np.concatenate(positions)).tolist()
    expected = sum((compute_slot_mapping(tables[r], p, 4) for r, p in zip(rows.tolist(), positions)), [])
    assert slots == expected == [8, 9, 10, 11, 36, 37, 46, 16, 17, 18]


def test_the_slot_mapping_has_one_name_for_one_request_and_for_a_batch():
    """Issue 24: block_table.py wrote the formula under three names (slot_mapping_of, compute_slot_mapping and
    BlockTable.compute_slot_mapping); now vLLM's name only, one function for one request and for a batch."""
    from minivllm.worker import block_table

    table = np.array([[7, 2, 9], [1, 11, 0]], dtype=np.int64)
    positions, req_indices = np.array([4, 9, 6, 0]), np.array([0, 0, 1, 1])
    slots = compute_slot_mapping(table, positions, 4, req_indices)
    assert slots.dtype == np.int64 and slots.tolist() == [8, 37, 46, 4]
    assert compute_slot_mapping([7, 2, 9], [4, 9], 4) == [8, 37]
    assert [n for n in vars(block_table) if "slot_mapping" in n] == ["compute_slot_mapping"]


def test_one_request_slot_mapping_rejects_positions_past_its_blocks():
    with pytest.raises(IndexError):
        compute_slot_mapping([7, 2], [8], 4)


def test_input_batch_reuses_freed_rows():
    batch = InputBatch(block_size=4, max_num_blocks_per_req=4, pad_block_id=50)
    assert [batch.add_request(r, [i]) for i, r in enumerate("abc")] == [0, 1, 2]
    batch.remove_request("b")
    assert batch.block_table.row(1) == [] and batch.num_reqs == 2
    assert batch.add_request("d", [8, 9]) == 1
    batch.append_blocks("d", [10])
    assert batch.block_table.row(1) == [8, 9, 10]
    assert batch.add_request("c", [3]) == 2  # a resumed request keeps its row, with a new table
    assert batch.block_table.row(2) == [3]
