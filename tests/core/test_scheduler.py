"""The scheduler driven alone: hand-made model-runner outputs, no model (vLLM's
``tests/v1/core/test_scheduler.py`` style). Every test states tokens per request per step, ids and block counts.

The fake model runner (``step``) samples one token for a request whose scheduled tokens reach the end of its known
tokens and ``[]`` for a partial prefill, as ``ModelRunner.sample_tokens`` does.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import pytest

from minivllm.config import SchedulerConfig
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.kv_cache_utils import get_request_block_hasher
from minivllm.core.sched.output import SchedulerOutput
from minivllm.core.sched.scheduler import Scheduler
from minivllm.distributed.kv_transfer.base import KVConnectorBase, KVConnectorMetadata
from minivllm.engine import EngineCoreOutput
from minivllm.outputs import ModelRunnerOutput
from minivllm.request import Request, RequestStatus
from minivllm.sampling_params import SamplingParams


def make_scheduler(budget=64, num_blocks=100, block_size=16, policy="fcfs", max_num_seqs=16, max_model_len=2048,
                   caching=True, connector=None, **config) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                          policy=policy, **config)
    cfg.verify()
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size, max_model_len, caching, cfg.watermark), connector)


def add(sched: Scheduler, rid: str, prompt: Sequence[int], max_tokens: int = 16, priority: int = 0,
        arrival: float = 0.0, eos: Optional[int] = None, stop_token_ids=None) -> Request:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=stop_token_ids)
    hasher = get_request_block_hasher(sched.block_size) if sched.kv_cache_manager.enable_caching else None
    req = Request(rid, list(prompt), sp, arrival_time=arrival, priority=priority, eos_token_id=eos,
                  block_hasher=hasher)
    sched.add_request(req)
    return req


def runner_output(sched: Scheduler, so: SchedulerOutput, tokens: Optional[Dict[str, int]] = None) -> ModelRunnerOutput:
    """What the model runner returns: ``[token]`` (default 1) when the request's known tokens are all computed."""
    tokens = tokens or {}
    req_ids = list(so.num_scheduled_tokens)
    sampled: List[List[int]] = []
    for rid in req_ids:
        r = sched.requests.get(rid)
        done_prefill = r is not None and r.num_computed_tokens >= r.num_tokens
        sampled.append([tokens.get(rid, 1)] if done_prefill else [])
    return ModelRunnerOutput(req_ids, {rid: i for i, rid in enumerate(req_ids)}, sampled)


def step(sched: Scheduler, tokens: Optional[Dict[str, int]] = None) -> Tuple[SchedulerOutput, List[EngineCoreOutput]]:
    so = sched.schedule()
    return so, sched.update_from_output(so, runner_output(sched, so, tokens))


def num_blocks(sched: Scheduler, rid: str) -> int:
    return len(sched.kv_cache_manager.get_block_ids(rid))


def free_blocks(sched: Scheduler) -> int:
    return sched.kv_cache_manager.block_pool.get_num_free_blocks()


# ---- chunked prefill ------------------------------------------------------------------------------------------
def test_a_160_token_prompt_at_budget_64_is_computed_in_chunks_of_64_64_32():
    sched = make_scheduler(budget=64)
    add(sched, "A", range(1, 161))
    chunks, blocks, outputs = [], [], []
    for _ in range(4):
        so, out = step(sched, {"A": 500})
        chunks.append(so.num_scheduled_tokens)
        blocks.append(num_blocks(sched, "A"))
        outputs.append([(o.request_id, o.new_token_ids) for o in out])
    assert chunks == [{"A": 64}, {"A": 64}, {"A": 32}, {"A": 1}]
    assert blocks == [4, 8, 10, 11]  # a block per 16 tokens, allocated chunk by chunk; the 161st token opens block 11
    assert outputs == [[], [], [("A", [500])], [("A", [500])]]  # partial prefills emit nothing


def test_a_prefill_is_sent_as_new_once_then_as_cached_chunks():
    sched = make_scheduler(budget=64)
    add(sched, "A", range(1, 161))
    so0, _ = step(sched)
    so1, _ = step(sched)
    assert [r.req_id for r in so0.scheduled_new_reqs] == ["A"] and so0.scheduled_new_reqs[0].num_computed_tokens == 0
    assert so0.scheduled_cached_reqs.req_ids == []
    assert so1.scheduled_new_reqs == [] and so1.scheduled_cached_reqs.req_ids == ["A"]
    assert so1.scheduled_cached_reqs.num_computed_tokens == [64]  # before this step's chunk, as vLLM sends it
    assert so1.scheduled_cached_reqs.new_block_ids == [[4, 5, 6, 7]]


