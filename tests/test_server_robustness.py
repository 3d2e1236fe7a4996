"""The OpenAI-compatible server under misuse (issue 28): latency of keep-alive requests, disconnects, inputs a
tokenizer or JSON parser chokes on, oversized bodies, a dead engine, the server's own flags.

Each server runs in-process (uvicorn in a thread, loopback only, a port the OS picks) on the tiny model; every wait
is bounded in time and every loop in count.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
import httpx  # noqa: E402
import uvicorn  # noqa: E402

from minivllm import LLM, LLMEngine  # noqa: E402
from minivllm.engine.async_llm import AsyncLLM  # noqa: E402
from minivllm.entrypoints.openai.api_server import build_app, create_server_socket  # noqa: E402

NUM_BLOCKS, MAX_MODEL_LEN = 64, 256


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
    with httpx.Client(base_url=server.base, timeout=10) as client:
        assert client.get("/v1/models").status_code == 200  # opens the connection
        times = []
        for _ in range(8):
            t0 = time.perf_counter()
            assert client.get("/v1/models").status_code == 200
            times.append(time.perf_counter() - t0)
    times.sort()
    assert times[len(times) // 2] < 0.005, times


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
