"""The OpenAI-compatible server (``minivllm.entrypoints.openai``) and its ``AsyncLLM``, over loopback HTTP.

Servers run in-process (uvicorn in a thread, on a port the OS picks) so that the tests can read the engine's block
pool; one test starts ``python -m minivllm serve`` as a subprocess and stops it with SIGINT. The tiny model
(random weights, token-id prompts) serves where only mechanics matter, the real model in one chat test. Every wait
is bounded in time, every loop in count.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
import httpx  # noqa: E402
import uvicorn  # noqa: E402

from minivllm import LLM, LLMEngine, SamplingParams  # noqa: E402
from minivllm.engine.async_llm import AsyncLLM  # noqa: E402
from minivllm.entrypoints.openai.api_server import build_app, create_server_socket  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NUM_BLOCKS, MAX_MODEL_LEN = 64, 256
PROMPTS = [[1, 2, 3], [7, 8, 9, 10, 11], [100, 200, 300, 400, 42, 17, 5, 99, 3, 1, 250, 251, 252, 253, 254, 255, 256]]


class ServerThread:
    """uvicorn serving ``app`` on 127.0.0.1 in a background thread, on the server's own listening socket."""

    def __init__(self, app) -> None:
        sock = create_server_socket("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=3))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start within 20 s"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def tiny():
    """``(offline LLM, AsyncLLM, server)`` on the same tiny weights: the offline one is the reference."""
    ref = LLM("tiny", num_gpu_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN)
    engine = LLMEngine(ref.llm_engine.model, num_gpu_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN)
    async_llm = AsyncLLM(engine)
    server = ServerThread(build_app(async_llm, "tiny"))
    yield ref, async_llm, server
    server.stop()
    async_llm.shutdown()


def _client(server, **kw):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0,
                         timeout=60, **kw)


def _token_ids(choice):
    return (choice.model_extra or {}).get("token_ids")


def _wait_idle(engine, timeout=10.0):
    """Until the engine has no request and every block is free; returns the seconds it took."""
    t0 = time.monotonic()
    while engine.has_unfinished_requests() or engine.kv_cache_manager.num_free_blocks != NUM_BLOCKS:
        assert time.monotonic() - t0 < timeout, (
            f"engine not idle after {timeout} s: {engine.get_num_unfinished_requests()} requests, "
            f"{engine.kv_cache_manager.num_free_blocks}/{NUM_BLOCKS} blocks free")
        time.sleep(0.02)
    return time.monotonic() - t0


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_openai_client_completions_equal_offline(tiny):
    ref, async_llm, server = tiny
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, sp, use_tqdm=False)]
    client = _client(server)
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    for prompt, want in zip(PROMPTS, expected):
        resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                         extra_body={"return_token_ids": True, "ignore_eos": True})
        assert _token_ids(resp.choices[0]) == want
        assert resp.choices[0].finish_reason == "length"
        assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(prompt), 12)

        got, finish, usage, n_chunks = [], None, None, 0
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                           stream_options={"include_usage": True},
                                           extra_body={"return_token_ids": True, "ignore_eos": True})
        for chunk in stream:
            n_chunks += 1
            assert n_chunks <= 20
            if chunk.choices:
                got += _token_ids(chunk.choices[0])
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
                assert not chunk.choices  # the usage chunk is the last, with no choice
        assert got == want and finish == "length"
        assert n_chunks == 13  # one chunk per token (a delta per step), then the usage chunk
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (len(prompt), 12, len(prompt) + 12)

    # A seeded sampled request draws the same tokens as offline (the request's own generator).
    sp = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=10, ignore_eos=True)
    want = ref.generate([PROMPTS[1]], sp, use_tqdm=False)[0].outputs[0].token_ids
    resp = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=10, temperature=0.9, top_p=0.9,
                                     seed=1234, extra_body={"return_token_ids": True, "top_k": 50, "ignore_eos": True})
    assert _token_ids(resp.choices[0]) == want
    _wait_idle(async_llm.engine)