def test_a_chunked_prefill_shares_the_budget_with_running_decodes():
    sched = make_scheduler(budget=64)
    add(sched, "A", range(1, 11), max_tokens=50)
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"A": 10}
    add(sched, "B", range(100, 260))  # 160 tokens
    per_step = [step(sched)[0].num_scheduled_tokens for _ in range(4)]
    # The running decode is served first (1 token), the waiting prefill gets the rest of the budget.
    assert per_step == [{"A": 1, "B": 63}, {"A": 1, "B": 63}, {"A": 1, "B": 34}, {"A": 1, "B": 1}]
    assert sched.requests["A"].num_output_tokens == 5 and sched.requests["B"].num_output_tokens == 2


def test_long_prefill_token_threshold_caps_a_request_only_when_another_is_eligible():
    sched = make_scheduler(budget=64)
    sched.config.long_prefill_token_threshold = 16
    add(sched, "A", range(1, 41))
    assert step(sched)[0].num_scheduled_tokens == {"A": 40}  # alone: nobody to starve (vLLM 0.32 does the same)
    sched = make_scheduler(budget=64)
    sched.config.long_prefill_token_threshold = 16
    add(sched, "A", range(1, 41))
    add(sched, "B", range(100, 140))
    assert step(sched)[0].num_scheduled_tokens == {"A": 16, "B": 16}


# ---- preemption -----------------------------------------------------------------------------------------------
def _three_running(policy: str) -> Scheduler:
    """A (4 tokens), B and C (3 tokens each) fill a 3-block pool of 4-token blocks. After one sampled token A needs a
    second block, B and C still fit in their first."""
    sched = make_scheduler(budget=64, num_blocks=3, block_size=4, policy=policy)
    for i, (rid, n) in enumerate((("A", 4), ("B", 3), ("C", 3))):
        add(sched, rid, range(10 * (i + 1), 10 * (i + 1) + n), arrival=float(i))
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"A": 4, "B": 3, "C": 3} and free_blocks(sched) == 0
    return sched


def test_fcfs_preempts_the_youngest_running_request():
    sched = _three_running("fcfs")
    so, _ = step(sched)
    assert so.preempted_req_ids == {"C"}
    assert so.num_scheduled_tokens == {"A": 1, "B": 1}
    assert num_blocks(sched, "A") == 2 and num_blocks(sched, "C") == 0
    c = sched.requests["C"]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert sched.queue_snapshot() == (["C"], ["A", "B"])
    assert c.output_token_ids == [1]  # kept: on re-admission prompt and output are prefilled again
    assert (sched.stats.num_steps, sched.stats.num_preemptions, sched.stats.num_scheduled_tokens) == (2, 1, 12)


def test_priority_preempts_the_lowest_priority_request_not_the_last_one():
    # Running order A, B, C (C joins a step later); B has the largest priority value, C is last. A needs a third
    # block, none is free: B is the victim, not C (FCFS would take C).
    sched = make_scheduler(budget=64, num_blocks=4, block_size=4, policy="priority")
    add(sched, "A", range(1, 8), priority=0, arrival=0.0)  # 7 tokens: 2 blocks, the 9th token needs a third
    add(sched, "B", [11, 12, 13], priority=2, arrival=1.0)
    assert step(sched)[0].num_scheduled_tokens == {"A": 7, "B": 3}
    add(sched, "C", [21, 22, 23], priority=1, arrival=2.0)
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"A": 1, "B": 1, "C": 3} and free_blocks(sched) == 0
    assert sched.queue_snapshot() == ([], ["A", "B", "C"])
    so, _ = step(sched)
    assert so.preempted_req_ids == {"B"}
    assert so.num_scheduled_tokens == {"A": 1, "C": 1}
    assert sched.queue_snapshot() == (["B"], ["A", "C"]) and num_blocks(sched, "A") == 3


