"""``python -m minivllm bench serve``: arrival times, the statistics of a run, and one short run end to end
against minivllm's own server (the tiny model on loopback, started by the command itself, bounded in time)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from minivllm.bench.serve.arrivals import arrival_times
from minivllm.bench.serve.cli import parse_rates, summarize
from minivllm.bench.serve.metrics import calculate_metrics, parse_goodput, request_tpot
from minivllm.bench.serve.request_func import RequestFuncOutput
from minivllm.bench.workload import random_workload

ROOT = Path(__file__).resolve().parents[2]


# ---- arrivals --------------------------------------------------------------------------------------------------
def test_arrivals_are_seeded_and_start_at_zero():
    a = arrival_times(50, 4.0, seed=3)
    assert a == arrival_times(50, 4.0, seed=3)
    assert a != arrival_times(50, 4.0, seed=4)
    assert a[0] == 0.0 and len(a) == 50
    assert all(x <= y for x, y in zip(a, a[1:]))
    # The gaps are numpy's gamma draws of shape 1 (exponential) and mean 1/rate, from default_rng(seed).
    expected = np.random.default_rng(3).gamma(1.0, 0.25, 49)
    assert np.allclose(np.diff(a), expected)


def test_poisson_rate_and_burstiness():
    a = arrival_times(20001, 5.0, seed=0)
    gaps = np.diff(a)
    assert abs(gaps.mean() - 0.2) < 0.01  # mean gap 1/rate
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.05  # exponential: coefficient of variation 1
    even = np.diff(arrival_times(20001, 5.0, burstiness=4.0, seed=0))
    assert abs(even.mean() - 0.2) < 0.01 and abs(even.std() / even.mean() - 0.5) < 0.05  # gamma: CV 1/sqrt(k)


def test_arrivals_inf_and_errors():
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="request_rate must be > 0"):
        arrival_times(3, 0.0)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_times(3, 1.0, burstiness=0)
    with pytest.raises(ValueError, match="num_requests"):
        arrival_times(0, 1.0)
    assert parse_rates(["1", "2.5", "inf"]) == [1.0, 2.5, math.inf]
    with pytest.raises(ValueError, match="--request-rate"):
        parse_rates(["-1"])


# ---- statistics ------------------------------------------------------------------------------------------------
def _out(ttft, latency, n, itl=(), ok=True, prompt_len=10):
    return RequestFuncOutput(success=ok, ttft=ttft, latency=latency, output_tokens=n, itl=list(itl),
                             prompt_len=prompt_len)


def test_percentiles_tpot_and_goodput_hand_checked():
    # TTFTs 0.1 .. 0.5 s. Linear interpolation over 5 sorted values: p50 is the 3rd (0.3 s); p90 sits at rank
    # 0.9 * 4 = 3.6, i.e. 0.4 + 0.6 * (0.5 - 0.4) = 0.46 s; p99 at rank 3.96: 0.496 s.
    outs = [_out(0.1, 1.0, 10, [0.1] * 9), _out(0.2, 2.0, 10, [0.2] * 9), _out(0.3, 0.3, 1),
            _out(0.4, 4.0, 5, [0.9] * 4), _out(0.5, 1.4, 4, [0.3] * 3),
            _out(9.0, 9.0, 0, ok=False)]
    m = calculate_metrics(outs, duration_s=4.0, goodput_slos_ms={"ttft": 350, "tpot": 150})
    assert (m.completed, m.failed) == (5, 1)
    assert m.ttft_ms["p50"] == pytest.approx(300.0)
    assert m.ttft_ms["p90"] == pytest.approx(460.0)
    assert m.ttft_ms["p99"] == pytest.approx(496.0)
    assert m.ttft_ms["mean"] == pytest.approx(300.0)
    # TPOT (latency - ttft) / (n - 1): 0.1, 0.2, -, 0.9, 0.3 s (the one-token request has none): p50 of 4 = 250 ms
    assert [request_tpot(o) for o in outs[:5]] == pytest.approx([0.1, 0.2, 0.0, 0.9, 0.3])
    assert m.tpot_ms["p50"] == pytest.approx(250.0)
    # ITLs pooled: nine 100 ms, nine 200 ms, four 900 ms, three 300 ms -> 25 values, the 13th sorted is 200 ms
    assert m.itl_ms["p50"] == pytest.approx(200.0)
    # Good: TTFT <= 350 ms and TPOT <= 150 ms -> request 1 (0.1, 0.1) and request 3 (0.3 s, one token: TPOT 0)
    assert m.good_completed == 2 and m.request_goodput == pytest.approx(0.5)
    assert m.request_throughput == pytest.approx(5 / 4.0)
    assert m.total_output == 30 and m.output_throughput == pytest.approx(7.5)
    assert m.total_input == 50
    # An E2EL SLO of 999 ms leaves only the one-token request (0.3 s); at 1000 ms request 1 (1.0 s) meets it too
    # (an SLO is met at equality, as in vLLM).
    assert calculate_metrics(outs, 4.0, {"e2el": 999}).good_completed == 1
    assert calculate_metrics(outs, 4.0, {"e2el": 1000}).good_completed == 2
    # Without SLOs there is no goodput figure.
    assert calculate_metrics(outs, 4.0).request_goodput is None


def test_metrics_errors_and_goodput_parsing():
    assert parse_goodput(["ttft:500", "tpot:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    for bad in (["ttft"], ["itl:5"], ["ttft:x"], ["e2el:0"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)
    with pytest.raises(ValueError, match="duration_s"):
        calculate_metrics([], 0.0)
    with pytest.raises(ValueError, match="unknown SLO"):
        calculate_metrics([], 1.0, {"itl": 1.0})
    empty = calculate_metrics([_out(0, 0, 0, ok=False)], 1.0)
    assert empty.completed == 0 and empty.ttft_ms["p50"] is None


def test_summarize_spread_over_repeats():
    def run(target, rate, tok_s):
        m = calculate_metrics([_out(0.1, 1.0, 10, [0.1] * 9)], 1.0).to_json()
        m["output_throughput"] = tok_s
        return {"target": target, "request_rate": rate, "metrics": m}

    rows = summarize([run("a", 1.0, 10.0), run("a", 1.0, 14.0), run("a", 1.0, 11.0), run("b", 1.0, 5.0)])
    a = next(r for r in rows if r["target"] == "a")
    assert a["runs"] == 3 and a["output_tok_s"] == {"median": 11.0, "min": 10.0, "max": 14.0}


def test_wait_until_quiet_waits_for_a_quiet_window_or_the_limit():
    from minivllm.bench.serve.cli import QUIET_WINDOW_S, wait_until_quiet

    class Machine:
        def __init__(self, loads):
            self.now, self.busy, self.loads = 0.0, 0.0, list(loads)  # CPUs busy in each successive window

        def sleep(self, s):
            self.now += s
            self.busy += (self.loads.pop(0) if self.loads else 0.0) * s

    m = Machine([1.5, 0.4, 0.1])  # the last run's server still finishing, then quiet
    waited, quiet = wait_until_quiet(10.0, lambda: m.busy, lambda: m.now, m.sleep)
    assert waited == pytest.approx(3 * QUIET_WINDOW_S) and quiet
    m = Machine([2.0] * 100)  # another job that does not stop: give up at the limit, and say so
    waited, quiet = wait_until_quiet(1.2, lambda: m.busy, lambda: m.now, m.sleep)
    assert waited == pytest.approx(1.2) and not quiet  # windows of 0.5, 0.5 and the 0.2 left
    waited, quiet = wait_until_quiet(0.2, lambda: m.busy, lambda: m.now, m.sleep)
    assert waited == pytest.approx(0.2) and not quiet  # never past the limit
    assert wait_until_quiet(0.0, lambda: 1 / 0) == (0.0, None)  # 0: no wait, nothing read
    from minivllm.bench.serve.cli import build_parser, check_args

    for bad in ("-1", "nan", "inf"):
        with pytest.raises(ValueError, match="--settle must be a finite number >= 0"):
            check_args(build_parser().parse_args(["--settle", bad]))


# ---- end to end ------------------------------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_bench_serve_against_minivllm_server(tmp_path):
    """The command starts ``python -m minivllm serve tiny``, sends 6 requests at two rates, stops the server, and
    records exactly the tokens the seeded workload asks for."""
    out = tmp_path / "r.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", VLLM_API_KEY="not-for-the-json")  # vllm serve's key: never recorded
    args = ["--model", "tiny", "--dtype", "float32", "--request-rate", "50", "inf", "--num-prompts", "6",
            "--prompt-len", "4", "12", "--output-len", "2", "6", "--warmup", "1", "--json", str(out),
            "--startup-timeout", "120"]
    r = subprocess.run([sys.executable, "-m", "minivllm", "bench", "serve", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=200)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    res = json.loads(out.read_text())
    wl = random_workload(6, (4, 12), (2, 6), 512, 0)
    assert [(x["target"], x["request_rate"]) for x in res["runs"]] == [("minivllm", 50.0), ("minivllm", math.inf)]
    for run in res["runs"]:
        m = run["metrics"]
        assert (m["completed"], m["failed"]) == (6, 0)
        assert m["total_output"] == sum(wl.max_tokens) and m["total_input"] == wl.num_prompt_tokens
        assert m["ttft_ms"]["p50"] <= m["e2el_ms"]["p50"]
        assert run["preemptions"] == 0
    assert res["env"]["OMP_NUM_THREADS"] == "1" and "not-for-the-json" not in out.read_text()
    assert (tmp_path / "r.png").stat().st_size > 10_000
    assert "minivllm    50" in r.stdout and "(median over repeats" in r.stdout
    assert (tmp_path / "server-minivllm.log").exists()


def test_live_view_reads_both_servers_metrics():
    """Notebook 11's ``QueueWatch`` parses vLLM's exposition (labels vary, one line per engine) and minivllm's."""
    from minivllm.course.serving import Frame, frame_html, parse_metrics

    text = "\n".join([
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
        'vllm:num_requests_waiting{engine="0",model_name="m"} 5.0',
        'vllm:num_requests_waiting{engine="1",model_name="m"} 2.0',
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
        'vllm:num_preemptions_total{engine="0",model_name="m"} 4.0',
        'vllm:num_preemptions_created{engine="0",model_name="m"} 1.7e9',
        "vllm:num_requests_running_extra 9",
    ])
    assert parse_metrics(text) == {"waiting": 7.0, "running": 3.0, "kv_cache_usage": 0.25, "preemptions": 4.0}
    assert parse_metrics("") == {}
    html = frame_html(Frame(1.0, waiting=45, running=2, kv_cache_usage=0.5, preemptions=1), max_squares=40)
    assert html.count("background:#f0a830") == 40 and "+5" in html and html.count("background:#3b7dd8") == 2
    assert "50.0 %" in html


