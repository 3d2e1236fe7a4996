"""The OpenAI-compatible server under misuse (issue 28): latency of keep-alive requests, disconnects, inputs a
tokenizer or JSON parser chokes on, oversized bodies, a dead engine, the server's own flags.

Each server runs in-process (uvicorn in a thread, loopback only, a port the OS picks) on the tiny model; every wait
is bounded in time and every loop in count.

Wall-clock bounds (a neighbour stream's longest gap under 0.5 s, keep-alive latency) fail only when they fail twice
running (``measured_twice``): the suite runs on two xdist workers beside notebooks on two shared cores, where one
measurement was seen at 0.59 s (load 4.3) without any stall. A stall reproduces: issue 28's were 0.5-52 s every
time, and a stall put back on purpose fails both measurements (0.8 s of synchronous work on the event loop for
each body over 500 KB, as the checks issue 28 fixed did: the oversized-body test missed its bound twice; with the
prompt and message checks of d24ca77 and a32873f reverted, its neighbour stalled 13.9 s).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
import httpx  # noqa: E402

from minivllm import LLM, LLMEngine, SamplingParams  # noqa: E402
from minivllm.engine.async_llm import AsyncLLM  # noqa: E402
from minivllm.entrypoints.openai.api_server import build_app, create_server_socket  # noqa: E402
from tests.entrypoints.test_serving import ServerThread  # noqa: E402

NUM_BLOCKS, MAX_MODEL_LEN = 64, 256


def measured_twice(measure, missed, what):
    """``measure()``'s result, measured a second time when ``missed(result)`` says a wall-clock bound was missed;
    the caller asserts its bounds on the result returned, so a bound fails only when both measurements miss it.

    Machine load (two xdist workers and notebooks on two cores) slows one measurement now and then; a real stall
    (a request holding the event loop or the engine thread) slows every one, and so still fails."""
    result = measure()
    if missed(result):
        print(f"{what}: first measurement missed its bound ({result!r:.300}); measuring again")
        result = measure()
    return result


@pytest.fixture(scope="module")
def tiny():
    """``(AsyncLLM, server)`` on the tiny model (token-id prompts, no tokenizer)."""
    ref = LLM("tiny", num_gpu_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN)
    async_llm = AsyncLLM(LLMEngine(ref.llm_engine.model, num_gpu_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN))
    server = ServerThread(build_app(async_llm, "tiny"))
    yield async_llm, server
    server.stop()
    async_llm.shutdown()


def test_keep_alive_requests_are_not_delayed_by_nagle(tiny):
    # Every request after the first on one connection used to wait ~40 ms for the client's delayed ACK.
    _async_llm, server = tiny

    def measure():
        with httpx.Client(base_url=server.base, timeout=10) as client:
            assert client.get("/v1/models").status_code == 200  # opens the connection
            times = []
            for _ in range(8):
                t0 = time.perf_counter()
                assert client.get("/v1/models").status_code == 200
                times.append(time.perf_counter() - t0)
        return sorted(times)

    # Nagle makes every one of them >= 40 ms, each time; a busy machine may slow some, not all, and not twice.
    times = measured_twice(measure, lambda t: not (t[0] < 0.005 and t[len(t) // 2] < 0.02), "keep-alive latency")
    assert times[0] < 0.005 and times[len(times) // 2] < 0.02, times


def test_with_cancellation_answers_499_when_the_client_left():
    # The work was cancelled but not yet finished when checked: work.result() raised InvalidStateError (a
    # traceback per disconnect) instead of answering 499.
    from minivllm.entrypoints.openai.api_server import with_cancellation

    class Gone:
        async def receive(self):
            return {"type": "http.disconnect"}

    cleaned = []

    async def work():
        try:
            await asyncio.sleep(30)
        finally:
            cleaned.append(True)

    async def main():
        resp = await asyncio.wait_for(with_cancellation(Gone(), work()), 10)
        await asyncio.sleep(0)
        return resp

    resp = asyncio.run(main())
    assert resp.status_code == 499 and cleaned == [True]


def _post(server, body, path="/v1/completions", **kw):
    """POST ``body`` (bytes as they are; else JSON with non-ASCII escaped, which lets a lone surrogate through)."""
    if not isinstance(body, bytes):
        body = json.dumps(body).encode()
    kw.setdefault("headers", {"content-type": "application/json"})
    return httpx.post(server.base + path, content=body, timeout=60, **kw)


def _assert_error(r, status, param=None, contains=""):
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status, err
    assert err["param"] == param and contains in err["message"], err
    return err


def test_error_messages_echo_a_bounded_part_of_the_bad_input(tiny):
    # vLLM truncates the echoed value; a 500 KB bad field used to come back whole.
    _async_llm, server = tiny
    big = "x" * 500_000
    for body in ({"prompt": [1, 2], "temperature": big}, {"prompt": [1, 2], "stop_token_ids": [big]},
                 {"prompt": [1, 2], "max_tokens": [1] * 100_000}, {"prompt": big + "\ud800", "max_tokens": 2}):
        r = _post(server, body)
        assert r.status_code == 400 and len(r.content) < 2000, (r.status_code, len(r.content))


def test_bodies_json_cannot_hold_get_openai_errors(tiny):
    # FastAPI answers these with {"detail": ...}; vLLM's handlers give its own error body.
    _async_llm, server = tiny
    for body in (b'{"prompt": [1, 2], "model": "\xff\xfe"}', b'{"prompt": [1], "max_tokens": ' + b"9" * 5000 + b"}"):
        err = _assert_error(_post(server, body), 400)
        assert "not valid JSON" in err["message"] and len(err["message"]) < 1000, err
    # Nested 100,000 deep: refused by the body guard's container count before any parser sees it.
    _assert_error(_post(server, b"[" * 100_000 + b"]" * 100_000), 400, None, "opens 100000 JSON arrays and objects")
    _assert_error(httpx.get(server.base + "/v1/nothing", timeout=10), 404)


def test_content_type_is_checked_by_the_server(tiny):
    # Refusing non-JSON bodies must not depend on FastAPI's default (strict_content_type, FastAPI >= 0.132).
    _async_llm, server = tiny
    body = json.dumps({"prompt": [1, 2], "max_tokens": 2}).encode()
    for headers in ({"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}, {}):
        r = httpx.post(server.base + "/v1/completions", content=body, headers=headers, timeout=30)
        _assert_error(r, 400, None, "Only 'application/json' is allowed")
    assert _post(server, body, headers={"content-type": "application/json; charset=utf-8"}).status_code == 200


@pytest.mark.parametrize("field,value", [("response_format", {"type": "json_object"}),
                                         ("tools", [{"type": "function", "function": {"name": "f"}}]),
                                         ("tool_choice", "required")])
def test_fields_the_engine_cannot_honour_are_refused(tiny, field, value):
    _async_llm, server = tiny
    _assert_error(_post(server, {"prompt": [1, 2], "max_tokens": 2, field: value}), 400, field, field)
    neutral = {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none"}[field]
    assert _post(server, {"prompt": [1, 2], "max_tokens": 2, field: neutral}).status_code == 200


async def _neighbour(base, started, path="/v1/completions", max_tokens=200):
    """A streaming request; returns (token ids, finish reason, longest gap between two chunks in seconds)."""
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    got, finish, gap = [], None, 0.0
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        async with client.stream("POST", path, json=body) as resp:
            assert resp.status_code == 200
            last = None
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    now = time.perf_counter()
                    if last is not None:
                        gap = max(gap, now - last)
                    last = now
                    choice = json.loads(line[6:])["choices"][0]
                    got += choice["token_ids"]
                    finish = choice.get("finish_reason") or finish
                    started.set()
    return got, finish, gap


def test_oversized_bodies_neither_stall_other_streams_nor_flood_errors(tiny):
    # A 50 MB body of token ids was parsed and checked on the event loop (and the engine thread), freezing every
    # stream for seconds; a 1 MB list of ids ending in a string made pydantic build a million errors (~10 s).
    async_llm, server = tiny
    ids_50mb = b'{"model": "tiny", "max_tokens": 2, "prompt": [' + b"1," * 25_000_000 + b"1]}"
    ids_then_str = b'{"model": "tiny", "max_tokens": 2, "prompt": [' + b"1," * 500_000 + b'"x"]}'
    msgs = b'{"model": "tiny", "messages": [' + b"1," * 500_000 + b"1]}"

    async def main():
        started = asyncio.Event()
        neighbour = asyncio.create_task(_neighbour(server.base, started))
        await asyncio.wait_for(started.wait(), 30)
        answers = []
        async with httpx.AsyncClient(base_url=server.base, timeout=60) as client:
            for path, body in (("/v1/completions", ids_50mb), ("/v1/completions", ids_then_str),
                               ("/v1/chat/completions", msgs)):
                t0 = time.perf_counter()
                r = await client.post(path, content=body, headers={"content-type": "application/json"})
                answers.append((r.status_code, r.json(), time.perf_counter() - t0))
        overlapped = not neighbour.done()  # the bad requests were answered while the neighbour streamed
        return answers, await asyncio.wait_for(neighbour, 60), overlapped

    # The rule of this module's docstring: a gap of 0.5 s, an answer of 5 s, or a neighbour that ended before the
    # answers (so its gaps do not cover them) fails only when measured twice.
    answers, (tokens, finish, gap), overlapped = measured_twice(
        lambda: asyncio.run(main()), lambda r: r[1][2] >= 0.5 or any(t >= 5 for *_x, t in r[0]) or not r[2],
        "oversized bodies beside a stream")
    assert answers[0][0] == 413 and answers[0][1]["error"]["type"] == "RequestEntityTooLargeError", answers[0][:2]
    # Refused by its length before any id is looked at (test_a_token_id_prompt_over_max_model_len_...).
    assert answers[1][0] == 400 and "prompt length (500001 tokens)" in answers[1][1]["error"]["message"]
    assert answers[2][0] == 400 and answers[2][1]["error"]["param"] == "messages"
    assert all(t < 5 for *_x, t in answers), [t for *_x, t in answers]
    assert len(tokens) == 200 and finish == "length"
    assert gap < 0.5, gap
    assert overlapped, "the neighbour stream ended before the bad requests were answered"


def test_prompt_over_max_model_len_is_refused_before_the_engine(tiny, monkeypatch):
    async_llm, server = tiny
    seen = []
    add = async_llm.engine.add_request
    monkeypatch.setattr(async_llm.engine, "add_request", lambda rid, prompt, *a, **k: (seen.append(rid),
                                                                                      add(rid, prompt, *a, **k))[1])
    for stream in (False, True):
        _assert_error(_post(server, {"prompt": [5] * (MAX_MODEL_LEN + 1), "stream": stream}), 400, "prompt",
                      f"max_model_len ({MAX_MODEL_LEN})")
    assert seen == []
    assert _post(server, {"prompt": [5] * 10, "max_tokens": 1}).status_code == 200 and len(seen) == 1


def _raw_post(server, body: bytes) -> bytes:
    """The response's head, from a request sent over a plain socket (``Connection: close``)."""
    import socket

    host, port = server.base.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
    return reply


