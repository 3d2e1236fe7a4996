"""The engine's layers: EngineArgs -> VllmConfig, InputProcessor, EngineCore.step, step observers."""

import dataclasses

import pytest

from minivllm import LLMEngine, SamplingParams
from minivllm.core.sched.scheduler import Scheduler
from minivllm.engine.arg_utils import EngineArgs


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_engine_args_resolve_every_default_once():
    config = EngineArgs("tiny", block_size=4, num_gpu_blocks=10, max_num_batched_tokens=8).create_engine_config()
    assert (config.cache_config.num_gpu_blocks, config.scheduler_config.max_model_len) == (10, 40)  # capped: pool
    assert config.scheduler_config.max_num_seqs == 8  # min(256, max_num_batched_tokens)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 1  # type: ignore[misc]
    # LLMEngine takes exactly EngineArgs' keywords; a typo is refused before anything is built
    with pytest.raises(TypeError, match="num_gpu_block"):
        LLMEngine("tiny", num_gpu_block=10)
    with pytest.raises(ValueError, match=r"max_model_len \(64\)"):
        EngineArgs("tiny", block_size=4, num_gpu_blocks=10, max_model_len=64).create_engine_config()


def test_rejected_request_changes_nothing():
    eng = LLMEngine("tiny", block_size=4, num_gpu_blocks=8, max_model_len=32)
    eng.add_request("a", [1, 2, 3], greedy(2))
    with pytest.raises(ValueError, match="needs 9 KV blocks"):
        eng.add_request("b", list(range(1, 34)), greedy(1))
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("a", [4], greedy(1))
    assert list(eng.output_processor.request_states) == ["a"] and list(eng.scheduler.requests) == ["a"]


class Watcher:
    """A step observer that records what each hook saw."""

    def __init__(self):
        self.events = []

    def on_schedule(self, engine_core, scheduler_output):
        # before the forward pass: the scheduled tokens are not sampled yet
        reqs = engine_core.scheduler.requests
        self.events.append(("schedule", dict(scheduler_output.num_scheduled_tokens),
                            {r: reqs[r].num_output_tokens for r in scheduler_output.num_scheduled_tokens}))

    def on_step_end(self, engine_core, engine_core_outputs, request_outputs):
        self.events.append(("end", [(o.request_id, len(o.new_token_ids), o.finished) for o in request_outputs],
                            engine_core.kv_cache_manager.num_free_blocks))


def test_step_observers_see_each_step_before_and_after_the_forward_pass():
    eng = LLMEngine("tiny", block_size=4, num_gpu_blocks=8, max_num_batched_tokens=4, enable_prefix_caching=False)
    watcher = Watcher()
    eng.add_step_observer(watcher)
    eng.add_request("a", [1, 2, 3, 4, 5, 6], greedy(2))
    eng.run_to_completion()
    assert watcher.events == [
        ("schedule", {"a": 4}, {"a": 0}), ("end", [], 7),             # first prompt chunk: nothing sampled
        ("schedule", {"a": 2}, {"a": 0}), ("end", [("a", 1, False)], 6),
        ("schedule", {"a": 1}, {"a": 1}), ("end", [("a", 1, True)], 8),  # finished: its blocks are back
    ]


def test_scheduler_stats_come_with_each_step_when_asked_for():
    eng = LLMEngine("tiny", block_size=4, num_gpu_blocks=8, max_num_batched_tokens=8, max_num_seqs=1)
    eng.add_request("a", [1, 2, 3], greedy(4))  # runs alone (max_num_seqs=1) while "b" waits
    eng.add_request("b", [4, 5, 6], greedy(2))
    assert eng.engine_core.step().scheduler_stats is None  # off unless a front end asks (vLLM's log_stats)
    eng.engine_core.scheduler.log_stats = True
    eng.step()
    s = eng.scheduler_stats
    assert (s.num_running_reqs, s.num_waiting_reqs, s.step_counter) == (1, 1, 2)
    assert s.kv_cache_usage == eng.kv_cache_manager.usage > 0
    eng.abort_request(["a", "b"])
    after = eng.engine_core.scheduler.make_stats()
    assert (after.num_running_reqs, after.num_waiting_reqs, after.kv_cache_usage) == (0, 0, 0.0)


class CountingScheduler(Scheduler):
    """A learner's scheduler: vLLM's seam (scheduler_cls) takes a Scheduler subclass."""

    calls = 0

    def schedule(self):
        CountingScheduler.calls += 1
        return super().schedule()


def test_scheduler_cls_by_class_or_dotted_name():
    from minivllm.core.sched.async_scheduler import AsyncScheduler

    for cls in (CountingScheduler, f"{__name__}.CountingScheduler"):
        CountingScheduler.calls = 0
        eng = LLMEngine("tiny", num_gpu_blocks=8, scheduler_cls=cls)
        assert type(eng.scheduler) is CountingScheduler
        eng.add_request("a", [1, 2, 3], greedy(3))
        eng.run_to_completion()
        assert CountingScheduler.calls == 3
    assert type(LLMEngine("tiny", num_gpu_blocks=8, async_scheduling=True).scheduler) is AsyncScheduler
    with pytest.raises(ValueError, match="scheduler_cls 'no.such.Scheduler' cannot be imported"):
        EngineArgs("tiny", scheduler_cls="no.such.Scheduler").create_engine_config()
    with pytest.raises(ValueError, match="subclass of minivllm's Scheduler"):
        EngineArgs("tiny", scheduler_cls=dict).create_engine_config()
    with pytest.raises(ValueError, match="must derive from AsyncScheduler when async_scheduling=True"):
        EngineArgs("tiny", scheduler_cls=CountingScheduler, async_scheduling=True).create_engine_config()