def test_latency_ends_at_the_last_chunk_with_a_choice_not_at_the_usage_chunk():
    # vLLM's benchmark takes E2EL at the last chunk carrying a choice (most_recent_timestamp); a slow usage chunk
    # and [DONE] after it must not count, nor change TPOT.
    import asyncio

    import httpx

    from minivllm.bench.serve.request_func import RequestFuncInput, async_request_openai_completions

    async def body():
        for tok in ("a", "b"):
            yield f'data: {json.dumps({"choices": [{"index": 0, "text": tok}]})}\n\n'.encode()
        await asyncio.sleep(0.5)  # the usage chunk comes late
        yield f'data: {json.dumps({"choices": [], "usage": {"completion_tokens": 2, "prompt_tokens": 3}})}\n\n'.encode()
        yield b"data: [DONE]\n\n"

    async def run():
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body()))
        async with httpx.AsyncClient(transport=transport) as client:
            inp = RequestFuncInput(prompt=[1, 2, 3], api_url="http://test/v1/completions", output_len=2,
                                   model="m")
            return await async_request_openai_completions(inp, client)

    out = asyncio.run(run())
    assert out.success, out.error
    assert out.output_tokens == 2 and len(out.itl) == 1
    assert out.latency == pytest.approx(out.ttft + out.itl[0])  # ends at "b": the 0.5 s wait is not in it