def test_rejected_prompts_are_freed_without_a_garbage_collection(tiny):
    # The engine's ValueError came back through a future held by a frame in its own traceback (and a task held
    # by with_cancellation's frame): reference cycles that kept each rejected prompt until a collection ran.
    import gc

    _async_llm, server = tiny
    marker = 433
    prompts = [[marker] * 100 + [600],  # out of the vocabulary: refused by the engine thread
               [marker] * (MAX_MODEL_LEN + 50),  # too long: refused by the server
               [marker] * 100 + ["x"]]  # refused by the request's validation (FastAPI's RequestValidationError)
    # Not UTF-8: FastAPI's HTTPException, raised from a local of the frame its traceback holds (so is this body).
    not_utf8 = b'{"prompt": [' + b"433,\t" * 100 + b'1], "model": "\xff"}'
    from minivllm.entrypoints.openai.protocol import CompletionRequest

    gc.collect()
    gc.disable()
    try:
        for stream in (False, True):
            for prompt in [*prompts, "a text: the tiny model has no tokenizer"]:
                assert _post(server, {"prompt": prompt, "max_tokens": 2, "stream": stream}).status_code == 400
            assert _raw_post(server, not_utf8).startswith(b"HTTP/1.1 400 ")  # no client object to hold the body
        time.sleep(0.2)
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        leaked = [o for o in gc.garbage for r in [o, *gc.get_referents(o)]
                  if isinstance(r, CompletionRequest)
                  or isinstance(r, list) and len(r) >= 100 and r[0] == marker and r[1] == marker
                  or isinstance(r, bytes) and b"433,\t" * 100 in r]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not leaked, f"{len(leaked)} objects in reference cycles hold a rejected prompt"