@pytest.mark.parametrize("release", ["0.32", "0.33"])
def test_priority_self_preemption_per_release(release):
    # A (the lowest priority) is admitted alone, so it is first in the running list; B and C join one step later.
    # When A needs a second block and none is free, A is its own victim. vLLM 0.32 then stops the running loop
    # ("Cannot schedule this request": nothing runs this step); vLLM 0.33 goes on, and B and C decode.
    sched = make_scheduler(budget=64, num_blocks=3, block_size=4, policy="priority", vllm_release=release)
    add(sched, "A", [1, 2, 3], priority=2, arrival=0.0)
    assert step(sched)[0].num_scheduled_tokens == {"A": 3}
    add(sched, "B", [11, 12, 13], priority=0, arrival=1.0)
    add(sched, "C", [21, 22, 23], priority=1, arrival=2.0)
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"A": 1, "B": 3, "C": 3} and free_blocks(sched) == 0
    assert sched.queue_snapshot() == ([], ["A", "B", "C"])
    so, _ = step(sched)
    assert so.preempted_req_ids == {"A"}
    assert so.num_scheduled_tokens == ({"B": 1, "C": 1} if release == "0.33" else {})
    assert sched.queue_snapshot() == (["A"], ["B", "C"]) and free_blocks(sched) == 1
    if release == "0.32":  # the next step runs them
        assert step(sched)[0].num_scheduled_tokens == {"B": 1, "C": 1}


@pytest.mark.parametrize("release, chunk_steps", [("0.32", [3, 4, 5]), ("0.33", [3, 5, 7])])
def test_prefill_schedule_interval_holds_prefill_steps_in_0_33(release, chunk_steps):
    # vLLM 0.33's local cadence (issue 25's measurement): with prefill_schedule_interval=2, a 160-token prompt beside
    # a decoding request is chunked in steps 3, 5, 7 (held steps carry the decode alone); 0.32 applies the interval
    # only under data parallelism, so its chunks run in steps 3, 4, 5.
    sched = make_scheduler(budget=64, vllm_release=release, prefill_schedule_interval=2)
    add(sched, "D", [1, 2, 3], max_tokens=20, arrival=0.0)
    steps = [step(sched)[0].num_scheduled_tokens]  # step 1: D's prefill
    steps.append(step(sched)[0].num_scheduled_tokens)  # step 2: D decodes
    add(sched, "P", range(100, 260), max_tokens=2, arrival=1.0)
    for _ in range(6):
        steps.append(step(sched)[0].num_scheduled_tokens)
    chunks = [k + 1 for k, s in enumerate(steps) if s.get("P", 0) > 1]
    assert chunks == chunk_steps
    assert [steps[k - 1]["P"] for k in chunks] == [63, 63, 34]  # the budget less D's decode token each time
    assert all(s.get("D") == 1 for s in steps[1:])  # the decoding request runs in every step, held or not


@pytest.mark.parametrize("watermark, first_step", [(0.0, {"A": 12, "B": 16}), (0.25, {"A": 12})])
def test_watermark_keeps_headroom_at_admission_while_others_run(watermark, first_step):
    # vLLM 0.32's SchedulerConfig.watermark: 0.25 of 8 blocks = 2 blocks an admission must leave free, but only
    # while another request is scheduled. A (3 blocks) is admitted with the pool idle; B (4 blocks) then needs
    # 4 + 2 of the 5 free blocks and waits; without the watermark both start in step 1.
    sched = make_scheduler(budget=64, num_blocks=8, block_size=4, watermark=watermark)
    add(sched, "A", range(1, 13), max_tokens=2, arrival=0.0)
    add(sched, "B", range(20, 36), max_tokens=2, arrival=1.0)
    so, _ = step(sched)
    assert so.num_scheduled_tokens == first_step
    if watermark:
        assert sched.kv_cache_manager.watermark_blocks == 2 and free_blocks(sched) == 5
        with pytest.raises(ValueError, match=r"watermark must be in \[0.0, 1.0\)"):
            make_scheduler(watermark=1.0)


def test_release_and_interval_are_checked():
    with pytest.raises(ValueError, match="vllm_release must be one of"):
        make_scheduler(vllm_release="0.31")
    with pytest.raises(ValueError, match="prefill_schedule_interval must be an int >= 1"):
        make_scheduler(prefill_schedule_interval=0)


