"""The benchmark: seeded workloads, the transformers peer computes the same greedy tokens as minivllm, the
metrics are computed right, the CLI writes every field; and the padded decode inputs of the CUDA-graph path
(emulated on the CPU) give the same tokens as the eager path. No timing is asserted anywhere."""

import json
import random

import pytest
import torch

from minivllm import LLMEngine, SamplingParams
from minivllm.bench.engine_run import run_engine
from minivllm.bench.hf_peer import hf_model_from_minivllm, run_hf_generate
from minivllm.bench.metrics import result_from_timestamps
from minivllm.bench.workload import (
    FIRST_TOKEN_ID,
    Workload,
    latency_workload,
    random_workload,
    shared_prefix_workload,
)
from minivllm.model.loader import build_tiny_model


@pytest.fixture
def one_thread():
    """HF's many small ops crawl with 2 OpenMP threads on a busy 2-core machine; restore the count after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_random_workload_is_seeded_and_in_range():
    a = random_workload(20, (100, 300), (32, 128), vocab_size=49152, seed=3)
    b = random_workload(20, (100, 300), (32, 128), vocab_size=49152, seed=3)
    c = random_workload(20, (100, 300), (32, 128), vocab_size=49152, seed=4)
    assert a.prompts == b.prompts and a.max_tokens == b.max_tokens
    assert a.prompts != c.prompts
    assert all(100 <= len(p) <= 300 for p in a.prompts)
    assert all(32 <= m <= 128 for m in a.max_tokens)
    assert all(FIRST_TOKEN_ID <= t < 49152 for p in a.prompts for t in p)
    assert a.num_output_tokens == sum(a.max_tokens)
    assert a.subset(5).prompts == a.prompts[:5]


def test_shared_prefix_and_latency_workloads():
    w = shared_prefix_workload(8, prefix_len=40, suffix_len=(3, 9), output_len=(2, 4), vocab_size=512, seed=1)
    prefix = w.prompts[0][:40]
    assert all(p[:40] == prefix for p in w.prompts)
    assert all(3 <= len(p) - 40 <= 9 for p in w.prompts)
    assert len({tuple(p[40:]) for p in w.prompts}) == 8
    lat = latency_workload(160, 64, vocab_size=49152, seed=0)
    assert lat.num_requests == 1 and len(lat.prompts[0]) == 160 and lat.max_tokens == [64]
    assert Workload.from_dict(json.loads(json.dumps(w.to_dict()))).prompts == w.prompts


@pytest.mark.parametrize("kwargs, name", [
    (dict(num_requests=0), "num_requests"),
    (dict(prompt_len=(10, 5)), "prompt_len"),
    (dict(output_len=(0, 4)), "output_len"),
    (dict(vocab_size=10), "vocab_size"),
])
def test_bad_workload_arguments_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        random_workload(**kwargs)


def test_metrics_from_timestamps():
    w = Workload("w", [[1, 2, 3], [4, 5]], [3, 2])
    r = result_from_timestamps("x", w, [[1.0, 1.5, 2.5], [2.0, 2.5]], start=0.0, end=4.0)
    assert r.output_tokens == 5 and r.prompt_tokens == 5
    assert r.output_tok_s == pytest.approx(5 / 4) and r.total_tok_s == pytest.approx(10 / 4)
    assert r.ttft_p50_s == pytest.approx(1.5)  # TTFTs 1.0 and 2.0
    assert r.itl_p50_s == pytest.approx(0.5)  # gaps 0.5, 1.0, 0.5
    assert r.itl_p99_s == pytest.approx(0.99)  # numpy's linear interpolation between 0.5 and 1.0
    assert r.decode_tok_s is None
    one = result_from_timestamps("x", Workload("l", [[1]], [3]), [[1.0, 1.25, 1.5]], 0.0, 1.5)
    assert one.decode_tok_s == pytest.approx(4.0)


def test_transformers_peer_equals_minivllm_on_tiny_model(one_thread):
    """Left-padded static batches through HF's own Llama code give minivllm's greedy tokens (fp32)."""
    model = build_tiny_model()
    w = random_workload(7, (5, 60), (3, 24), vocab_size=512, seed=2)
    hf = run_hf_generate(hf_model_from_minivllm(model), w, batch_size=3, progress=False)
    ours = run_engine(LLMEngine(model, enable_prefix_caching=False), w, progress=False)
    assert [len(t) for t in ours.token_ids] == w.max_tokens
    assert hf.token_ids == ours.token_ids
    assert hf.output_tokens == ours.output_tokens == w.num_output_tokens


def test_transformers_peer_equals_minivllm_on_real_model(real_llm, one_thread):
    w = random_workload(3, (20, 50), (6, 10), vocab_size=49152, seed=5)
    hf = run_hf_generate(hf_model_from_minivllm(real_llm.llm_engine.model), w, batch_size=3, progress=False)
    ours = run_engine(real_llm.llm_engine, w, progress=False)
    assert hf.token_ids == ours.token_ids


def test_cli_writes_every_field(tmp_path, one_thread):
    from minivllm.bench.cli import main

    path = tmp_path / "bench.json"
    argv = ["--model", "tiny", "--dtype", "float32", "--threads", "1", "--num-requests", "5", "--prompt-len", "8",
            "30", "--output-len", "2", "6", "--latency-prompt-len", "12", "--latency-output-len", "5",
            "--prefix-len", "32", "--suffix-len", "2", "6", "--repeats", "2", "--hf-batch-size", "2", "--peers",
            "hf,vllm", "--no-progress", "--json", str(path)]
    assert main(argv) == 0
    data = json.loads(path.read_text())
    assert set(data["results"]) == {"throughput", "latency", "prefix"}
    assert set(data["results"]["prefix"]) == {"minivllm", "minivllm-no-prefix-cache", "transformers"}
    fields = {"output_tok_s", "total_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "peak_mem_mib",
              "num_preemptions", "elapsed_s", "config"}
    for case, systems in data["results"].items():
        for name, entry in systems.items():
            assert fields <= set(entry["median"]), (case, name)
            assert len(entry["runs"]) == 2
            assert entry["median"]["output_tokens"] == data["workloads"][case]["output_tokens"]
    assert data["results"]["latency"]["minivllm"]["median"]["decode_tok_s"] > 0
    assert set(data["ratios"]["throughput"]) == {"transformers"}
    assert "vllm" in data["skipped"]  # the tiny model has no tokenizer, and vllm is not a course dependency
    assert data["environment"]["torch_threads"] == 1
    # The shared prefix was served from the cache by the run with prefix caching on.
    cached = data["results"]["prefix"]["minivllm"]["median"]["config"]
    assert cached["enable_prefix_caching"] is True
    # The batch-1 ceiling from this machine's copy bandwidth and the tiny model's weights (issue 27).
    floor = data["bandwidth_floor"]
    import torch

    from minivllm.model.loader import build_tiny_model

    tiny = build_tiny_model(dtype=torch.float32)
    assert floor["weight_bytes"] == 4 * sum(p.numel() for p in tiny.parameters())   # float32, each tensor once
    assert floor["bandwidth_bytes_s"] > 1e8
    assert floor["ceiling_tok_s"] == pytest.approx(floor["bandwidth_bytes_s"] / floor["weight_bytes"])
    assert floor["decode_tok_s"] == data["results"]["latency"]["minivllm"]["median"]["decode_tok_s"]


def test_cli_rejects_bad_arguments(capsys):
    from minivllm.bench.cli import main

    assert main(["--cases", "throughput,nope"]) == 2
    assert "--cases" in capsys.readouterr().err
    assert main(["--repeats", "0"]) == 2


def test_export_for_vllm_loads_in_transformers(tmp_path, real_llm):
    """The folder handed to vLLM is a plain Hugging Face checkpoint with the same weights."""
    from transformers import AutoModelForCausalLM

    from minivllm.bench.vllm_peer import export_hf_folder

    model = build_tiny_model()
    export_hf_folder(model, real_llm.get_tokenizer(), str(tmp_path / "m"), torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), dtype=torch.float32).eval()
    ids = torch.tensor([[20, 31, 400, 7, 99]])
    with torch.no_grad():
        ref = hf(ids).logits[0, -1]
    eng = LLMEngine(model, enable_prefix_caching=False)
    eng.model_runner.keep_logits = True
    eng.add_request(None, {"prompt_token_ids": ids[0].tolist()}, SamplingParams(temperature=0, max_tokens=1))
    eng.step()
    assert torch.allclose(eng.model_runner.last_inputs.logits[0], ref, atol=1e-4)


def test_vllm_python_has_vllm_asks_the_named_interpreter(tmp_path):
    """The answer for another interpreter comes from running it: the same venv's ``python3`` answers as this
    process does, a missing interpreter answers False (the benchmark then skips the vLLM peer)."""
    import importlib.util
    import os
    import sys

    from minivllm.bench.vllm_peer import vllm_python_has_vllm

    here = importlib.util.find_spec("vllm") is not None
    assert vllm_python_has_vllm() == here
    other = os.path.join(os.path.dirname(sys.executable), "python3")
    if os.path.exists(other) and other != sys.executable:
        assert vllm_python_has_vllm(other) == here  # answered by a child process
    assert vllm_python_has_vllm(str(tmp_path / "no-such-python")) is False
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/bench/ -> the checkout
    vllm_venv = os.path.join(root, ".venv-vllm", "bin", "python")
    if os.path.exists(vllm_venv) and not here:  # the course's second venv holds vLLM; this one does not
        assert vllm_python_has_vllm(vllm_venv) is True


def test_decode_graph_padding_matches_eager():
    """The CUDA-graph path pads decode batches into static buffers; emulated on the CPU it must give the eager
    path's tokens, and most steps of this mix must go through it."""

    def run(emulate):
        eng = LLMEngine("tiny", enable_prefix_caching=False, max_num_batched_tokens=64, max_num_seqs=16)
        if emulate:
            eng.model_runner.enable_decode_graphs(max_batch=12, emulate=True)
        rng = random.Random(0)
        for i in range(12):
            eng.add_request(str(i), {"prompt_token_ids": [rng.randrange(17, 512) for _ in range(rng.randint(5, 90))]},
                            SamplingParams(temperature=0, max_tokens=rng.randint(3, 40), ignore_eos=True))
        out = eng.run_to_completion()
        return {k: v.outputs[0].token_ids for k, v in out.items()}, eng

    eager, _ = run(False)
    padded, eng = run(True)
    assert padded == eager
    assert eng.model_runner.graph_runner.num_replays > eng.scheduler.stats.num_steps // 2
    with pytest.raises(ValueError, match="before any request"):
        eng.add_request("late", {"prompt_token_ids": [20, 21]}, SamplingParams(max_tokens=2))
        eng.step()
        eng.model_runner.enable_decode_graphs(emulate=True)