def test_metrics_gauges_after_aborts_and_vllm_families(tiny):
    async_llm, server = tiny
    body = {"model": "tiny", "prompt": [1, 2, 3, 4], "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", server.base + "/v1/completions", json=body) as resp:
            for i, _line in enumerate(resp.iter_lines()):
                if i >= 6:
                    break
    deadline = time.monotonic() + 10
    while async_llm.engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert async_llm.stats.num_running_reqs >= 0  # the engine's own snapshot may still count the aborted one
    text = httpx.get(server.base + "/metrics", timeout=10).text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("vllm:") and "{" in line}
    assert values["vllm:num_requests_running"] == 0 and values["vllm:num_requests_waiting"] == 0
    assert values["vllm:kv_cache_usage_perc"] == 0
    for family in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:e2e_request_latency_seconds_count",
                   "vllm:request_success_total", "vllm:time_to_first_token_seconds_count",
                   "vllm:inter_token_latency_seconds_count", "vllm:num_preemptions_total"):
        assert family in values, family
    assert 'finished_reason="abort"' in text


def test_real_tokenizer_lone_surrogate_and_text_length(real_llm):
    # A lone surrogate made the tokenizer raise TypeError on the engine thread: a 500 (which openai retries).
    eng = real_llm.llm_engine
    async_llm = AsyncLLM(LLMEngine(eng.model, tokenizer=eng.tokenizer, num_gpu_blocks=64, max_model_len=512))
    server = ServerThread(build_app(async_llm, "m"))
    try:
        bad = "Hello \ud800 world"
        for stream in (False, True):
            _assert_error(_post(server, {"prompt": bad, "max_tokens": 2, "stream": stream}), 400, "prompt",
                          "lone surrogate U+D800")
            _assert_error(_post(server, {"messages": [{"role": "user", "content": bad}], "max_tokens": 2,
                                         "stream": stream}, "/v1/chat/completions"), 400, "messages", "surrogate")
        # Longer than max_model_len tokens of the longest vocabulary entry: refused without tokenizing it.
        from minivllm.entrypoints.openai.serving_engine import max_chars_per_token
        limit = 512 * max_chars_per_token(eng.tokenizer)
        _assert_error(_post(server, {"prompt": "a" * (limit + 1)}), 400, "prompt", "characters")
        _assert_error(_post(server, {"prompt": "hello " * 600}), 400, "prompt", "max_model_len (512)")
        r = _post(server, {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0,
                           "return_token_ids": True})
        want = real_llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=3),
                                 use_tqdm=False)[0]
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want.outputs[0].token_ids
        assert r.json()["prompt_token_ids"] == want.prompt_token_ids
    finally:
        server.stop()
        async_llm.shutdown()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the engine thread raises
