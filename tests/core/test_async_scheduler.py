"""Async scheduling, Model Runner V2's scheduler side and the admission switch, with the scheduler alone and
hand-made model-runner outputs (as ``tests/core/test_scheduler.py``; vLLM: ``tests/v1/core/test_async_scheduler.py``).

Async scheduling keeps two steps in flight: step N+1 is scheduled before step N's output is processed. The fake
runner decides at schedule time whether a step samples (the request's ``is_prefill_chunk`` right after
``schedule()``, as vLLM's runner does) and returns the request's next scripted token.

Every expected schedule below was also produced by vLLM 0.32's own ``Scheduler`` / ``AsyncScheduler`` driven the
same way (built as in ``minivllm/bench/vllm_check/vllm_recorder.py``, without a connector unless the test has one).
"""

from __future__ import annotations

from collections import deque
from typing import Deque, Dict, List, Optional, Sequence, Tuple

import pytest

from minivllm.config import SchedulerConfig
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.kv_cache_utils import get_request_block_hasher
from minivllm.core.sched.async_scheduler import AsyncScheduler
from minivllm.core.sched.output import SchedulerOutput
from minivllm.core.sched.scheduler import Scheduler
from minivllm.distributed.kv_transfer.base import KVConnectorBase, KVConnectorMetadata
from minivllm.engine import EngineCoreOutput
from minivllm.outputs import ModelRunnerOutput
from minivllm.request import Request, RequestStatus
from minivllm.sampling_params import SamplingParams

EOS = 2


def make_scheduler(async_scheduling: bool = False, v2: bool = False, budget: int = 64, num_blocks: int = 16,
                   block_size: int = 16, max_model_len: int = 512, reserve_full_isl: bool = True,
                   connector: Optional[KVConnectorBase] = None) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16, max_model_len=max_model_len,
                          async_scheduling=async_scheduling, use_v2_model_runner=v2,
                          scheduler_reserve_full_isl=reserve_full_isl)
    cfg.verify()
    cls = AsyncScheduler if async_scheduling else Scheduler
    return cls(cfg, KVCacheManager(num_blocks, block_size, max_model_len, True), connector)


def prompt(n: int, base: int) -> List[int]:
    return [base + (i * 7) % 97 for i in range(n)]


class Driver:
    """Steps a scheduler with scripted tokens: ``depth`` 1 is synchronous, 2 keeps two steps in flight."""

    def __init__(self, sched: Scheduler, depth: int) -> None:
        self.sched, self.depth = sched, depth
        self.scripts: Dict[str, List[int]] = {}
        self.num_sampled: Dict[str, int] = {}
        self.inflight: Deque[Tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        self.schedules: List[Dict[str, int]] = []
        self.outputs: List[EngineCoreOutput] = []
        self.tokens: Dict[str, List[int]] = {}

    def add(self, rid: str, prompt_ids: Sequence[int], script: Sequence[int], max_tokens: int,
            ignore_eos: bool = True, stop_token_ids=None) -> Request:
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=stop_token_ids)
        req = Request(rid, list(prompt_ids), sp, eos_token_id=EOS,
                      block_hasher=get_request_block_hasher(self.sched.block_size))
        self.sched.add_request(req)
        self.scripts[rid], self.num_sampled[rid], self.tokens[rid] = list(script), 0, []
        return req

    def schedule(self) -> SchedulerOutput:
        so = self.sched.schedule()
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            if self.sched.requests[rid].is_prefill_chunk:
                sampled.append([])
            else:
                k = self.num_sampled[rid]
                sampled.append([self.scripts[rid][k] if k < len(self.scripts[rid]) else 9])
                self.num_sampled[rid] += 1
        self.inflight.append((so, ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, sampled)))
        self.schedules.append(dict(so.num_scheduled_tokens))
        return so

    def process(self) -> List[EngineCoreOutput]:
        so, mro = self.inflight.popleft()
        outs = self.sched.update_from_output(so, mro)
        self.outputs += outs
        for o in outs:
            self.tokens[o.request_id] += o.new_token_ids
        return outs

    def run(self, max_steps: int = 60) -> "Driver":
        while True:
            while len(self.inflight) < self.depth and self.sched.has_unfinished_requests():
                self.schedule()
                assert len(self.schedules) < max_steps
            if not self.inflight:
                return self
            self.process()

    def finish_reasons(self) -> Dict[str, str]:
        return {o.request_id: o.finish_reason for o in self.outputs if o.finish_reason is not None}


