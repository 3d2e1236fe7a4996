"""EngineCore -> Executor -> Worker -> ModelRunner (issue 24): one construction path for every configuration, the
config holding settings only, the KV pool sized from the workers' memory in vLLM's order, inspection off the hot
path."""

from __future__ import annotations

import pickle

import pytest
import torch

from minivllm import LLMEngine, SamplingParams
from minivllm.engine.arg_utils import EngineArgs
from minivllm.executor import get_executor_class
from minivllm.executor.abstract import Executor
from minivllm.executor.multiproc_executor import MultiprocExecutor
from minivllm.executor.uniproc_executor import ExecutorWithExternalLauncher, UniProcExecutor
from minivllm.kv_cache_interface import FullAttentionSpec, get_num_blocks
from minivllm.model.config import tiny_llama_config
from minivllm.worker.worker import DEFAULT_CPU_KV_CACHE_BYTES

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def test_executor_class_per_backend():
    def cls(**kw):
        return get_executor_class(EngineArgs("tiny", num_gpu_blocks=8, **kw).create_engine_config())

    assert cls() is UniProcExecutor and cls(distributed_executor_backend="uni") is UniProcExecutor
    assert cls(tensor_parallel_size=2) is MultiprocExecutor
    assert cls(distributed_executor_backend="external_launcher") is ExecutorWithExternalLauncher
    assert issubclass(ExecutorWithExternalLauncher, UniProcExecutor) and issubclass(MultiprocExecutor, Executor)
    with pytest.raises(ValueError, match="'uni' runs one device; tensor_parallel_size is 2"):
        EngineArgs("tiny", tensor_parallel_size=2, distributed_executor_backend="uni").create_engine_config()


def test_config_holds_settings_only_and_pickles_as_it_is():
    config = EngineArgs(None, max_model_len=256).create_engine_config()  # SmolLM2: its file is read, not loaded
    assert not hasattr(config, "model") and not hasattr(config, "tokenizer")
    assert config.cache_config.num_gpu_blocks is None
    assert config.dtype == torch.float32 and config.hf_config.num_hidden_layers == 30
    again = pickle.loads(pickle.dumps(config))
    assert again.model_config == config.model_config and again.scheduler_config == config.scheduler_config


def test_kv_pool_sized_from_the_workers_available_memory_in_vllms_order():
    spec = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=16, dtype_size=4, num_layers=2)
    assert spec.page_size_bytes == 2 * 4 * 2 * 16 * 4
    budget = 40 * spec.page_size_bytes * spec.num_layers + 7  # 40 blocks and a few bytes
    assert get_num_blocks(budget, spec) == 40
    eng = LLMEngine("tiny", block_size=4, kv_cache_memory_bytes=budget)
    worker = eng.engine_core.model_executor.driver_worker
    assert worker.get_kv_cache_spec() == spec
    assert eng.cache_config.num_gpu_blocks == eng.kv_cache_manager.block_pool.num_gpu_blocks == 40
    assert eng.model_runner.kv_caches[0].shape[1] == 41  # and the scratch block
    assert eng.scheduler_config.max_model_len == 160  # the unset max_model_len, capped at the pool's capacity
    # without a budget, the CPU default (vLLM's CPU worker: VLLM_CPU_KVCACHE_SPACE), capped at 8192 blocks
    assert LLMEngine("tiny").engine_core.model_executor.determine_available_memory() == [DEFAULT_CPU_KV_CACHE_BYTES]
    # a max_model_len the user set must fit the measured pool: refused, naming both numbers
    with pytest.raises(ValueError, match=r"num_gpu_blocks \(40\) x block_size \(4\) = 160 tokens .* max_model_len "
                                         r"\(200\)"):
        LLMEngine("tiny", block_size=4, kv_cache_memory_bytes=budget, max_model_len=200)
    with pytest.raises(ValueError, match="no KV cache block fits in 100 bytes"):
        LLMEngine("tiny", block_size=4, kv_cache_memory_bytes=100)


def test_a_built_model_is_taken_by_the_worker_not_loaded_and_two_engines_share_it():
    from minivllm.model.loader import build_tiny_model

    model = build_tiny_model(tiny_llama_config())
    a = LLMEngine(model, num_gpu_blocks=16, block_size=4)
    b = LLMEngine(model, num_gpu_blocks=16, block_size=4, attention_backend="REFERENCE")
    assert a.model is b.model is model
    outs = []
    for eng in (a, b, a):
        eng.add_request("r", [5, 6, 7, 8, 9], GREEDY)
        outs.append(eng.run_to_completion()["r"].outputs[0].token_ids)
    assert outs[0] == outs[1] == outs[2]