def test_dead_engine_sends_error_events_and_the_server_exits_non_zero(tiny):
    # An engine whose loop raised ended each stream like a normal abort (200, "abort", [DONE]) and the server
    # answered 503 for ever; vLLM sends an error and shuts the server down.
    from minivllm.entrypoints.openai.api_server import run_server

    ref_async, _server = tiny
    engine = LLMEngine(ref_async.engine.model, num_gpu_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN)
    step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) > 20:
            raise RuntimeError("a worker died")
        return step()

    engine.step = failing_step
    async_llm = AsyncLLM(engine)
    sock = create_server_socket("127.0.0.1", 0)
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    rc = []
    thread = threading.Thread(target=lambda: rc.append(run_server(async_llm, "tiny", "127.0.0.1", 0, sock=sock)),
                              daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while True:
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.05)

    async def main():
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 200, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            async def stream():
                lines = []
                async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
                    async for line in resp.aiter_lines():
                        if line:
                            lines.append(line)
                return lines
            return await asyncio.gather(stream(), client.post("/v1/completions", json=body))

    lines, whole = asyncio.run(main())
    assert lines[-1] == "data: [DONE]"
    err = json.loads(lines[-2][6:])["error"]
    assert err["code"] == 500 and "engine died" in err["message"], lines[-3:]
    assert all('"abort"' not in line for line in lines)
    assert whole.status_code == 500 and "engine died" in whole.json()["error"]["message"]
    thread.join(15)
    assert not thread.is_alive() and rc == [1]


