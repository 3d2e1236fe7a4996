"""A bounded, self-stopping attack on the OpenAI-compatible server (issue 28), loopback only: a set of bad inputs,
oversized bodies (a declared 50 MB, a chunked 5 MB) and a storm of clients that disconnect (three waves of ten
streaming and ten whole requests), while neighbour streams run one after another.

What must hold: every bad request gets a 4xx with OpenAI's error body of bounded size (never a 500, never FastAPI's
``{"detail": ...}``); the server logs no traceback; the neighbour gets all its tokens with no gap of 0.5 s or more
(1.5 s during the storm); afterwards the engine is idle with every KV block free and ``/metrics`` says so. About
10 s on two busy cores.

The gap bounds fail only for a stall that reproduces: a phase whose longest gap misses its bound is run again
beside a new neighbour, and the test fails only if the second run misses it too. On two shared cores (CI: two xdist
workers beside notebooks) one run was measured at 0.59 s at load 4.3 with nothing stalled; the stalls of issue 28
were 0.5-52 s on every run, and a stall put back on purpose fails both runs (0.8 s of synchronous work on the
event loop for each body over 500 KB: 0.85 s, then 0.84 s).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
import httpx  # noqa: E402

from minivllm import LLM, LLMEngine  # noqa: E402
from minivllm.engine.async_llm import AsyncLLM  # noqa: E402
from minivllm.entrypoints.openai.api_server import build_app  # noqa: E402
from tests.entrypoints.test_server_robustness import ServerThread  # noqa: E402

NUM_BLOCKS, MAX_MODEL_LEN, NEIGHBOUR_TOKENS = 64, 256, 240
JSON = {"content-type": "application/json"}


def _bad_inputs():
    """(path, body bytes, headers, expected status)."""
    good = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4}

    def j(**kw):
        return json.dumps({**good, **kw}).encode()

    def compact(**kw):
        return json.dumps({**good, **kw}, separators=(",", ":")).encode()

    cases = [
        ("/v1/completions", b'{"model": "tiny", "prompt": [1, 2', JSON, 400),
        ("/v1/completions", b'{"prompt": "\xff\xfe"}', JSON, 400),
        ("/v1/completions", b'{"prompt": [1], "max_tokens": ' + b"9" * 5000 + b"}", JSON, 400),
        ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, JSON, 400),
        ("/v1/completions", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", JSON, 400),
        ("/v1/completions", j(), {"content-type": "text/plain"}, 400),
        ("/v1/completions", j(), {}, 400),
        ("/v1/completions", b"null", JSON, 400),
        ("/v1/completions", b'"a string"', JSON, 400),
        ("/v1/completions", j(model="gpt-4"), JSON, 404),
        ("/v1/completions", j(temperature="hot" * 100_000), JSON, 400),
        ("/v1/completions", j(temperature=-1), JSON, 400),
        ("/v1/completions", j(top_p=2), JSON, 400),
        ("/v1/completions", j(max_tokens=0), JSON, 400),
        ("/v1/completions", j(seed=10**30), JSON, 400),
        ("/v1/completions", j(n=0), JSON, 400),
        ("/v1/completions", j(n=2, temperature=0), JSON, 400),
        ("/v1/completions", j(logprobs=-2), JSON, 400),
        ("/v1/completions", j(logprobs=10**6), JSON, 400),
        ("/v1/completions", j(echo=True), JSON, 400),
        ("/v1/completions", j(prompt=[]), JSON, 400),
        ("/v1/completions", j(prompt=[1, 2, 10**40]), JSON, 400),
        ("/v1/completions", j(prompt=[1, 2, -1]), JSON, 400),
        ("/v1/completions", j(prompt=[1, True]), JSON, 400),
        ("/v1/completions", j(prompt=[[1, 2], [3]]), JSON, 400),
        ("/v1/completions", j(prompt=[5] * (MAX_MODEL_LEN + 1)), JSON, 400),
        ("/v1/completions", j(prompt=[5] * 200_000), JSON, 400),
        ("/v1/completions", j(prompt="\ud800 lone surrogate"), JSON, 400),
        ("/v1/completions", j(stop_token_ids=[1] * 1000 + ["x"]), JSON, 400),
        ("/v1/completions", j(stop=["a"] * 1000 + [1]), JSON, 400),
        # Near the body limit (1 MB here, 5 MB for SmolLM2): refused by their length before any item is checked.
        ("/v1/completions", compact(stop_token_ids=[1] * 500_000 + ["x"]), JSON, 400),
        ("/v1/completions", compact(stop=["a"] * 250_000), JSON, 400),
        ("/v1/completions", compact(logit_bias={str(i): 1 for i in range(90_000)}), JSON, 400),
        ("/v1/completions", j(frequency_penalty=3.0), JSON, 400),
        ("/v1/completions", j(logit_bias={"1": "x"}), JSON, 400),
        ("/v1/completions", j(logit_bias={"x": 1}), JSON, 400),
        ("/v1/completions", j(logit_bias={str(10**9): 1}), JSON, 400),
        ("/v1/completions", j(stream=True, prompt=[5] * 300), JSON, 400),
        ("/v1/chat/completions", json.dumps({"model": "tiny", "messages": [1] * 100_000}).encode(), JSON, 400),
        ("/v1/chat/completions", json.dumps({"model": "tiny", "messages": [{"role": "user"}]}).encode(), JSON, 400),
        ("/v1/chat/completions", json.dumps({"model": "tiny", "messages": "hi"}).encode(), JSON, 400),
        ("/v1/chat/completions", json.dumps({"model": "tiny", "tools": [{"type": "function"}],
                                             "messages": [{"role": "user", "content": "hi"}]}).encode(), JSON, 400),
        ("/v1/nothing", j(), JSON, 404),
    ]
    return cases


async def _neighbour(base, started, gaps):
    """One streaming request: (token ids, finish reason); appends (arrival time, gap since the previous chunk) of
    each chunk to ``gaps``."""
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": NEIGHBOUR_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    got, finish, last = [], None, None
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append((now, now - last))
                    last = now
                    choice = json.loads(line[6:])["choices"][0]
                    got += choice["token_ids"]
                    finish = choice.get("finish_reason") or finish
                    started.set()
    return got, finish


async def _disconnect_storm(base, n):
    body = {"model": "tiny", "prompt": [7, 8, 9], "max_tokens": 200, "ignore_eos": True}

    async def streaming(client):
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
            async for _line in resp.aiter_lines():
                break  # leave after the first line

    async def whole(client):
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.05))

    async with httpx.AsyncClient(base_url=base, timeout=30, limits=httpx.Limits(max_connections=2 * n)) as client:
        await asyncio.gather(*[streaming(client) for _ in range(n)], *[whole(client) for _ in range(n)])


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records = []

    def emit(self, record) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def server():
    ref = LLM("tiny", num_gpu_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN)
    async_llm = AsyncLLM(LLMEngine(ref.llm_engine.model, num_gpu_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN))
    srv = ServerThread(build_app(async_llm, "tiny"))
    yield async_llm, srv
    srv.stop()
    async_llm.shutdown()


def test_adversarial_inputs_disconnects_and_oversized_bodies_beside_a_stream(server):
    async_llm, srv = server
    errors = _Errors()
    for name in ("uvicorn.error", "uvicorn", "asyncio", "minivllm.serve"):
        logging.getLogger(name).addHandler(errors)
    cases = _bad_inputs()
    huge = b'{"model": "tiny", "max_tokens": 2, "prompt": [' + b"1," * 25_000_000 + b"1]}"  # 50 MB

    async def chunked():  # 5 MB with no Content-Length: the size is known only while reading
        yield b'{"model": "tiny", "max_tokens": 2, "prompt": "'
        for _ in range(80):
            yield b"a" * 65536
        yield b'"}'

    async def neighbours(stop, started, results, gaps):
        # One stream after another for the whole attack (a tiny-model stream lasts about a second).
        while not stop.is_set() and len(results) < 200:
            results.append(await _neighbour(srv.base, started, gaps))

    bad, storm = "bad inputs and oversized bodies", "disconnect storm"
    bounds = {bad: 0.5, storm: 1.5}  # 30 requests arriving at once share the engine's steps with the neighbour

    async def attack(names):
        stop, started, results, gaps, phases = asyncio.Event(), asyncio.Event(), [], [], []
        neighbour = asyncio.create_task(neighbours(stop, started, results, gaps))
        await asyncio.wait_for(started.wait(), 30)
        answers, big, streamed = [], None, None
        async with httpx.AsyncClient(base_url=srv.base, timeout=60) as client:
            if bad in names:
                t = time.perf_counter()
                for path, body, headers, _status in cases:
                    answers.append(await client.post(path, content=body, headers=headers))
                big = await client.post("/v1/completions", content=huge, headers=JSON)
                streamed = await client.post("/v1/completions", content=chunked(), headers=JSON)
                phases.append((bad, t, time.perf_counter()))
            if storm in names:
                t = time.perf_counter()
                for _ in range(3):
                    await _disconnect_storm(srv.base, 10)
                phases.append((storm, t, time.perf_counter()))
        await asyncio.sleep(0.3)  # a chunk after the last phase, to see a stall that outlasted it
        stop.set()
        await asyncio.wait_for(neighbour, 60)
        # The longest gap of a neighbour chunk arriving during each phase (or just after it).
        longest = {name: max([g for at, g in gaps if t_start <= at <= t_end + 1.0] or [0.0])
                   for name, t_start, t_end in phases}
        return answers, big, streamed, results, longest

    try:
        t0 = time.monotonic()
        answers, big, streamed, results, longest = asyncio.run(asyncio.wait_for(attack((bad, storm)), 120))
        elapsed = time.monotonic() - t0
        # The module's rule: a phase that missed its gap bound runs again, and only a second miss fails.
        again = [name for name in bounds if longest[name] >= bounds[name]]
        retried = {}
        if again:
            print(f"adversarial: longest gaps {longest} missed a bound; running {again} again")
            *_x, more_results, retried = asyncio.run(asyncio.wait_for(attack(again), 120))
            results += more_results
    finally:
        for name in ("uvicorn.error", "uvicorn", "asyncio", "minivllm.serve"):
            logging.getLogger(name).removeHandler(errors)

    for (path, body, headers, status), r in zip(cases, answers):
        where = f"{path} {body[:60]!r} {headers}"
        assert r.status_code == status, (where, r.status_code, r.text[:200])
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == status, (where, err)
        assert len(r.content) < 2000, (where, len(r.content))
    assert big.status_code == 413 and big.json()["error"]["code"] == 413
    assert streamed.status_code == 413, streamed.text[:200]
    for tokens, finish in results:
        assert len(tokens) == NEIGHBOUR_TOKENS and finish == "length"
    for name, bound in bounds.items():
        assert retried.get(name, longest[name]) < bound, (name, "first run", longest, "second run", retried)
    assert not errors.records, [r.getMessage() for r in errors.records][:3]
    deadline = time.monotonic() + 15
    engine = async_llm.engine
    while engine.has_unfinished_requests() or engine.kv_cache_manager.num_free_blocks != NUM_BLOCKS:
        assert time.monotonic() < deadline, "the engine kept requests or blocks after the attack"
        time.sleep(0.05)
    metrics = httpx.get(srv.base + "/metrics", timeout=10).text
    assert 'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0' in metrics
    assert httpx.get(srv.base + "/health", timeout=10).status_code == 200
    print(f"adversarial: {len(cases)} bad inputs, 2 oversized bodies, 60 disconnects in {elapsed:.1f} s beside "
          f"{len(results)} neighbour streams; longest gaps (s): {longest}, run again: {retried}")