def test_step_inputs_are_built_only_when_read():
    eng = LLMEngine("tiny", block_size=4, num_gpu_blocks=16, max_num_batched_tokens=4, enable_prefix_caching=False)
    runner = eng.model_runner
    eng.add_request("r", [1, 2, 3, 4, 5, 6], GREEDY)
    eng.step()
    assert runner._last_inputs is None and runner._last_step is not None  # nothing built by the step itself
    li = runner.last_inputs
    assert li is runner.last_inputs  # built once, then kept until the next step
    assert li.positions.tolist() == [0, 1, 2, 3] and li.discard_mask.tolist() == [True] and li.logits is None
    eng.step()
    assert runner.last_inputs.positions.tolist() == [4, 5] and runner.last_inputs.discard_mask.tolist() == [False]
    runner.last_inputs = None
    assert runner.last_inputs is None


def test_model_runner_handle_names_the_worker_processes_under_tensor_parallelism():
    class FakeExecutor:
        pass

    eng = LLMEngine("tiny", num_gpu_blocks=8)
    eng.engine_core.model_executor = FakeExecutor()  # what an engine with worker processes has: no driver_worker
    with pytest.raises(AttributeError, match="collective_rpc"):
        eng.model_runner


def test_a_step_is_execute_model_then_sample_tokens_as_in_vllm_0_32():
    """``execute_model`` runs the forward pass and keeps the logits; ``sample_tokens`` samples them (vLLM 0.32's
    split, ``GPUModelRunner.execute_model`` / ``sample_tokens``). A step with no token returns its output from
    ``execute_model``."""
    eng = LLMEngine("tiny", block_size=4, num_gpu_blocks=16, enable_prefix_caching=False)
    ref = LLMEngine("tiny", block_size=4, num_gpu_blocks=16, enable_prefix_caching=False)
    for e in (eng, ref):
        e.add_request("r", [5, 6, 7, 8, 9], GREEDY)
    executor, runner = eng.engine_core.model_executor, eng.model_runner
    so = eng.scheduler.schedule()
    assert executor.execute_model(so) is None
    assert runner.execute_model_state is not None and runner.execute_model_state.logits.shape == (1, eng.hf_config.vocab_size)
    with pytest.raises(RuntimeError, match="before sample_tokens"):
        executor.execute_model(so)
    with pytest.raises(ValueError, match="grammar_output must be None"):
        executor.sample_tokens(object())
    out = executor.sample_tokens(None)
    assert runner.execute_model_state is None and out.req_ids == ["r"]
    eng.scheduler.update_from_output(so, out)
    with pytest.raises(RuntimeError, match="needs a step run by execute_model"):
        executor.sample_tokens(None)
    assert out.sampled_token_ids == [ref.engine_core.step().outputs[0].new_token_ids]  # the engine's own step
    assert eng.run_to_completion()["r"].outputs[0].token_ids == ref.run_to_completion()["r"].outputs[0].token_ids
    empty = eng.scheduler.schedule()  # nothing left: the step's output comes from execute_model
    assert empty.total_num_scheduled_tokens == 0 and executor.execute_model(empty).sampled_token_ids == []


def _objects_in(obj, path="config"):
    """``(path, object)`` for every value under a config that is not a setting (a module, a connector, ...)."""
    import dataclasses

    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _objects_in(getattr(obj, f.name), f"{path}.{f.name}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _objects_in(v, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _objects_in(v, f"{path}[{k!r}]")
    elif not (obj is None or isinstance(obj, (str, int, float, bool, torch.dtype, torch.device, type))):
        yield path, obj


def test_a_built_model_and_a_connector_stay_out_of_the_config():
    """Issue 24: the config holds settings only. A model handed in built and a KV connector object go to the
    worker and the scheduler as arguments; the config names the connector (vLLM's kv_transfer_config)."""
    from minivllm.distributed.kv_transfer.offload_connector import OffloadConnector
    from minivllm.model.loader import build_tiny_model

    model = build_tiny_model(tiny_llama_config())
    conn = OffloadConnector(4)
    eng = LLMEngine(model, num_gpu_blocks=16, block_size=4, kv_connector=conn)
    assert list(_objects_in(eng.vllm_config)) == []
    assert list(_objects_in(EngineArgs(model, kv_connector=conn, num_gpu_blocks=8).create_engine_config())) == []
    assert eng.vllm_config.kv_transfer_config.kv_connector == "OffloadConnector"
    assert eng.model is model and eng.model_runner.connector is conn and eng.scheduler.connector is conn
    assert eng.engine_core.kv_connector is eng.kv_connector is conn
    eng.add_request("r", [5, 6, 7, 8, 9], GREEDY)
    assert len(eng.run_to_completion()["r"].outputs[0].token_ids) == 4