def test_server_options_docs_and_cors(tiny):
    async_llm, _server = tiny
    server = ServerThread(build_app(async_llm, "tiny", "from-env", disable_fastapi_docs=True,
                                    allowed_origins=["http://app.example"]))
    try:
        assert httpx.get(server.base + "/v1/models", timeout=10).status_code == 401
        ok = httpx.get(server.base + "/v1/models", headers={"Authorization": "Bearer from-env",
                                                                "Origin": "http://app.example"}, timeout=10)
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://app.example"
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(server.base + path, timeout=10).status_code == 404
        pre = httpx.options(server.base + "/v1/completions", timeout=10, headers={
            "Origin": "http://app.example", "Access-Control-Request-Method": "POST"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://app.example"
        pre = httpx.options(server.base + "/v1/completions", timeout=10, headers={
            "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in pre.headers
    finally:
        server.stop()
    server = ServerThread(build_app(async_llm, "tiny"))
    try:
        assert httpx.get(server.base + "/docs", timeout=10).status_code == 200
        r = httpx.get(server.base + "/v1/models", headers={"Origin": "http://app.example"}, timeout=10)
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    finally:
        server.stop()


def test_server_cli_args_have_vllms_names(monkeypatch):
    import argparse

    from minivllm.entrypoints.openai.cli_args import add_server_args, api_key, app_options

    parser = add_server_args(argparse.ArgumentParser())
    args = parser.parse_args(["--allowed-origins", '["http://a.example"]', "--allowed-methods", "GET,POST",
                              "--allow-credentials", "--disable-fastapi-docs"])
    assert app_options(args) == dict(allowed_origins=["http://a.example"], allowed_methods=["GET", "POST"],
                                     allowed_headers=["*"], allow_credentials=True, disable_fastapi_docs=True)
    defaults = parser.parse_args([])
    assert (defaults.host, defaults.port, defaults.api_key, defaults.allowed_origins) == ("127.0.0.1", 8000, None, [])
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert api_key(defaults) is None
    monkeypatch.setenv("VLLM_API_KEY", "from-env")  # vLLM's fallback: the key need not be visible in ps
    assert api_key(defaults) == "from-env" and api_key(parser.parse_args(["--api-key", "cli"])) == "cli"


def test_serve_command_line_has_vllms_server_and_engine_flags(capsys):
    from minivllm.__main__ import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    for flag in ("--allowed-origins", "--disable-fastapi-docs", "--tensor-parallel-size", "--scheduler-cls",
                 "$VLLM_API_KEY"):
        assert flag in text, flag


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the loop re-raises, by design
def test_dead_error_names_the_cause_without_keeping_its_frames():
    engine = LLMEngine("tiny", num_gpu_blocks=8)

    def boom():
        raise RuntimeError("step failed")

    engine.step = boom
    client = AsyncLLM(engine)
    assert client.is_running and client.dead_error is None

    async def one():
        q = await client.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2))
        return await q.get()

    out = asyncio.run(one())
    client._thread.join(5)
    assert out.finished and not client.is_running
    assert "RuntimeError('step failed')" in str(client.dead_error)
    assert client.dead_error.__traceback__ is None  # the failed step's frames are not kept alive by it


def test_metrics_of_a_whole_response_come_from_the_engine(tiny):
    # A non-streaming response has one output, the final one: the server alone cannot see its first token. Its
    # TTFT is the engine's (RequestOutput.metrics), below the request's e2e, and its 20 tokens add 19 gaps.
    async_llm, server = tiny

    def values():
        text = httpx.get(server.base + "/metrics", timeout=10).text
        return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("vllm:") and "{" in line}

    before = values()
    body = {"model": "tiny", "prompt": list(range(1, 41)), "max_tokens": 20, "ignore_eos": True}
    assert httpx.post(server.base + "/v1/completions", json=body, timeout=60).status_code == 200
    after = values()
    ttft = after["vllm:time_to_first_token_seconds_sum"] - before["vllm:time_to_first_token_seconds_sum"]
    e2e = after["vllm:e2e_request_latency_seconds_sum"] - before["vllm:e2e_request_latency_seconds_sum"]
    assert after["vllm:time_to_first_token_seconds_count"] - before["vllm:time_to_first_token_seconds_count"] == 1
    assert 0 < ttft < e2e
    assert after["vllm:inter_token_latency_seconds_count"] - before["vllm:inter_token_latency_seconds_count"] == 19
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == 40


def test_duplicate_content_headers_and_an_endless_declared_body_are_refused(tiny):
    import socket

    _, server = tiny
    host, port = server.base.split("//")[1].split(":")
    body = b'{"model": "tiny", "prompt": [1], "max_tokens": 1}'
    two = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n" % len(body)) + body
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(two)
        reply = ""
        while "}" not in reply:  # the head and the JSON body may come in two reads
            reply += s.recv(65536).decode("latin-1")
    assert reply.startswith("HTTP/1.1 400") and "2 content-type headers" in reply
    # Content-Length far past any body: the server answers 413 after reading a bounded amount, not at the end.
    endless = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" \
              b"Content-Length: 99999999999999999999\r\n\r\n"
    t0 = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=20) as s:
        s.sendall(endless)
        chunk = b"[" * 65536
        reply = b""
        try:
            while time.monotonic() - t0 < 15 and not reply:
                s.sendall(chunk)
                s.settimeout(0.01)
                try:
                    reply = s.recv(65536)
                except socket.timeout:
                    pass
                s.settimeout(20)
        except (BrokenPipeError, ConnectionResetError):
            pass
    assert b"413" in reply.split(b"\r\n", 1)[0], reply[:200]
    assert time.monotonic() - t0 < 15


