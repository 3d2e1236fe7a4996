"""Both model runners and async scheduling through the engine (``model_runner``, ``async_scheduling``,
``scheduler_reserve_full_isl``), on the random-weight tiny model: greedy tokens identical in every mode; under each
runner, seeded tokens independent of chunking, preemption and async scheduling; the V2 runner's own semantics."""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest

from minivllm import LLMEngine, SamplingParams
from minivllm.core.sched.async_scheduler import AsyncScheduler
from minivllm.engine.arg_utils import EngineArgs
from minivllm.worker.model_runner import ModelRunner
from minivllm.worker.v2.model_runner import ModelRunnerV2

PROMPTS = {f"r{i}": [(7 * j + 13 * i) % 500 + 3 for j in range(40 + 9 * i)] for i in range(3)}
MODES = [("v1", False), ("v1", True), ("v2", False), ("v2", True)]
# (budget, blocks of 16): no chunking, chunks of at most 16 tokens, a pool too small for all three (preemption)
LAYOUTS = [(512, 64), (16, 64), (512, 7)]


def run(model_runner: str, async_scheduling: bool, budget: int, blocks: int, params, prompts=PROMPTS,
        **kw) -> Tuple[Dict[str, List[int]], int, LLMEngine]:
    eng = LLMEngine("tiny", model_runner=model_runner, async_scheduling=async_scheduling, block_size=16,
                    num_gpu_blocks=blocks, max_num_batched_tokens=budget, max_model_len=blocks * 16, **kw)
    for rid, p in prompts.items():
        eng.add_request(rid, p, params(rid))
    final = eng.run_to_completion(max_steps=500)
    return {rid: list(o.outputs[0].token_ids) for rid, o in final.items()}, eng.num_preemptions, eng


def greedy(rid):
    return SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def seeded(rid):
    return SamplingParams(temperature=1.0, top_p=0.9, seed=100 + int(rid[1:]), max_tokens=12, ignore_eos=True)


def test_the_modes_build_the_matching_scheduler_and_runner():
    for runner, async_ in MODES:
        eng = LLMEngine("tiny", model_runner=runner, async_scheduling=async_, num_gpu_blocks=8)
        assert isinstance(eng.scheduler, AsyncScheduler) == async_
        assert type(eng.model_runner) is (ModelRunnerV2 if runner == "v2" else ModelRunner)
        assert eng.scheduler.use_v2_model_runner == (runner == "v2")
    cfg = EngineArgs("tiny", num_gpu_blocks=8).create_engine_config().scheduler_config
    assert (cfg.use_v2_model_runner, cfg.async_scheduling, cfg.scheduler_reserve_full_isl) == (False, False, True)
    with pytest.raises(ValueError, match="model_runner must be 'v1' or 'v2'"):
        EngineArgs("tiny", model_runner="v3").create_engine_config()
    with pytest.raises(ValueError, match="async_scheduling must be True or False"):
        EngineArgs("tiny", async_scheduling="yes").create_engine_config()


def test_vllm_use_v2_model_runner_chooses_when_model_runner_is_not_given(monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert EngineArgs("tiny", num_gpu_blocks=8).create_engine_config().scheduler_config.use_v2_model_runner
    assert not EngineArgs("tiny", num_gpu_blocks=8, model_runner="v1").create_engine_config() \
        .scheduler_config.use_v2_model_runner
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert not EngineArgs("tiny", num_gpu_blocks=8).create_engine_config().scheduler_config.use_v2_model_runner
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "yes")
    with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER must be 0 or 1"):
        EngineArgs("tiny", num_gpu_blocks=8).create_engine_config()