def test_step_cost_counts_flops_and_bytes():
    """Hand count for the tiny model (hidden 64, intermediate 128, 2 layers, 4 heads / 2 KV heads of 16, vocab
    512): one request prefilling 3 tokens with no context."""
    from minivllm.bench.roofline import step_cost
    from minivllm.model.loader import tiny_llama_config

    c = step_cost(tiny_llama_config(), torch.float32, context_lens=[0], query_lens=[3])
    per_layer = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128  # qkv, o, gate+up+down
    flops = 2 * 2 * per_layer * 3 + 2 * 64 * 512 + 4 * 4 * 16 * (1 + 2 + 3) * 2  # linears, LM head, causal pairs
    assert c.flops == flops == 510976
    assert c.bytes == (2 * per_layer + 64 * 512) * 4 + 6 * (2 * 2 * 2 * 16 * 4) == 429056
    assert c.intensity == pytest.approx(510976 / 429056)


def test_step_profile_groups_operators():
    from minivllm.bench.step_profile import OTHER, OVERHEAD, categorise, profile_step

    assert categorise("aten::bmm") == "attention: QK^T, softmax, PV"
    assert categorise("aten::mm") == "linear layers + LM head"
    assert categorise("mkldnn::_linear_pointwise") == "linear layers + LM head"
    assert categorise("minivllm_cpu::packed_gemm") == categorise("minivllm_cpu::skinny_gemm") == "linear layers + LM head"
    assert categorise("aten::index_select") == "attention: KV gather"
    assert categorise("aten::rsqrt") == OTHER
    eng = LLMEngine("tiny", enable_prefix_caching=False)
    for n in (9, 30):
        eng.add_request(None, {"prompt_token_ids": list(range(20, 20 + n))},
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    eng.step()
    prof = profile_step(eng)  # a decode step of 2 requests
    assert prof.by_category["linear layers + LM head"] > 0 and prof.by_category["attention: KV gather"] > 0
    # the overhead is the wall time no operator accounts for (it was ">= 0", which could not fail)
    operators = sum(v for k, v in prof.by_category.items() if k != OVERHEAD)
    assert prof.by_category[OVERHEAD] == pytest.approx(max(prof.wall_s - operators, 0.0), abs=1e-9)
    assert sum(prof.by_category.values()) >= prof.wall_s * 0.999
    with pytest.raises(ValueError, match="no request"):
        eng.run_to_completion()
        profile_step(eng)


def test_cpu_class_names_the_flags_that_decide_the_fast_path():
    from minivllm.bench.report import cpu_class, environment, environment_line

    avx2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
    bf16 = "flags\t\t: avx2 avx512f avx512bw avx512_bf16 avx512_vnni amx_tile amx_bf16\n"
    assert cpu_class(avx2) == ["avx2"]
    assert cpu_class(bf16) == ["avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16"]
    assert cpu_class("") == []
    env = environment()
    assert env["cpu_flags"] == cpu_class()
    line = environment_line({**env, "cpu_flags": ["avx2"], "cpu": "AMD EPYC", "cpu_count": 2,
                             "torch_threads": 2, "loadavg": [0.5, 0.4, 0.3]})
    assert line == "machine: AMD EPYC (avx2), 2 CPUs, 2 torch threads, load average 0.50"


def test_the_table_is_printed_in_the_current_language_with_its_columns_aligned():
    """``format_table`` and ``environment_line`` in English (unchanged) and in Chinese (notebook 09's Chinese
    edition prints them): the labels through the catalog, every line of a block the same display width (a Chinese
    character is two columns), the numbers the same."""
    import unicodedata

    from minivllm import i18n
    from minivllm.bench.metrics import RunResult
    from minivllm.bench.report import environment_line, format_table

    def run(system, tok_s):
        return RunResult(system, "latency", 1, 160, 16, 1.0, tok_s, 10 * tok_s, 0.2, 0.2, 0.03, 0.04,
                         decode_tok_s=tok_s + 1, peak_mem_mib=3000.0, num_preemptions=0, num_steps=16)

    results = {"latency": {"minivllm": [run("minivllm", 25.7)], "transformers": [run("transformers", 14.6)]}}
    ratios = {"latency": {"transformers": 2.03}}
    env = {"cpu_flags": ["avx2"], "cpu": "AMD EPYC", "cpu_count": 2, "torch_threads": 1, "loadavg": [0.5, 0, 0]}
    width = lambda s: sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in s)  # noqa: E731
    try:
        en = format_table(results, ratios).splitlines()
        assert en[0] == "== latency: 1 requests, 160 prompt tokens =="
        assert en[1].split() == ["system", "output", "tok/s", "total", "tok/s", "decode", "tok/s", "TTFT", "p50",
                                 "ms", "TTFT", "p99", "ms", "ITL", "p50", "ms", "ITL", "p99", "ms", "peak", "MiB",
                                 "preempt", "runs"]
        assert en[3].split()[:2] == ["minivllm", "25.7"] and en[5] == "   minivllm / transformers: 2.03x"
        i18n.set_language("zh_CN")
        zh = format_table(results, ratios).splitlines()
        assert zh[0] == "== latency：1 个请求，160 个 prompt token =="
        assert zh[1].split()[:3] == ["系统", "输出", "tok/s"] and "峰值内存" in zh[1] and "抢占次数" in zh[1]
        assert [ln.split()[1:] for ln in zh[3:5]] == [ln.split()[1:] for ln in en[3:5]]   # the same numbers
        assert len({width(ln) for ln in zh[1:5]}) == 1 and len({width(ln) for ln in en[1:5]}) == 1
        assert environment_line(env) == "机器：AMD EPYC（avx2），2 个 CPU，torch 线程数 1，负载均值 0.50"
    finally:
        i18n.set_language("en")
    assert environment_line(env) == "machine: AMD EPYC (avx2), 2 CPUs, 1 torch threads, load average 0.50"