@pytest.mark.parametrize("body, param", [
    ({"prompt": [1], "logit_bias": {"9" * 4301: 1}}, "logit_bias"),  # int() refuses it: was a 500
    ({"prompt": [1], "use_beam_search": True}, "use_beam_search"),
    ({"prompt": [1], "cache_salt": "tenant-a"}, "cache_salt"),
    ({"prompt": [1], "stream_options": {"include_usage": True}}, "stream_options"),  # without stream=True
    ({"prompt": [1], "stop": ["\ud800"]}, "stop"),
    ({"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1}, "prompt_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
])
def test_second_review_inputs_get_a_400_naming_the_field(tiny, body, param):
    _, server = tiny
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    resp = httpx.post(server.base + path, content=json.dumps({"model": "tiny", "max_tokens": 1, **body}),
                      headers={"Content-Type": "application/json"}, timeout=30)
    assert resp.status_code == 400, resp.text[:300]
    assert resp.json()["error"]["param"] == param, resp.text[:300]


def test_aborting_a_parent_removes_its_children_in_one_pass():
    # vLLM 0.32's finish_requests removes every aborted request from each queue at once; one call per child made an
    # n=16384 abort quadratic (12 s of a frozen engine thread in the review).
    eng = LLMEngine("tiny", num_gpu_blocks=64, block_size=4, max_num_seqs=4)
    eng.add_request("p", [1, 2, 3], SamplingParams(n=40, temperature=1.0, max_tokens=4))
    eng.step()  # four children run, 36 wait
    calls = []
    remove = eng.scheduler.waiting.remove_requests
    eng.scheduler.waiting.remove_requests = lambda rs: calls.append(len(list(rs))) or remove(rs)
    out = eng.abort_request("p")
    assert calls == [36] and not eng.has_unfinished_requests() and eng.kv_cache_manager.num_free_blocks == 64
    assert len(out) == 1 and out[0].finished


def test_a_token_id_prompt_over_max_model_len_is_refused_before_its_ids_are_checked(tiny, monkeypatch):
    # A body just under the size limit holds millions of 2-byte ids ("1,"): on the real model's default limit
    # (5 MB) checking each id, then pydantic's list[int], held the event loop 0.45 s after json.loads' 0.3 s (a
    # neighbour's gap of 0.78 s). The length is known from len(): an over-long list is refused before either.
    from minivllm.entrypoints.openai import protocol

    _, server = tiny
    scanned = []
    first_bad = protocol._first_bad
    monkeypatch.setattr(protocol, "_first_bad", lambda items, ok: scanned.append(len(items)) or first_bad(items, ok))
    for prompt in ([1] * 300_000, [1] * 300_000 + ["x"], [[1] * 300_000]):
        for stream in (False, True):
            _assert_error(_post(server, {"model": "tiny", "prompt": prompt, "stream": stream}), 400, "prompt",
                          f"is longer than max_model_len ({MAX_MODEL_LEN})")
    assert all(n < 300_000 for n in scanned), scanned
    assert _post(server, {"model": "tiny", "prompt": [5] * (MAX_MODEL_LEN - 1), "max_tokens": 1}).status_code == 200


def test_repeated_stop_token_ids_are_kept_once(tiny):
    # A 5 MB body holds 2.4 million stop_token_ids: the scheduler's check_stop scanned them all after every token
    # (27 ms a step on this CPU, for every request in the batch) and the sampler copied them while min_tokens
    # held. Only distinct ids can stop a request, so each is kept once (as vLLM 0.32's SamplingParams does); the
    # server refuses more than the vocabulary's size outright (test_long_stop_and_logit_bias_lists_...).
    sp = SamplingParams(stop_token_ids=[7] * 100_000 + [3, 7, 3, 9], max_tokens=4)
    assert sp.stop_token_ids == [7, 3, 9] and sp.clone().stop_token_ids == [7, 3, 9]
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[1, [2]])
    async_llm, server = tiny
    seen = []
    add = async_llm.engine.add_request
    async_llm.engine.add_request = lambda rid, prompt, params, *a, **k: (seen.append(params), add(rid, prompt, params,
                                                                                                 *a, **k))[1]
    try:
        r = _post(server, {"model": "tiny", "prompt": [1, 2], "max_tokens": 3, "stop_token_ids": [600] * 500})
    finally:
        del async_llm.engine.add_request
    assert r.status_code == 400 and "600" in r.json()["error"]["message"]  # outside the tiny vocabulary, once
    assert [p.stop_token_ids for p in seen] == [[600]]


def test_more_messages_than_max_model_len_are_refused_before_each_is_validated(tiny, monkeypatch):
    # 160,000 empty messages (a 4.6 MB body): pydantic built a ChatMessage for each on the event loop (0.64 s), then
    # the template rendered them all on the tokenizer thread (7 s in all, a neighbour's gap of 2.2 s). A chat
    # template spends at least one token on each message, so more messages than max_model_len cannot fit.
    from minivllm.entrypoints.openai import protocol

    _, server = tiny
    scanned = []
    first_bad = protocol._first_bad
    monkeypatch.setattr(protocol, "_first_bad", lambda items, ok: scanned.append(len(items)) or first_bad(items, ok))
    # 300 messages: within the body guard's container bound (4 x 256 + 1024), past max_model_len's message bound
    # (30,000 are now refused earlier still, by the guard: test_bodies_of_many_tiny_containers_...).
    body = json.dumps({"model": "tiny", "messages": [{"role": "user"}] * 300}, separators=(",", ":"))
    _assert_error(_post(server, body.encode(), "/v1/chat/completions"), 400, "messages",
                  f"300 messages cannot fit in max_model_len ({MAX_MODEL_LEN})")
    assert all(n < 300 for n in scanned), scanned
    # Within the bound: on to the next check (the tiny model has no chat template).
    _assert_error(_post(server, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}] * MAX_MODEL_LEN},
                        "/v1/chat/completions"), 400, "messages", "no tokenizer")