def test_32_concurrent_streaming_clients(tiny):
    ref, async_llm, server = tiny
    prompts = [[(7 * i + j) % 500 + 1 for j in range(3 + i % 5)] for i in range(32)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in ref.generate(prompts, sp, use_tqdm=False)]
    before = _metric(httpx.get(server.base + "/metrics").text, "vllm:time_to_first_token_seconds_count")

    async def one(client, prompt):
        got, finish = [], None
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                                 stream=True, extra_body={"return_token_ids": True,
                                                                          "ignore_eos": True})
        async for chunk in stream:
            got += _token_ids(chunk.choices[0])
            finish = chunk.choices[0].finish_reason or finish
            assert len(got) <= 8
        return got, finish

    async def main():
        client = openai.AsyncOpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=60)
        return await asyncio.wait_for(asyncio.gather(*[one(client, p) for p in prompts]), 120)

    results = asyncio.run(main())
    assert [r[0] for r in results] == expected
    assert all(r[1] == "length" for r in results)
    _wait_idle(async_llm.engine)
    metrics = httpx.get(server.base + "/metrics").text
    assert _metric(metrics, "vllm:time_to_first_token_seconds_count") == before + 32
    assert _metric(metrics, "vllm:inter_token_latency_seconds_count") >= 32 * 7
    assert _metric(metrics, "vllm:num_requests_running") == 0
    assert _metric(metrics, "vllm:num_requests_waiting") == 0
    assert _metric(metrics, "vllm:num_preemptions_total") == 0
    assert 0.0 <= _metric(metrics, "vllm:kv_cache_usage_perc") <= 1.0


def test_metrics_count_preemptions_and_outputs_survive_them(tiny):
    ref, _async_llm, _server = tiny
    # 8 blocks of 16 tokens for 4 requests that grow to 4 blocks each: the scheduler must preempt.
    engine = LLMEngine(ref.llm_engine.model, num_gpu_blocks=8, max_model_len=64)
    llm = AsyncLLM(engine)
    server = ServerThread(build_app(llm, "tiny"))
    prompts = [[i + 1] * 16 for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in ref.generate(prompts, sp, use_tqdm=False)]
    try:
        async def main():
            client = openai.AsyncOpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=60)
            return await asyncio.wait_for(asyncio.gather(*[client.completions.create(
                model="tiny", prompt=p, max_tokens=40, temperature=0,
                extra_body={"return_token_ids": True, "ignore_eos": True}) for p in prompts]), 120)

        results = asyncio.run(main())
        assert [_token_ids(r.choices[0]) for r in results] == expected
        metrics = httpx.get(server.base + "/metrics").text
        assert engine.num_preemptions > 0
        assert _metric(metrics, "vllm:num_preemptions_total") == engine.num_preemptions
    finally:
        server.stop()
        llm.shutdown()


def test_disconnect_mid_stream_aborts_and_frees_blocks(tiny):
    _ref, async_llm, server = tiny
    engine = async_llm.engine
    body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 230, "temperature": 0, "ignore_eos": True,
            "stream": True}
    steps_before = async_llm.stats.num_steps
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", server.base + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = 0
            for line in resp.iter_lines():
                lines += bool(line.startswith("data: {"))
                if lines == 3:
                    break
            assert engine.kv_cache_manager.num_free_blocks < NUM_BLOCKS  # the request holds blocks now
    _wait_idle(engine)
    # Aborted, not run to its end: far fewer than its 230 decode steps ran.
    assert async_llm.stats.num_steps - steps_before < 150


def test_disconnect_before_whole_response_aborts(tiny):
    # Non-streaming: nothing is sent until the end, so the server watches for the disconnect itself.
    _ref, async_llm, server = tiny
    body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 230, "temperature": 0, "ignore_eos": True}
    steps_before = async_llm.stats.num_steps
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.05))
    _wait_idle(async_llm.engine)
    assert async_llm.stats.num_steps - steps_before < 230


def test_async_llm_shutdown_reports_requests_in_flight_aborted(tiny):
    ref, _async_llm, _server = tiny
    from minivllm.engine.async_llm import EngineDeadError
    from minivllm.sampling_params import RequestOutputKind

    engine = LLMEngine(ref.llm_engine.model, num_gpu_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN, max_num_seqs=1)
    llm = AsyncLLM(engine)
    sp = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def consume(rid, first_seen):
        outs = []
        async for out in llm.generate(PROMPTS[0], sp, rid):
            outs.append(out)
            first_seen.set()
            assert len(outs) <= 241
        return outs

    async def main():
        seen = [asyncio.Event(), asyncio.Event()]
        tasks = [asyncio.create_task(consume(f"r{i}", seen[i])) for i in range(2)]
        await asyncio.wait_for(seen[0].wait(), 30)  # r0 runs; r1 waits (max_num_seqs=1)
        llm.shutdown()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        with pytest.raises(EngineDeadError):
            await llm.add_request("late", PROMPTS[0], sp)
        return results

    r0, r1 = asyncio.run(main())
    assert r0[-1].finished and r0[-1].outputs[0].finish_reason == "abort"
    assert 1 <= sum(len(o.outputs[0].token_ids) for o in r0) < 240
    assert len(r1) == 1 and r1[0].outputs[0].finish_reason == "abort" and r1[0].outputs[0].token_ids == []
    assert not engine.has_unfinished_requests() and engine.kv_cache_manager.num_free_blocks == NUM_BLOCKS
    assert llm.errored


