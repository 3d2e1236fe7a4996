"""Tensor parallelism (issue 20): vLLM's head rule, the layers' shards, N ranks giving N=1's greedy tokens
(chunked prefill and preemption included), each rank's KV cache holding its own heads, shutdown and worker
failure leaving no process behind.

Worker processes are spawned, so each engine start costs a few seconds of imports per rank: the N=2 checks share
one engine, the failure tests one engine each.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from minivllm import LLMEngine, SamplingParams
from minivllm.config import ParallelConfig
from minivllm.distributed import parallel_state
from minivllm.model.config import LlamaConfig, tiny_llama_config, tiny_tp_llama_config

os.environ.setdefault("OMP_NUM_THREADS", "1")  # each worker takes one thread: two busy cores are shared

PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate([37, 5, 21, 12])]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# Small budget and pool: prompts are chunked over several steps and the running requests preempt each other.
TIGHT = dict(num_gpu_blocks=12, block_size=4, max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=False)


def _pid_gone(pid: int) -> bool:
    """True when no process has this id (the worker exited and was reaped by its parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _run(engine: LLMEngine):
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, GREEDY)
    out = engine.run_to_completion(max_steps=500)
    return {k: list(v.outputs[0].token_ids) for k, v in sorted(out.items())}


# ---- the head rule, checked before any process starts ---------------------------------------------------------
def test_head_rule_smollm2():
    cfg = LlamaConfig()  # SmolLM2-135M's shape: 9 query heads, 3 KV heads, intermediate 1536
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (9, 3)
    ParallelConfig(3).verify_with_model_config(cfg)
    ParallelConfig(9).verify_with_model_config(cfg.__class__(intermediate_size=1539))  # each KV head on 3 ranks
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\).*9 query heads.*3 KV heads.*\[1, 3\]"):
        ParallelConfig(2).verify_with_model_config(cfg)


def test_the_sizes_an_error_lists_all_pass():
    # SmolLM2's MLP (intermediate_size 1536) does not divide by 9, so 9 passes the head rule but is refused: the
    # error's list must not offer it.
    from minivllm.config import tensor_parallel_sizes

    cfg = LlamaConfig()
    assert tensor_parallel_sizes(cfg) == [1, 3]
    for n in tensor_parallel_sizes(cfg) + tensor_parallel_sizes(tiny_tp_llama_config()):
        ParallelConfig(n).verify_with_model_config(cfg if n in (1, 3) else tiny_tp_llama_config())
    with pytest.raises(ValueError, match=r"intermediate_size \(1536\); sizes that work for this model: \[1, 3\]"):
        ParallelConfig(9).verify_with_model_config(cfg)


def test_head_rule_kv_split_or_replicated():
    ParallelConfig(2).verify_with_model_config(tiny_llama_config())  # 4 q / 2 kv: split
    ParallelConfig(4).verify_with_model_config(tiny_llama_config())  # 2 kv heads, each on 2 ranks
    ParallelConfig(4).verify_with_model_config(tiny_tp_llama_config())  # 8 q / 4 kv: split
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(4\).*6 KV heads"):
        ParallelConfig(4).verify_with_model_config(tiny_llama_config(num_attention_heads=12, num_key_value_heads=6,
                                                                     hidden_size=96))


def test_engine_rejects_tp2_on_smollm2_before_starting_processes():
    import multiprocessing

    with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\).*9 query heads"):
        LLMEngine(None, tensor_parallel_size=2)
    assert multiprocessing.active_children() == []
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int"):
        LLMEngine("tiny", tensor_parallel_size=0)