def test_bandwidth_floor_and_load_lines():
    """``bench`` prints the batch-1 ceiling that memory bandwidth sets and the load average around the runs
    (issue 27), so that a figure can be read without its machine."""
    from minivllm import i18n
    from minivllm.bench.metrics import RunResult
    from minivllm.bench.report import bandwidth_floor, format_floor, load_line

    floor = bandwidth_floor(538_000_000, 17.5e9, 11.2)   # the numbers: 538 MB of float32 weights
    assert floor["ceiling_tok_s"] == pytest.approx(32.53, abs=0.01)
    assert floor["fraction"] == pytest.approx(11.2 / 32.53, abs=1e-3)
    assert format_floor(floor) == ("batch 1: a decode step reads the 538 MB of weights; at 17.5 GB/s (copy bandwidth, "
                                   "measured now) no engine decodes more than 32.5 tok/s here; minivllm 11.2 tok/s, "
                                   "34 % of it")
    assert bandwidth_floor(538_000_000, 17.5e9, None)["fraction"] is None
    assert "minivllm" not in format_floor(bandwidth_floor(538_000_000, 17.5e9, None))
    with pytest.raises(ValueError, match="weight_bytes and bandwidth must be > 0"):
        bandwidth_floor(0, 17.5e9, 1.0)

    def run(before, after):
        r = RunResult("minivllm", "latency", 1, 160, 16, 1.0, 10.0, 100.0)
        r.config.update(loadavg_before=[before, 0, 0], loadavg_after=[after, 0, 0])
        return r

    results = {"latency": {"minivllm": [run(0.5, 1.2), run(0.9, 1.0)], "vllm": [run(1.4, 2.0)]}}
    assert load_line(results) == "load average during the runs: 0.50-1.40 at their start, 1.00-2.00 at their end"
    assert load_line({"latency": {"minivllm": [RunResult("minivllm", "latency", 1, 1, 1, 1.0, 1.0, 1.0)]}}) is None
    try:
        i18n.set_language("zh_CN")
        assert format_floor(floor).startswith("batch 为 1：")
        assert load_line(results).startswith("运行期间的负载均值：")
    finally:
        i18n.set_language("en")