def _bad_cases():
    good = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4}
    cases = [("/v1/completions", b'{"model": "tiny", "prompt": [1, 2', 400, None, "JSON"),
             ("/v1/completions", {**good, "model": "gpt-4"}, 404, "model", "gpt-4"),
             ("/v1/completions", {**good, "temperature": "hot"}, 400, "temperature", "number"),
             ("/v1/completions", {**good, "prompt": [1, 2, 600]}, 400, "prompt", "[0, 512)"),
             ("/v1/completions", {**good, "prompt": []}, 400, "prompt", "at least one token"),
             ("/v1/completions", {**good, "prompt": [5] * 300}, 400, "prompt", f"max_model_len ({MAX_MODEL_LEN})"),
             ("/v1/completions", {**good, "prompt": [5] * 300, "stream": True}, 400, "prompt", "max_model_len"),
             ("/v1/completions", {**good, "stop_token_ids": [512]}, 400, "stop_token_ids", "[0, 512)"),
             ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, 400,
              "messages", "tokenizer"),
             ("/v1/chat/completions", {"model": "tiny"}, 400, "messages", "required")]
    for name, value, limit in [("temperature", -1.0, ">= 0"), ("top_p", 1.5, "(0, 1]"), ("top_p", 0.0, "(0, 1]"),
                               ("top_k", -5, ">= 1"), ("min_p", 2.0, "[0, 1]"), ("max_tokens", 0, ">= 1"),
                               ("seed", 2**63, "[-2**63, 2**63 - 1]"), ("n", 0, ">= 1"),
                               ("presence_penalty", 3.0, "[-2, 2]"), ("repetition_penalty", 0, "> 0"),
                               ("logprobs", 21, "max allowed: 20"), ("logit_bias", {"600": 1}, "out-of-vocab")]:
        cases.append(("/v1/completions", {**good, name: value}, 400, name, limit))
    return cases


def test_bad_inputs_get_openai_errors_and_do_not_disturb_others(tiny):
    _ref, async_llm, server = tiny
    cases = _bad_cases()

    async def good_stream(client, streaming):
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 240, "temperature": 0, "ignore_eos": True,
                "stream": True, "return_token_ids": True}
        got, finish = [], None
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    got += choice["token_ids"]
                    streaming.set()
                    finish = choice.get("finish_reason") or finish
        return got, finish

    async def main():
        async with httpx.AsyncClient(base_url=server.base, timeout=60) as client:
            streaming = asyncio.Event()
            good = asyncio.create_task(good_stream(client, streaming))
            await asyncio.wait_for(streaming.wait(), 30)
            errors, in_flight = [], []
            for path, body, *_ in cases:
                if isinstance(body, bytes):
                    r = await client.post(path, content=body, headers={"content-type": "application/json"})
                else:
                    r = await client.post(path, json=body)
                errors.append((r.status_code, r.json()))
                in_flight.append(not good.done())
            assert in_flight[0]  # (at least) the first bad requests were answered while the good one streamed
            return errors, await asyncio.wait_for(good, 60)

    errors, (tokens, finish) = asyncio.run(main())
    for (path, body, status, param, limit), (got_status, got) in zip(cases, errors):
        where = f"{path} {body!r:.80}"
        assert got_status == status, where
        err = got["error"]
        assert set(err) == {"message", "type", "param", "code"}, where
        assert err["code"] == status and err["param"] == param, (where, err)
        assert limit in err["message"], (where, err)
        assert err["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    assert len(tokens) == 240 and finish == "length"
    _wait_idle(async_llm.engine)


def test_api_key_enforced(tiny):
    _ref, async_llm, _server = tiny
    server = ServerThread(build_app(async_llm, "tiny", api_key="s3cret"))
    try:
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
            r = httpx.post(server.base + "/v1/completions", json=body, headers=headers, timeout=30)
            assert r.status_code == 401, headers
            assert r.json()["error"]["code"] == 401
            assert httpx.get(server.base + "/v1/models", headers=headers, timeout=30).status_code == 401
        assert httpx.get(server.base + "/health", timeout=30).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            _client(server, api_key="wrong").completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=2)
        resp = _client(server, api_key="s3cret").completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=2)
        assert resp.usage.completion_tokens == 2
    finally:
        server.stop()