def test_bodies_of_many_tiny_containers_are_refused_before_they_are_parsed(tiny):
    # A 2 MB body of 700,000 empty lists (as the prompt, in stop, or in a field nobody reads) held the event loop,
    # and every other stream, for 0.8-3.2 s while json.loads and pydantic built an object for each. The guard counts
    # the containers on the raw bytes first; brackets inside strings do not count.
    from minivllm.entrypoints.openai import api_server

    _, server = tiny
    limit = 4 * MAX_MODEL_LEN + 1024
    for body in ({"model": "tiny", "prompt": [[]] * (limit + 1)}, {"model": "tiny", "prompt": [1], "stop": [[]] * limit},
                 {"model": "tiny", "prompt": [1], "foo": [[[]]] * 1100}):
        # The guard's message (param None), not the validators' (param "prompt" / "stop"): refused before parsing.
        _assert_error(_post(server, json.dumps(body).encode()), 400, None, "JSON arrays and objects, more than the "
                      f"{limit} that a request within max_model_len ({MAX_MODEL_LEN}) can need")
    assert api_server.count_json_containers(json.dumps({"prompt": "[{" * 5000, "s": ["]"]}).encode()) == 2
    # Within the bound: on to the ordinary checks.
    _assert_error(_post(server, {"model": "tiny", "prompt": [[]] * 100}), 400, "prompt")
    r = _post(server, {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2, "logit_bias": {"5": 1.0}})
    assert r.status_code == 200, r.text[:300]


@pytest.mark.parametrize("seed, status", [(-1, 200), (-2**63, 200), (2**63 - 1, 200), (-5, 200), (2**63, 400),
                                          (-2**63 - 1, 400)])
def test_seed_takes_vllms_int64_range(tiny, seed, status):
    # vLLM 0.32: seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX) (completion/protocol.py); -1 = none.
    _, server = tiny
    r = _post(server, {"model": "tiny", "prompt": [1, 2], "max_tokens": 2, "temperature": 1.0, "seed": seed})
    assert r.status_code == status, r.text[:300]
    if status == 400:
        assert r.json()["error"]["param"] == "seed"


def _scanned(monkeypatch):
    """The lengths of the lists ``protocol._first_bad`` looks at item by item, recorded as they come."""
    from minivllm.entrypoints.openai import protocol

    scanned = []
    first_bad = protocol._first_bad
    monkeypatch.setattr(protocol, "_first_bad", lambda items, ok: scanned.append(len(items)) or first_bad(items, ok))
    return scanned