# ---- the layers' shards, in this process (no collective runs) ----------------------------------------------------
def _shards(config, n):
    """Each rank's sharded state dict of the same dummy weights (built as rank r of n, loaded, not run)."""
    from minivllm.config import LoadConfig, ModelConfig
    from minivllm.model.loader import get_model

    out = []
    for r in range(n):
        with parallel_state.build_as_rank(r, n):
            out.append(get_model(ModelConfig("x", config), LoadConfig("dummy")).state_dict())
    assert parallel_state.get_tensor_model_parallel_world_size() == 1
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_shards_reassemble_the_whole_model(n):
    from minivllm.model.loader import build_tiny_model

    cfg = tiny_llama_config()  # 4 q / 2 kv heads of 16: at n=4 each KV head sits on two ranks
    full = build_tiny_model(cfg).state_dict()
    shards = _shards(cfg, n)
    hs, q, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    w = full["model.layers.1.self_attn.qkv_proj.weight"]
    fq, fk, fv = w[: q * hs], w[q * hs : (q + kv) * hs], w[(q + kv) * hs :]
    kv_per_rank = max(kv // n, 1)
    for r, sd in enumerate(shards):
        s = sd["model.layers.1.self_attn.qkv_proj.weight"]
        qr = q // n * hs
        kv_head = r * kv_per_rank if n <= kv else r // (n // kv)  # vLLM: rank r holds KV head r // replicas
        assert torch.equal(s[:qr], fq[r * qr : (r + 1) * qr])
        assert torch.equal(s[qr : qr + kv_per_rank * hs], fk[kv_head * hs : (kv_head + kv_per_rank) * hs])
        assert torch.equal(s[qr + kv_per_rank * hs :], fv[kv_head * hs : (kv_head + kv_per_rank) * hs])
    for name, dim in [("self_attn.o_proj", 1), ("mlp.down_proj", 1)]:
        key = f"model.layers.0.{name}.weight"
        assert torch.equal(torch.cat([sd[key] for sd in shards], dim), full[key])
    gate_up = torch.cat([sd["model.layers.0.mlp.gate_up_proj.weight"] for sd in shards]).view(n, 2, -1, cfg.hidden_size)
    assert torch.equal(gate_up.transpose(0, 1).reshape(-1, cfg.hidden_size), full["model.layers.0.mlp.gate_up_proj.weight"])
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(torch.cat([sd[key] for sd in shards])[: cfg.vocab_size], full[key])
    assert torch.equal(shards[0]["model.norm.weight"], full["model.norm.weight"])  # replicated


# ---- N=2 against N=1 --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tp1_tokens_and_cache():
    e = LLMEngine("tiny-tp", **TIGHT)
    tokens = _run(e)
    return tokens, e.num_preemptions, e.model_runner.kv_caches[0].clone()


@pytest.fixture(scope="module")
def tp2_engine():
    e = LLMEngine("tiny-tp", tensor_parallel_size=2, **TIGHT)
    yield e
    e.shutdown()


def _kv_cache_layer0(worker):
    return worker.model_runner.kv_caches[0].clone()


def test_tp2_greedy_tokens_equal_tp1_with_chunking_and_preemption(tp1_tokens_and_cache, tp2_engine):
    tokens1, preemptions1, _ = tp1_tokens_and_cache
    assert preemptions1 > 0  # the setting does preempt
    chunked = []
    tp2_engine.add_step_observer(type("Chunks", (), {
        "on_schedule": lambda self, core, so: chunked.append(max(so.num_scheduled_tokens.values(), default=0)),
        "on_step_end": lambda self, *a: None})())
    assert _run(tp2_engine) == tokens1
    assert max(chunked) == TIGHT["max_num_batched_tokens"] and tp2_engine.num_preemptions == preemptions1
    assert tp2_engine.kv_cache_manager.block_pool.get_num_free_blocks() == TIGHT["num_gpu_blocks"]


def test_tp2_each_rank_caches_its_own_kv_heads(tp1_tokens_and_cache, tp2_engine):
    if not any(c.abs().sum() > 0 for c in tp2_engine.engine_core.model_executor.collective_rpc(_kv_cache_layer0)):
        _run(tp2_engine)  # this test alone: run the same schedule first
    _, _, cache1 = tp1_tokens_and_cache  # [2, blocks + 1, block_size, 4 kv heads, head_dim]
    caches = tp2_engine.engine_core.model_executor.collective_rpc(_kv_cache_layer0)
    assert [c.shape[3] for c in caches] == [2, 2]
    # The same block ids hold the same tokens on both ranks (one block table), each rank with its own heads.
    torch.testing.assert_close(torch.cat(caches, dim=3), cache1, rtol=1e-4, atol=1e-5)


def test_shutdown_leaves_no_process(tp2_engine):
    pids = tp2_engine.engine_core.model_executor.pids
    assert len(pids) == 2 and not any(_pid_gone(p) for p in pids)
    t = time.monotonic()
    tp2_engine.shutdown()
    tp2_engine.shutdown()  # idempotent
    assert time.monotonic() - t < 15 and all(_pid_gone(p) for p in pids)
    with pytest.raises(RuntimeError, match="shut down"):
        tp2_engine.engine_core.model_executor.collective_rpc("load_model")


# ---- worker failure ---------------------------------------------------------------------------------------------
def _raise_on_next_step(worker):
    def boom(scheduler_output):
        raise ValueError("injected failure in rank 1's forward")
    worker.model_runner.execute_model = boom


@pytest.mark.parametrize("how", ["raises", "dies"])
def test_worker_failure_stops_every_process(how):
    e = LLMEngine("tiny", tensor_parallel_size=2, num_gpu_blocks=16)
    pids = e.engine_core.model_executor.pids
    if how == "raises":
        e.engine_core.model_executor.collective_rpc(_raise_on_next_step, ranks=[1], unique_reply_rank=1)
        expected = r"(?s)rank 1 .*injected failure in rank 1's forward"
    else:
        os.kill(pids[1], signal.SIGKILL)
        expected = r"rank 1 \(pid \d+\) exited during execute_model \(exit code -9\)"
    e.add_request("a", [1, 2, 3], GREEDY)
    t = time.monotonic()
    with pytest.raises(RuntimeError, match=expected):
        e.step()  # rank 0 is left waiting in an all-reduce for rank 1: it must be killed, not waited for
    assert time.monotonic() - t < 30
    assert all(_pid_gone(p) for p in pids)
    with pytest.raises(RuntimeError, match="stopped after a failure"):
        e.step()
    e.shutdown()


# ---- N=3 on the real model (9 query heads, 3 KV heads: one KV head per rank) --------------------------------------
def test_tp3_real_model_greedy_tokens_equal_tp1():
    # A budget of 8 chunks the 11-token prompt; 6 blocks of 4 tokens cannot hold both requests to the end.
    kw = dict(num_gpu_blocks=6, block_size=4, max_num_batched_tokens=8, max_num_seqs=2, enable_prefix_caching=False)
    prompts = ["The capital of France is", "Tensor parallelism splits every layer of a model across"]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def run(engine):
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        out = engine.run_to_completion(max_steps=200)
        return {k: list(v.outputs[0].token_ids) for k, v in sorted(out.items())}, engine.num_preemptions

    one = LLMEngine(None, **kw)
    tokens1, preemptions1 = run(one)
    assert preemptions1 > 0
    three = LLMEngine(None, tensor_parallel_size=3, **kw)
    try:
        assert run(three) == (tokens1, preemptions1)
        heads = three.engine_core.model_executor.collective_rpc(_kv_cache_layer0)
        assert [c.shape[3] for c in heads] == [1, 1, 1]
    finally:
        three.shutdown()


def _exited(pid: int) -> bool:
    """Gone, or a zombie: exited, waiting to be reaped by whoever adopted it (a container's init may never)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1].startswith("Z")
    except FileNotFoundError:
        return True


def test_workers_exit_when_the_engine_process_is_killed():
    import subprocess
    import sys
    from pathlib import Path

    code = ("import os\nfrom minivllm import LLMEngine\n"
            "e = LLMEngine('tiny', tensor_parallel_size=2, num_gpu_blocks=16)\n"
            "print(*e.engine_core.model_executor.pids, flush=True)\n"
            "os.kill(os.getpid(), 9)\n")  # no shutdown, no atexit: only the closed pipes tell the workers
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    pids = [int(p) for p in out.stdout.split()]
    assert out.returncode == -signal.SIGKILL and len(pids) == 2, out.stderr[-2000:]
    deadline = time.monotonic() + 30
    while not all(_exited(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(_exited(p) for p in pids)


def test_an_unguarded_script_fails_with_the_reason_and_what_to_write(tmp_path):
    """A script that builds a TP engine at import time, without ``if __name__ == "__main__":``: each spawned worker
    imports it again. The engine process must say so and what to write, not only "exit code 1"."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "unguarded.py"
    script.write_text("from minivllm import LLM\nllm = LLM('tiny-tp', tensor_parallel_size=2, num_gpu_blocks=16)\n"
                      "print('built')\n")
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env,
                         cwd=tmp_path)
    assert out.returncode != 0 and "built" not in out.stdout
    last = out.stderr.strip().splitlines()
    message = "\n".join(last[-12:])
    assert "exited during start" in message and "spawn" in message, out.stderr[-3000:]
    assert 'if __name__ == "__main__":' in message, out.stderr[-3000:]