def test_chat_real_model_equal_offline(real_llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    sp = SamplingParams(temperature=0, max_tokens=16)
    want = real_llm.chat(messages, sp, use_tqdm=False)[0].outputs[0]
    eng = real_llm.llm_engine
    async_llm = AsyncLLM(LLMEngine(eng.model, tokenizer=eng.tokenizer, num_gpu_blocks=64))
    server = ServerThread(build_app(async_llm, "SmolLM2-135M-Instruct"))
    try:
        client = _client(server)
        resp = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=16,
                                              temperature=0, extra_body={"return_token_ids": True})
        assert _token_ids(resp.choices[0]) == want.token_ids
        assert resp.choices[0].message.content == want.text and resp.choices[0].message.role == "assistant"
        assert resp.choices[0].finish_reason == want.finish_reason
        assert resp.usage.completion_tokens == len(want.token_ids)

        parts, roles, usage = [], [], None
        stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=16,
                                                temperature=0, stream=True, stream_options={"include_usage": True})
        for i, chunk in enumerate(stream):
            assert i < 40
            if chunk.choices:
                roles.append(chunk.choices[0].delta.role)
                parts.append(chunk.choices[0].delta.content or "")
            usage = chunk.usage or usage
        assert roles[0] == "assistant" and "".join(parts) == want.text
        assert usage.completion_tokens == len(want.token_ids)

        # A stop string cut inside the reply, streamed (text held back while it may still match) and whole.
        stop = want.text[len(want.text) // 2:][:3]
        want_stop = real_llm.chat(messages, SamplingParams(temperature=0, max_tokens=16, stop=[stop]),
                                  use_tqdm=False)[0].outputs[0]
        assert want_stop.finish_reason == "stop" and want_stop.stop_reason == stop
        resp = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=16,
                                              temperature=0, stop=[stop])
        assert resp.choices[0].message.content == want_stop.text and resp.choices[0].finish_reason == "stop"
        stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=16,
                                                temperature=0, stop=[stop], stream=True)
        chunks = list(stream)
        assert len(chunks) < 40
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == want_stop.text
        assert chunks[-1].choices[0].finish_reason == "stop"
    finally:
        server.stop()
        async_llm.shutdown()


def test_serve_subprocess_sigint_with_requests_in_flight():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-m", "minivllm", "serve", "tiny", "--port", str(port), "--num-gpu-blocks", "64",
         "--max-num-seqs", "1"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "server did not come up within 120 s"
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)

        results = [None] * 3
        accepted = threading.Barrier(4, timeout=60)  # the 3 streams' headers arrived (the engine queued them)
        streaming = threading.Event()  # request 0 has sent a token

        def stream(i):
            body = {"model": "tiny", "prompt": [1 + i, 2, 3], "max_tokens": 1000, "ignore_eos": True,
                    "stream": True}
            finishes, done = [], False
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as resp:
                assert resp.status_code == 200
                accepted.wait()
                for line in resp.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: {"):
                        finishes.append(json.loads(line[6:])["choices"][0].get("finish_reason"))
                    if line.startswith("data: "):
                        streaming.set()
            results[i] = (finishes[-1] if finishes else None, done)

        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(3)]
        for t in threads:
            t.start()
        accepted.wait()
        assert streaming.wait(60)  # request 0 is streaming; 1 and 2 wait (max_num_seqs=1)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        for t in threads:
            t.join(15)
        assert not any(t.is_alive() for t in threads), "a stream hung after SIGINT"
        rc = proc.wait(timeout=15)
        assert time.monotonic() - t0 < 15
        assert rc == 0, proc.stdout.read().decode() if proc.stdout else ""
        # Every stream ended properly: [DONE] after a final chunk; those still running were reported aborted.
        assert all(r is not None and r[1] for r in results), results
        assert [r[0] for r in results].count("abort") >= 2, results
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