def free_blocks(sched: Scheduler) -> int:
    return sched.kv_cache_manager.num_free_blocks


# ---- output placeholders ------------------------------------------------------------------------------------
def test_async_schedules_the_next_decode_before_the_previous_output_is_processed():
    sched = make_scheduler(async_scheduling=True)
    d = Driver(sched, depth=2)
    a = d.add("A", prompt(20, 100), [30, 31, 32], max_tokens=3)
    assert d.schedule().num_scheduled_tokens == {"A": 20}
    assert (a.num_computed_tokens, a.num_output_placeholders, a.num_tokens) == (20, 1, 20)
    so1 = d.schedule()  # step 0's token is not known yet: step 1 computes its position all the same
    assert so1.num_scheduled_tokens == {"A": 1} and so1.scheduled_cached_reqs.num_computed_tokens == [20]
    assert (a.num_computed_tokens, a.num_output_placeholders, a.num_tokens) == (21, 2, 20)
    assert [(o.request_id, o.new_token_ids) for o in d.process()] == [("A", [30])]
    assert (a.num_computed_tokens, a.num_output_placeholders, a.num_tokens) == (21, 1, 21)
    d.run()
    assert d.schedules == [{"A": 20}, {"A": 1}, {"A": 1}, {}]  # the 4th step: max_tokens is certain, A skipped
    assert d.tokens == {"A": [30, 31, 32]} and d.finish_reasons() == {"A": "length"}
    assert free_blocks(sched) == 16


def _stops(depth: int) -> Driver:
    sched = make_scheduler(async_scheduling=depth == 2)
    d = Driver(sched, depth)
    d.add("A", prompt(20, 100), [30, 31, 7, 33, 34, 35], max_tokens=6, ignore_eos=False, stop_token_ids=[7])
    d.add("B", prompt(20, 200), [40, EOS, 42, 43, 44, 45], max_tokens=6, ignore_eos=False)
    d.add("C", prompt(20, 300), [50, 51, 52], max_tokens=3)
    return d


def test_async_a_request_stopped_by_eos_or_a_stop_token_is_scheduled_once_more_one_at_max_tokens_is_not():
    sync, asyn = _stops(1), _stops(2)
    so = []
    orig = asyn.sched.schedule
    asyn.sched.schedule = lambda: so.append(orig()) or so[-1]  # type: ignore[method-assign]
    asyn.run()
    sync.run()
    assert sync.schedules == [{"A": 20, "B": 20, "C": 20}, {"A": 1, "B": 1, "C": 1}, {"A": 1, "C": 1}]
    # B samples EOS in step 1 and A its stop token in step 2: each is in the next step's schedule all the same.
    # C's third token (max_tokens) comes from step 2; step 3 leaves it out (placeholder check).
    assert asyn.schedules == [{"A": 20, "B": 20, "C": 20}, {"A": 1, "B": 1, "C": 1}, {"A": 1, "B": 1, "C": 1},
                              {"A": 1}]
    assert [s.finished_req_ids for s in so] == [set(), set(), set(), {"B"}]
    assert [r.request_id for r in asyn.sched.running] == [] and free_blocks(asyn.sched) == 16
    # The extra steps' tokens (B's 42, A's 33) are discarded: the outputs equal the synchronous run's.
    assert asyn.tokens == sync.tokens == {"A": [30, 31, 7], "B": [40, EOS], "C": [50, 51, 52]}
    assert asyn.finish_reasons() == sync.finish_reasons() == {"A": "stop", "B": "stop", "C": "length"}
    assert [(o.request_id, o.stop_reason) for o in asyn.outputs if o.finish_reason] == [("B", None), ("A", 7), ("C", None)]