def test_traced_engine_records_the_same_inputs_with_tensor_parallelism():
    from minivllm.course.trace import SchedulerTrace

    # Its own TP engine: the module's shared one is shut down by an earlier test.
    one, two = LLMEngine("tiny-tp", **TIGHT), LLMEngine("tiny-tp", tensor_parallel_size=2, **TIGHT)
    traces = []
    for engine in (one, two):
        trace = SchedulerTrace(record_inputs=True)
        engine.add_step_observer(trace)
        engine.add_request("t", PROMPTS[0], GREEDY)
        engine.run_to_completion()
        engine.engine_core.step_observers.remove(trace)
        traces.append(trace)
    two.shutdown()
    assert [r.inputs for r in traces[0]] == [r.inputs for r in traces[1]]
    assert traces[0][0].inputs["slot_mapping"][:4] == list(range(4))


def test_a_worker_that_fails_to_start_reports_its_own_traceback():
    """A rank that raises while it loads its share sends its traceback to the engine, which raises it (not only
    an exit code) and stops every rank (issue 24: "print its own error, not only its exit code")."""
    import dataclasses

    from minivllm.engine.arg_utils import EngineArgs
    from minivllm.executor.multiproc_executor import MultiprocExecutor

    config = EngineArgs("tiny", tensor_parallel_size=2, num_gpu_blocks=8).create_engine_config()
    config.model_config.model = "/nonexistent/minivllm-test.gguf"  # the workers load it; the config was built
    config = dataclasses.replace(config, load_config=dataclasses.replace(config.load_config, load_format="gguf"))
    with pytest.raises(RuntimeError, match=r"(?s)worker failed during start: rank \d \(pid \d+\):\nTraceback .*"
                                           r"in load_model.*FileNotFoundError.*minivllm-test\.gguf") as e:
        MultiprocExecutor(config)
    assert "all 2 worker processes were stopped" in str(e.value)


def test_torchrun_ranks_give_the_tokens_of_one_device(tmp_path):
    """The third construction path (``ExecutorWithExternalLauncher``): two ranks started by ``torchrun``, each
    running the whole engine, give the greedy tokens of a one-device engine."""
    import json
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from minivllm.executor.multiproc_executor import get_open_port

    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    out = subprocess.run([torchrun, "--nproc-per-node=2", f"--master-port={get_open_port()}", "-m",
                          "minivllm.entrypoints.torchrun_generate", "--model", "tiny-tp", "--tensor-parallel-size",
                          "2", "--max-tokens", "8", "--prompt", "1,2,3,4,5", "--prompt", "7,8,9"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    got = [json.loads(line)["token_ids"] for line in out.stdout.splitlines() if line.startswith("{")]
    one = LLMEngine("tiny-tp")
    for i, p in enumerate([[1, 2, 3, 4, 5], [7, 8, 9]]):
        one.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=8))
    ref = one.run_to_completion()
    assert got == [list(ref[str(i)].outputs[0].token_ids) for i in range(2)] and len(got[0]) == 8