def test_long_stop_and_logit_bias_lists_are_refused_by_their_length_first(tiny, monkeypatch):
    # Near the real model's 5 MB body limit: 1.3 million stop strings, 2.6 million stop_token_ids (ending in a
    # string) or 470,000 logit_bias keys held the event loop (and the engine thread, for logit_bias) while each item
    # was checked: a neighbour stream's longest gap of 0.9-1.1 s, 0.5-0.7 s and 1.8-2.3 s, live on SmolLM2 at load
    # 5 (see protocol.vocab_size_limit for the numbers after). Now
    # ``stop`` takes at most vLLM's 4 strings (VLLM_MAX_STOP_STRINGS) and the two id lists at most the vocabulary's
    # size (512 for tiny), checked by len() before any item is.
    _, server = tiny
    scanned = _scanned(monkeypatch)
    vocab = 512
    over = {"stop": ["a"] * 100_000 + [1], "stop_token_ids": [1] * 100_000 + ["x"],
            "logit_bias": {str(i): 1 for i in range(80_000)}}  # 0.95 MB, under tiny's body limit
    limits = {"stop": 4, "stop_token_ids": vocab, "logit_bias": vocab}
    for path, extra in (("/v1/completions", {"prompt": [1, 2]}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        for field, value in over.items():
            for stream in (False, True):
                body = {"model": "tiny", "max_tokens": 2, "stream": stream, field: value, **extra}
                _assert_error(_post(server, body, path), 400, field,
                              f"{field} has 100001 entries, more than the {limits[field]} allowed"
                              if field != "logit_bias" else
                              f"{field} has 80000 entries, more than the {limits[field]} allowed")
    assert all(n < 100_000 for n in scanned), scanned
    # One past each bound is refused by the same check; at the bound the request goes on.
    _assert_error(_post(server, {"prompt": [1, 2], "stop": ["a"] * 5}), 400, "stop", "more than the 4 allowed")
    _assert_error(_post(server, {"prompt": [1, 2], "stop": ["a"] * 4}), 400, "stop", "need a tokenizer")
    for field, value in (("stop_token_ids", list(range(vocab + 1))),
                         ("logit_bias", {str(i): -1 for i in range(vocab + 1)})):
        _assert_error(_post(server, {"prompt": [1, 2], field: value}), 400, field, f"more than the {vocab} allowed")
    r = _post(server, {"prompt": [1, 2], "max_tokens": 2, "stop_token_ids": list(range(vocab)),
                       "logit_bias": {str(i): -1 for i in range(vocab)}})
    assert r.status_code == 200, r.text[:300]


def test_the_offline_api_refuses_long_id_lists_with_a_short_clear_error():
    # The same inputs through SamplingParams / LLMEngine.add_request: a ValueError naming the field and the
    # vocabulary's size, found by len() (not a scan of each id on the engine thread) and short (vLLM's message,
    # which lists every bad id, was 3 MB for 470,000 keys).
    eng = LLMEngine("tiny", num_gpu_blocks=16, max_model_len=64)
    with pytest.raises(ValueError, match="stop_token_ids") as e:
        SamplingParams(stop_token_ids=[1] * 100_000 + ["x"])
    assert len(str(e.value)) < 200
    for params, field in ((SamplingParams(stop_token_ids=list(range(600))), "stop_token_ids"),
                          (SamplingParams(logit_bias={i: 1.0 for i in range(100_000)}), "logit_bias")):
        with pytest.raises(ValueError, match=f"^{field} has {len(params.stop_token_ids or params.logit_bias)} "
                                             "distinct token ids, more than the vocabulary's 512") as e:
            eng.add_request(None, [1, 2], params)
    bias = {i: 1.0 for i in range(500, 600)}  # 100 ids, 88 outside the vocabulary: the first 10 are named
    with pytest.raises(ValueError, match=r"logit_bias: token_id\(s\) \[512, .*, 521\] \(and 78 more\)") as e:
        eng.add_request(None, [1, 2], SamplingParams(logit_bias=bias))
    assert len(str(e.value)) < 200 and not eng.has_unfinished_requests()
    eng.add_request("ok", [1, 2], SamplingParams(max_tokens=2, stop_token_ids=[7] * 1000 + list(range(512)),
                                                 logit_bias={i: 0.5 for i in range(512)}))
    assert eng.has_unfinished_requests()
