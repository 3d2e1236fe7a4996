"""``reset_prefix_cache(reset_running_requests=True)`` (vLLM 0.32: ``Scheduler.reset_prefix_cache`` in
``vllm/v1/core/sched/scheduler.py``): every running request is preempted back to the waiting queue, in running
order and ahead of the requests already waiting, then the prefix cache is reset."""

import pytest

from minivllm import LLM, SamplingParams
from minivllm.course.trace import TracedLLMEngine
from minivllm.distributed.kv_transfer import OffloadConnector
from minivllm.request import RequestStatus

PROMPTS = {"a": list(range(1, 19)), "b": list(range(1, 9)) + list(range(40, 50)), "c": list(range(60, 73)),
           "w": list(range(1, 9)) + [99] * 6}
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
NUM_BLOCKS = 48


def _engine(**kw):
    return TracedLLMEngine("tiny", block_size=4, num_gpu_blocks=NUM_BLOCKS, max_num_batched_tokens=24, max_num_seqs=3,
                     **kw)


def _start():
    eng = _engine()
    for rid, p in PROMPTS.items():
        eng.add_request(rid, p, GREEDY)
    for _ in range(4):
        eng.step()
    waiting, running = eng.scheduler.queue_snapshot()
    assert running == ["a", "b", "c"] and waiting == ["w"]  # max_num_seqs=3 keeps w waiting
    assert all(eng.get_request(r).num_output_tokens > 0 for r in running)
    return eng


@pytest.fixture(scope="module")
def uninterrupted():
    eng = _engine()
    for rid, p in PROMPTS.items():
        eng.add_request(rid, p, GREEDY)
    return {rid: o.outputs[0].token_ids for rid, o in eng.run_to_completion().items()}


def test_without_the_flag_nothing_changes_while_requests_hold_blocks():
    eng = _start()
    kv = eng.kv_cache_manager
    before = (eng.scheduler.queue_snapshot(), kv.num_free_blocks, len(kv.block_pool.cached_block_hash_to_block))
    assert eng.reset_prefix_cache() is False
    assert (eng.scheduler.queue_snapshot(), kv.num_free_blocks, len(kv.block_pool.cached_block_hash_to_block)) == before


def test_reset_running_requests_preempts_in_order_and_frees_every_block(uninterrupted):
    eng = _start()
    kv = eng.kv_cache_manager
    assert len(kv.block_pool.cached_block_hash_to_block) > 0
    outputs_before = {r: list(eng.get_request(r).output_token_ids) for r in "abc"}
    assert eng.reset_prefix_cache(reset_running_requests=True) is True
    assert eng.scheduler.queue_snapshot() == (["a", "b", "c", "w"], [])
    assert kv.num_free_blocks == NUM_BLOCKS and len(kv.block_pool.cached_block_hash_to_block) == 0
    assert all(b.block_hash is None for b in kv.block_pool.blocks)
    for r in "abc":
        req = eng.get_request(r)
        assert req.status == RequestStatus.PREEMPTED and req.num_computed_tokens == 0 and req.num_preemptions == 1
        assert req.output_token_ids == outputs_before[r]  # generated tokens are kept
    assert eng.get_request("w").num_preemptions == 0
    assert eng.num_preemptions == 3
    # The next step reports them preempted and resumes them in order (the waiting loop is not gated).
    eng.step()
    last = eng.trace.steps[-1]
    assert last.preempted == ["a", "b", "c"] and "w" in last.waiting
    # a's whole sequence is recomputed in one chunk; b takes the rest of the budget of 24; c waits its turn.
    n_a = eng.get_request("a").num_tokens - 1  # before this step's token was appended
    assert last.resumed == ["a", "b"] and last.num_scheduled_tokens == {"a": n_a, "b": 24 - n_a}
    final = eng.run_to_completion()
    assert sorted(final) == ["a", "b", "c", "w"]
    assert {rid: o.outputs[0].token_ids for rid, o in final.items()} == uninterrupted
    assert kv.num_free_blocks == NUM_BLOCKS


def test_reset_mid_prefill_and_through_llm():
    llm = LLM("tiny", block_size=4, num_gpu_blocks=NUM_BLOCKS, max_num_batched_tokens=8, enable_prefix_caching=True)
    eng = llm.llm_engine
    eng.add_request("long", list(range(1, 30)), GREEDY)
    eng.step()  # 8 of 29 prompt tokens computed
    assert eng.get_request("long").num_computed_tokens == 8
    assert llm.reset_prefix_cache(reset_running_requests=True) is True
    assert eng.kv_cache_manager.num_free_blocks == NUM_BLOCKS
    out = eng.run_to_completion()["long"].outputs[0].token_ids
    ref = LLM("tiny", block_size=4, num_gpu_blocks=NUM_BLOCKS).generate([list(range(1, 30))], GREEDY,
                                                                       use_tqdm=False)[0].outputs[0].token_ids
    assert out == ref


def test_waiting_request_holding_blocks_makes_it_raise_before_any_change():
    conn = OffloadConnector(4, load_mode="async", async_load_delay_steps=5)
    eng = _engine(kv_connector=conn, enable_prefix_caching=False)  # the store, not the local cache, has the prompt
    eng.add_request("warm", PROMPTS["a"], GREEDY)
    eng.run_to_completion()
    eng.add_request("run", PROMPTS["c"], GREEDY)
    eng.step()
    eng.add_request("load", PROMPTS["a"], GREEDY)  # its blocks are in the store: an asynchronous load
    eng.step()
    assert eng.get_request("load").status == RequestStatus.WAITING_FOR_REMOTE_KVS
    kv = eng.kv_cache_manager
    before = (eng.scheduler.queue_snapshot(), kv.num_free_blocks, eng.get_request("run").num_computed_tokens,
              len(kv.block_pool.cached_block_hash_to_block), eng.num_preemptions)
    with pytest.raises(RuntimeError, match="'load' WAITING_FOR_REMOTE_KVS"):
        eng.reset_prefix_cache(reset_running_requests=True)
    assert (eng.scheduler.queue_snapshot(), kv.num_free_blocks, eng.get_request("run").num_computed_tokens,
            len(kv.block_pool.cached_block_hash_to_block), eng.num_preemptions) == before
    final = eng.run_to_completion()
    assert sorted(final) == ["load", "run"] and kv.num_free_blocks == NUM_BLOCKS