def test_async_a_request_at_max_model_len_is_not_scheduled_again():
    def run(depth: int) -> Driver:
        d = Driver(make_scheduler(async_scheduling=depth == 2, max_model_len=24), depth)
        d.add("A", prompt(20, 100), list(range(30, 40)), max_tokens=10)
        return d.run()

    sync, asyn = run(1), run(2)
    assert sync.schedules == [{"A": 20}, {"A": 1}, {"A": 1}, {"A": 1}]
    # After step 3, positions up to 23 are computed and 24 tokens are certain: no position is left.
    assert asyn.schedules == [{"A": 20}, {"A": 1}, {"A": 1}, {"A": 1}, {}]
    assert asyn.tokens == sync.tokens == {"A": [30, 31, 32, 33]}
    assert asyn.finish_reasons() == {"A": "length"}


def test_async_chunks_and_tokens_equal_the_synchronous_run():
    def run(depth: int) -> Driver:
        d = Driver(make_scheduler(async_scheduling=depth == 2), depth)
        d.add("A", prompt(10, 100), list(range(30, 38)), max_tokens=8)
        d.schedule()
        if depth == 1:
            d.process()
        d.add("B", prompt(100, 200), [40, 41, 42], max_tokens=3)  # before step 1 in both runs
        return d.run()

    sync, asyn = run(1), run(2)
    # The same chunks (the running decode first, B's prefill gets the rest), the same tokens; async adds the
    # empty last step (A's last token is certain, nothing else runs).
    assert sync.schedules == [{"A": 10}, {"A": 1, "B": 63}, {"A": 1, "B": 37}, {"A": 1, "B": 1}, {"A": 1, "B": 1},
                              {"A": 1}, {"A": 1}, {"A": 1}]
    assert asyn.schedules == sync.schedules + [{}]
    assert asyn.tokens == sync.tokens == {"A": list(range(30, 38)), "B": [40, 41, 42]}


# ---- preemption with a step in flight -------------------------------------------------------------------------
def _preempt(depth: int, v2: bool = False, connector: Optional[KVConnectorBase] = None) -> Tuple[Driver, List]:
    """A and B (30 tokens each, 2 blocks of 16) fill 4 of 5 blocks; A's 33rd token needs a third block."""
    sched = make_scheduler(async_scheduling=depth == 2, v2=v2, budget=128, num_blocks=5, connector=connector)
    d = Driver(sched, depth)
    d.add("A", prompt(30, 100), [30, 31, 32, 33, 34, 35], max_tokens=6)
    d.add("B", prompt(30, 200), [40, 41, 42, 43, 44, 45], max_tokens=6)
    so: List[SchedulerOutput] = []
    orig = sched.schedule
    sched.schedule = lambda: so.append(orig()) or so[-1]  # type: ignore[method-assign]
    return d, so


def test_async_a_preempted_request_gets_its_stale_output_and_resumes_only_after_it():
    d, so = _preempt(2)
    b = d.sched.requests["B"]
    d.schedule()
    d.schedule()
    d.process()  # step 0
    d.schedule()
    d.process()  # step 1: B's steps 0 and 1 are done, step 2 (B's third token) is in flight
    assert (b.num_computed_tokens, b.num_output_placeholders, b.num_in_flight_tokens) == (32, 1, 1)
    assert d.schedule().num_scheduled_tokens == {"A": 1}  # step 3: A needs a third block, B is preempted
    assert so[3].preempted_req_ids == {"B"} and b.status == RequestStatus.PREEMPTED
    assert (b.num_computed_tokens, b.num_output_placeholders, b.num_stale_output_tokens) == (0, 0, 1)
    assert [(o.request_id, o.new_token_ids) for o in d.process()] == [("A", [32]), ("B", [42])]  # delivered
    assert b.output_token_ids == [40, 41, 42] and b.num_stale_output_tokens == 0
    d.run()
    assert d.schedules == [{"A": 30, "B": 30}, {"A": 1, "B": 1}, {"A": 1, "B": 1}, {"A": 1}, {"A": 1}, {"A": 1}, {},
                           {"B": 17}, {"B": 1}, {"B": 1}, {}]
    # B resumes with prompt + 3 outputs (33 tokens), its first block a prefix-cache hit.
    assert so[7].scheduled_cached_reqs.resumed_req_ids == {"B"} and so[7].scheduled_cached_reqs.num_computed_tokens == [16]
    assert d.tokens == {"A": [30, 31, 32, 33, 34, 35], "B": [40, 41, 42, 43, 44, 45]}
    sync, _ = _preempt(1)
    sync.run()
    assert sync.tokens == d.tokens