def test_no_waiting_request_is_admitted_in_a_step_that_preempted():
    # Priority policy: D (priority 0, 2 tokens) waits ahead of the victim C. After C's preemption a block is free and
    # D would fit, but the waiting loop is skipped in a step that preempted (vLLM: ``if not preempted_reqs``).
    sched = make_scheduler(budget=64, num_blocks=5, block_size=4, policy="priority")
    add(sched, "A", range(1, 5), arrival=0.0)
    add(sched, "B", range(11, 15), arrival=1.0)
    add(sched, "C", range(21, 29), priority=1, arrival=2.0)
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"A": 4, "B": 4, "C": 8} and free_blocks(sched) == 1
    add(sched, "D", [31, 32], arrival=3.0)
    so, _ = step(sched)
    assert so.preempted_req_ids == {"C"} and so.num_scheduled_tokens == {"A": 1, "B": 1}
    assert free_blocks(sched) == 1 and [r.request_id for r in sched.waiting] == ["D", "C"]
    so, _ = step(sched)  # the next step admits D; C (9 tokens, 3 blocks) does not fit behind it
    assert so.preempted_req_ids == set() and so.num_scheduled_tokens == {"A": 1, "B": 1, "D": 2}
    assert [r.req_id for r in so.scheduled_new_reqs] == ["D"] and free_blocks(sched) == 0


# ---- stops ----------------------------------------------------------------------------------------------------
def _run_until_finished(sched: Scheduler, tokens: Dict[str, List[int]]) -> List[EngineCoreOutput]:
    outs: List[EngineCoreOutput] = []
    for k in range(20):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        mro = runner_output(sched, so, {rid: t[min(k, len(t) - 1)] for rid, t in tokens.items()})
        outs += sched.update_from_output(so, mro)
    return outs


def test_eos_finishes_with_stop_and_frees_the_blocks():
    sched = make_scheduler(num_blocks=10)
    add(sched, "A", range(1, 21), max_tokens=10, eos=99)
    outs = _run_until_finished(sched, {"A": [5, 6, 99, 7]})
    assert [(o.new_token_ids, o.finish_reason) for o in outs] == [([5], None), ([6], None), ([99], "stop")]
    assert outs[-1].stop_reason is None
    assert free_blocks(sched) == 10 and "A" not in sched.requests
    assert sched.schedule().finished_req_ids == {"A"}  # the runner is told to drop A's state


def test_a_stop_token_finishes_with_stop_and_names_the_token():
    sched = make_scheduler(num_blocks=10)
    add(sched, "A", range(1, 21), max_tokens=10, eos=99, stop_token_ids=[7])
    outs = _run_until_finished(sched, {"A": [5, 7, 99]})
    assert [(o.new_token_ids, o.finish_reason, o.stop_reason) for o in outs] == [([5], None, None), ([7], "stop", 7)]


def test_max_tokens_finishes_with_length():
    sched = make_scheduler(num_blocks=10)
    add(sched, "A", range(1, 21), max_tokens=3, eos=99)
    outs = _run_until_finished(sched, {"A": [5, 6, 8, 9]})
    assert [(o.new_token_ids, o.finish_reason) for o in outs] == [([5], None), ([6], None), ([8], "length")]
    assert free_blocks(sched) == 10


# ---- aborts ---------------------------------------------------------------------------------------------------
def test_a_request_aborted_between_schedule_and_update_gets_no_output_and_its_blocks_back():
    sched = make_scheduler(num_blocks=10)
    add(sched, "A", range(1, 21))
    add(sched, "B", range(101, 121), arrival=1.0)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"A": 20, "B": 20} and free_blocks(sched) == 6
    done = sched.finish_requests(["A"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in done] == ["A"] and done[0].get_finished_reason() == "abort"
    assert free_blocks(sched) == 8
    outs = sched.update_from_output(so, runner_output_for(so, {"A": 5, "B": 6}))
    assert [(o.request_id, o.new_token_ids) for o in outs] == [("B", [6])]
    assert sched.queue_snapshot() == ([], ["B"])
    so = sched.schedule()
    assert so.finished_req_ids == {"A"} and so.num_scheduled_tokens == {"B": 1}
    assert sched.finish_requests(["A", "nope"], RequestStatus.FINISHED_ABORTED) == []  # unknown or finished: ignored


def runner_output_for(so: SchedulerOutput, tokens: Dict[str, int]) -> ModelRunnerOutput:
    """A runner output that holds a token for every scheduled request (as if each had finished its prefill)."""
    req_ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, [[tokens[r]] for r in req_ids])


def test_aborting_a_waiting_request_removes_it_from_the_queue():
    sched = make_scheduler(budget=16, num_blocks=10)
    add(sched, "A", range(1, 17))
    add(sched, "B", range(101, 117), arrival=1.0)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"A": 16} and sched.queue_snapshot() == (["B"], ["A"])
    sched.finish_requests(["B"], RequestStatus.FINISHED_ABORTED)
    assert sched.queue_snapshot() == ([], ["A"]) and free_blocks(sched) == 9