def test_greedy_tokens_are_identical_in_every_mode_and_layout():
    base, _, _ = run("v1", False, *LAYOUTS[0], greedy)
    assert all(len(t) == 12 for t in base.values())
    for runner, async_ in MODES:
        for budget, blocks in LAYOUTS:
            toks, npre, _ = run(runner, async_, budget, blocks, greedy)
            assert toks == base, (runner, async_, budget, blocks)
            assert (npre > 0) == (blocks == 7), (runner, async_, budget, blocks, npre)


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_seeded_tokens_do_not_depend_on_chunking_preemption_or_async(runner):
    base, _, _ = run(runner, False, *LAYOUTS[0], seeded)
    for async_ in (False, True):
        for budget, blocks in LAYOUTS:
            assert run(runner, async_, budget, blocks, seeded)[0] == base, (async_, budget, blocks)


def test_the_runners_draw_differently_but_each_is_reproducible():
    v1, _, _ = run("v1", False, *LAYOUTS[0], seeded)
    v2, _, _ = run("v2", False, *LAYOUTS[0], seeded)
    assert v1 != v2  # a generator stream versus Gumbel noise hashed from (seed, position)

    def unseeded(rid):
        return SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)

    same = {"a": PROMPTS["r0"], "b": PROMPTS["r0"]}
    t1, _, e1 = run("v2", False, 512, 64, unseeded, prompts=same, seed=3)
    t2, _, _ = run("v2", False, 512, 64, unseeded, prompts=same, seed=3)
    assert t1 == t2 and t1["a"] != t1["b"]  # each unseeded request has its own seed, drawn from the engine's


def test_v2_samples_a_partial_prefill_row_and_keeps_none_of_it():
    eng = LLMEngine("tiny", model_runner="v2", block_size=16, num_gpu_blocks=16, max_num_batched_tokens=16)
    eng.add_request("a", PROMPTS["r0"], greedy("a"))  # 40 tokens: chunks of 16, 16, 8
    eng.model_runner.keep_logits = True
    outs = [eng.step() for _ in range(3)]
    li = eng.model_runner.last_inputs
    assert [o for o in outs[:2]] == [[], []] and [len(o[0].new_token_ids) for o in outs[2:]] == [1]
    assert li.discard_mask.tolist() == [False] and int(li.sampled[0]) == outs[2][0].new_token_ids[0]


def test_async_outputs_equal_sync_with_a_stop_token_in_the_middle():
    base, _, _ = run("v1", False, 512, 64, greedy)
    stop = base["r1"][4]

    def params(rid):
        return SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop])

    sync, _, _ = run("v1", False, 16, 64, params)
    for runner in ("v1", "v2"):
        assert run(runner, True, 16, 64, params)[0] == sync
    assert sync["r1"] == base["r1"][:5]


def test_the_two_runners_share_a_base_not_each_other_and_one_partial_prefill_rule():
    import ast
    import inspect

    from minivllm.request import is_partial_prefill
    from minivllm.worker import sampler
    from minivllm.worker.model_runner_base import ModelRunnerBase

    assert not issubclass(ModelRunnerV2, ModelRunner) and not issubclass(ModelRunner, ModelRunnerV2)
    assert issubclass(ModelRunner, ModelRunnerBase) and issubclass(ModelRunnerV2, ModelRunnerBase)
    # V1's sampler knows nothing of V2's Gumbel draw
    imported = {n.module for n in ast.walk(ast.parse(inspect.getsource(sampler))) if isinstance(n, ast.ImportFrom)}
    assert not any("v2" in (m or "") for m in imported)
    assert is_partial_prefill(64, 160) and not is_partial_prefill(160, 160)
    # a 10-token prompt at a budget of 4: chunks 4, 4, 2; both runners discard the first two rows only
    for runner in ("v1", "v2"):
        eng = LLMEngine("tiny", num_gpu_blocks=16, block_size=4, max_num_batched_tokens=4, model_runner=runner)
        eng.add_request("r", list(range(1, 11)), SamplingParams(temperature=0, max_tokens=2))
        discards = []
        while eng.has_unfinished_requests():
            eng.step()
            discards.append(eng.model_runner.last_inputs.discard_mask.tolist())
        assert discards == [[True], [True], [False], [False]], runner