class _Connector(KVConnectorBase):
    """A connector that loads nothing (both roles, as every minivllm connector): only its presence matters."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def start_load_kv(self, kv_caches):
        pass


def test_async_with_a_connector_defers_block_frees_so_a_request_in_flight_is_not_a_victim_yet():
    d, so = _preempt(2, connector=_Connector())
    d.run()
    # Step 3: B's step 2 is in flight, so preempting it would free nothing yet: vLLM stops the running loop
    # (A gets the last free block, B waits a step). Step 4 preempts B once step 2 is processed.
    assert d.schedules == [{"A": 30, "B": 30}, {"A": 1, "B": 1}, {"A": 1, "B": 1}, {"A": 1}, {"A": 1}, {"A": 1}, {},
                           {"B": 1}, {"B": 1}, {"B": 1}, {}]
    assert [s.preempted_req_ids for s in so[2:5]] == [set(), set(), {"B"}]
    assert so[7].scheduled_cached_reqs.num_computed_tokens == [32]  # both full blocks of B were still cached
    assert d.tokens == {"A": [30, 31, 32, 33, 34, 35], "B": [40, 41, 42, 43, 44, 45]}
    assert free_blocks(d.sched) == 5 and not d.sched.deferred_frees


def test_a_finished_requests_blocks_come_back_when_its_last_step_is_processed():
    sched = make_scheduler(async_scheduling=True, connector=_Connector())
    d = Driver(sched, 2)
    d.add("A", prompt(20, 100), [30, EOS, 99], max_tokens=5, ignore_eos=False)
    d.schedule()
    d.schedule()
    d.process()
    d.schedule()  # step 2 (A decodes again) is scheduled before step 1's EOS is processed
    d.process()  # A finishes; step 2 may still write its blocks
    assert "A" not in sched.requests and free_blocks(sched) == 14 and len(sched.deferred_frees) == 1
    d.process()
    assert free_blocks(sched) == 16 and not sched.deferred_frees


# ---- Model Runner V2: a resumed request is sent as new -------------------------------------------------------
def test_v2_sends_a_resumed_request_as_new_with_all_its_tokens_v1_as_resumed():
    v1, so1 = _preempt(1)
    v2, so2 = _preempt(1, v2=True)
    v1.run()
    v2.run()
    assert v1.schedules == v2.schedules == [{"A": 30, "B": 30}, {"A": 1, "B": 1}, {"A": 1, "B": 1}, {"A": 1},
                                            {"A": 1}, {"A": 1}, {"B": 1}, {"B": 1}, {"B": 1}]
    assert so1[3].preempted_req_ids == so2[3].preempted_req_ids == {"B"}
    all_b = prompt(30, 200) + [40, 41, 42]
    c1 = so1[6].scheduled_cached_reqs
    assert so1[6].scheduled_new_reqs == [] and c1.req_ids == ["B"] and c1.resumed_req_ids == {"B"}
    assert c1.all_token_ids == {"B": all_b} and c1.num_computed_tokens == [32]
    new = so2[6].scheduled_new_reqs
    assert [n.req_id for n in new] == ["B"] and so2[6].scheduled_cached_reqs.req_ids == []
    assert new[0].prefill_token_ids == all_b and new[0].prompt_token_ids == prompt(30, 200)
    assert new[0].num_computed_tokens == 32 and len(new[0].block_ids) == 3
    assert v1.tokens == v2.tokens


# ---- admission: scheduler_reserve_full_isl ----------------------------------------------------------------------
def _admission(reserve_full_isl: bool) -> Tuple[Driver, List[SchedulerOutput]]:
    """8 blocks of 16, budget 32. A (40 tokens, 3 blocks) runs; B (96 tokens, 6 blocks) arrives with 5 free."""
    sched = make_scheduler(budget=32, num_blocks=8, reserve_full_isl=reserve_full_isl)
    d = Driver(sched, 1)
    d.add("A", prompt(40, 100), list(range(30, 38)), max_tokens=8)
    so: List[SchedulerOutput] = [d.schedule()]
    d.process()
    d.add("B", prompt(96, 200), [40, 41], max_tokens=2)
    orig = sched.schedule
    sched.schedule = lambda: so.append(orig()) or so[-1]  # type: ignore[method-assign]
    return d.run(), so


def test_reserve_full_isl_admits_a_long_prompt_only_when_all_its_blocks_are_free():
    d, so = _admission(True)
    assert d.schedules == [{"A": 32}, {"A": 8}] + [{"A": 1}] * 7 + [{"B": 32}, {"B": 32}, {"B": 32}, {"B": 1}]
    assert [len(s.preempted_req_ids) for s in so] == [0] * 13


def test_without_reserve_full_isl_the_first_chunk_is_enough_and_the_prompt_thrashes():
    d, so = _admission(False)
    # B starts with 24 tokens beside A, takes a second chunk, then cannot get blocks for its third and preempts
    # itself; resumed on its cached blocks, it preempts itself again, and finishes after A (vLLM before PR #37307).
    assert d.schedules == [{"A": 32}, {"A": 8, "B": 24}, {"A": 1, "B": 31}, {"A": 1}, {"A": 1, "B": 31}, {"A": 1},
                           {"A": 1}, {"A": 1}, {"A": 1}, {"B": 32}, {"B": 1}]
    assert [s.preempted_req_ids for s in so if s.preempted_req_ids] == [{"B"}, {"B"}]
    resumed = [(s.scheduled_cached_reqs, s.scheduled_cached_reqs.req_ids.index("B")) for s in so
               if s.scheduled_cached_reqs.resumed_req_ids]
    assert [c.num_computed_tokens[i] for c, i in resumed] == [48, 64]  # prefix-cache hits on its own chunks
    assert d.tokens["B"] == [40, 41]


def test_the_switches_are_validated():
    with pytest.raises(ValueError, match="async_scheduling must be True or False"):
        SchedulerConfig(async_scheduling=1).verify()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="scheduler_reserve_full_isl"):
        SchedulerConfig(scheduler_reserve_full_isl="yes").verify()  # type: ignore[arg-type]


def test_async_reset_prefix_cache_drops_the_output_in_flight_of_a_request_resumed_in_the_same_step():
    # reset_prefix_cache(reset_running_requests=True) preempts A while step 1 is in flight; the next step resumes
    # A at once (all 21 tokens recomputed: the cache was reset). Step 1's token (31) is dropped, not delivered:
    # step 2 samples that position again (vLLM: drop_stale_output=True).
    sched = make_scheduler(async_scheduling=True)
    d = Driver(sched, 2)
    a = d.add("A", prompt(20, 100), [30, 31, 32, 33, 34], max_tokens=4)
    d.schedule()
    d.schedule()
    d.process()
    assert sched.reset_prefix_cache(reset_running_requests=True)
    assert (a.status, a.num_stale_output_tokens, a.drop_stale_output) == (RequestStatus.PREEMPTED, 1, True)
    so2 = d.schedule()
    assert so2.num_scheduled_tokens == {"A": 21} and so2.preempted_req_ids == {"A"}
    assert so2.scheduled_cached_reqs.resumed_req_ids == {"A"} and so2.scheduled_cached_reqs.num_computed_tokens == [0]
    assert d.process() == [] and a.output_token_ids == [30]
    d.run()
    assert d.schedules == [{"A": 20}, {"A": 1}, {"A": 21}, {"A": 1}, {"A": 1}, {}]
    assert d.tokens == {"A": [30, 32, 33, 34]} and d.finish_reasons() == {"A": "length"}


def test_reset_prefix_cache_refuses_while_a_deferred_free_is_pending():
    sched = make_scheduler(async_scheduling=True, connector=_Connector())
    d = Driver(sched, 2)
    d.add("A", prompt(20, 100), [30, 31, 32], max_tokens=3)
    d.schedule()
    d.schedule()
    with pytest.raises(RuntimeError, match="still written by a step in flight"):
        sched.reset_prefix_cache(reset_running_requests=True)
    assert [r.request_id for r in sched.running] == ["A"] and sched.requests["A"].status == RequestStatus.RUNNING