# ---- prefix caching -------------------------------------------------------------------------------------------
def test_a_prefix_cache_hit_skips_the_cached_full_blocks():
    sched = make_scheduler(num_blocks=10)
    a = add(sched, "A", range(1, 33), max_tokens=1)  # 2 full blocks
    _run_until_finished(sched, {"A": [7]})
    a_blocks = [b.block_id for b in sched.kv_cache_manager.block_pool.blocks if b.block_hash in a.block_hashes[:2]]
    b = add(sched, "B", list(range(1, 33)) + [50, 51, 52, 53, 54], arrival=1.0)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"B": 5}
    new = so.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 32 and new.block_ids[:2] == sorted(a_blocks) and len(new.block_ids) == 3
    assert b.num_cached_tokens == 32
    stats = sched.kv_cache_manager.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 32 + 37, 32)


def test_a_fully_cached_prompt_still_computes_its_last_block():
    # The last token's logits are needed, so at most (num_tokens - 1) // block_size blocks are hits.
    sched = make_scheduler(num_blocks=10)
    add(sched, "A", range(1, 33), max_tokens=1)
    _run_until_finished(sched, {"A": [7]})
    add(sched, "B", range(1, 33), arrival=1.0)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"B": 16} and so.scheduled_new_reqs[0].num_computed_tokens == 16


# ---- the KV connector's scheduler side ------------------------------------------------------------------------
class RecordingConnector(KVConnectorBase):
    """Records the scheduler-side calls; offers ``external[rid]`` tokens beyond the local hit (sync loads)."""

    def __init__(self, sched_ref: List[Scheduler], external: Optional[Dict[str, int]] = None) -> None:
        super().__init__()
        self.calls: List[tuple] = []
        self.sched_ref = sched_ref
        self.external = external or {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.calls.append(("match", request.request_id, num_computed_tokens))
        return self.external.get(request.request_id, 0), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.calls.append(("alloc", request.request_id, len(blocks), num_external_tokens))

    def build_connector_meta(self, scheduler_output):
        self.calls.append(("meta", sorted(scheduler_output.num_scheduled_tokens.items())))
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids):
        # Called before the blocks are freed: the request still holds them here.
        held = len(self.sched_ref[0].kv_cache_manager.get_block_ids(request.request_id))
        self.calls.append(("finished", request.request_id, list(block_ids), held))
        return False, None

    def start_load_kv(self, kv_caches):
        raise AssertionError("worker side: never called by the scheduler")


def test_connector_hooks_are_called_in_vllm_order():
    ref: List[Scheduler] = []
    conn = RecordingConnector(ref, external={"B": 16})
    sched = make_scheduler(budget=64, num_blocks=4, block_size=16, connector=conn)
    ref.append(sched)
    add(sched, "A", range(1, 21), max_tokens=1)
    add(sched, "B", range(101, 141), arrival=1.0)  # 40 tokens, 3 blocks: does not fit beside A's 2
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"A": 20}
    assert conn.calls == [
        ("match", "A", 0), ("alloc", "A", 2, 0),   # A: asked, allocated
        ("match", "B", 0),                         # B: asked, no blocks, so no update_state_after_alloc
        ("meta", [("A", 20)]),                     # once per schedule()
    ]
    conn.calls.clear()
    sched.update_from_output(so, runner_output(sched, so))  # A reaches max_tokens=1
    assert conn.calls == [("finished", "A", [0, 1], 2)]   # before its blocks are freed
    conn.calls.clear()
    so = sched.schedule()
    # B's 16 external tokens are computed already: 24 are scheduled; the connector learns of 16 external tokens.
    assert so.num_scheduled_tokens == {"B": 24} and so.scheduled_new_reqs[0].num_computed_tokens == 16
    assert conn.calls == [("match", "B", 0), ("alloc", "B", 3, 16), ("meta", [("B", 24)])]


def test_build_connector_meta_runs_even_when_nothing_is_scheduled():
    ref: List[Scheduler] = []
    conn = RecordingConnector(ref)
    sched = make_scheduler(connector=conn)
    ref.append(sched)
    so = sched.schedule()
    assert so.total_num_scheduled_tokens == 0 and conn.calls == [("meta", [])]
