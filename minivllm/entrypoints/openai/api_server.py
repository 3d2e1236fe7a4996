"""The OpenAI-compatible HTTP server: FastAPI routes on an ``AsyncLLM``, served by uvicorn
(vLLM 0.32: ``vllm/entrypoints/openai/api_server.py``, the routers in ``vllm/entrypoints/openai/*/api_router.py``,
and ``vllm/entrypoints/serve/middleware/authenticate.py`` for ``--api-key``).

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` for server-sent
events), ``GET /health`` (200 while the engine runs, 503 after), ``GET /metrics`` (Prometheus text format; see
``metrics.py``). With an API key every ``/v1`` route needs ``Authorization: Bearer <key>`` (401 otherwise);
``/health`` and ``/metrics`` stay open, as in vLLM.

Errors have OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for bad JSON, a field of the wrong
type, a value out of range or a prompt over ``max_model_len``; 404 for a model this server does not serve; 401 for
a missing or wrong key; 503 once the engine is shut down. Where minivllm differs from vLLM: vLLM's 401 body is
``{"error": "Unauthorized"}``; minivllm uses the same OpenAI shape as its other errors.

Shutdown (SIGINT or SIGTERM): the engine aborts every request in flight first, so that each open stream ends
(``finish_reason: "abort"``, then ``data: [DONE]``) and uvicorn's graceful shutdown finds no connection left to wait
for; then the process exits. vLLM's server instead cancels its server task and shuts the engine-core process down.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import socket
from http import HTTPStatus
from typing import Any, Awaitable, Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from minivllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from minivllm.entrypoints.openai.serving_chat import OpenAIServingChat
from minivllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from minivllm.entrypoints.openai.serving_engine import RequestError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def _error(e: RequestError) -> JSONResponse:
    return JSONResponse(e.to_response().model_dump(), status_code=e.status.value)


class AuthenticationMiddleware:
    """Bearer-token check on ``/v1`` routes (compared through SHA-256 digests in constant time, as vLLM does)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.digest = hashlib.sha256(api_key.encode()).digest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") != "OPTIONS" and scope["path"].startswith("/v1"):
            headers = dict(scope["headers"])
            scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(
                    hashlib.sha256(token.encode()).digest(), self.digest):
                err = RequestError("Unauthorized: a valid API key is required (header 'Authorization: Bearer "
                                   "<key>')", None, HTTPStatus.UNAUTHORIZED)
                await _error(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def with_cancellation(raw_request: Request, coro: Awaitable[Any]) -> Any:
    """Run a handler's work, cancelling it if the client disconnects first (vLLM 0.32: ``with_cancellation`` in
    ``vllm/entrypoints/serve/utils/api_utils.py``).

    A whole (non-streaming) response is built before anything is sent, so a client that gave up would otherwise
    leave its request running to the end; cancelling the work closes the request's stream, which aborts it. The
    answer to a client that left is a 499 (nginx's "client closed request": nobody reads it); vLLM returns None.
    """
    async def disconnected() -> None:
        while (await raw_request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler itself was cancelled (the server is stopping)
        work.cancel()
        raise
    finally:
        watch.cancel()
    if work in done:
        return work.result()
    # cancel() only asks: the task is not cancelled until it runs again, so wait for it (its finally blocks
    # abort the request) instead of reading a result it does not have yet.
    work.cancel()
    await asyncio.wait({work})
    return Response(status_code=499)


def build_app(engine_client: AsyncLLM, served_model_name: str = DEFAULT_MODEL_NAME,
              api_key: Optional[str] = None) -> FastAPI:
    """The FastAPI application serving ``engine_client`` under ``served_model_name``.

    Several apps may share one ``AsyncLLM`` (each stream is bound to the event loop that opened it).
    """
    app = FastAPI(title="minivllm OpenAI-compatible server")
    metrics = ServerMetrics(engine_client, served_model_name)
    completion = OpenAIServingCompletion(engine_client, served_model_name, metrics)
    chat = OpenAIServingChat(engine_client, served_model_name, metrics)
    app.state.engine_client, app.state.metrics = engine_client, metrics
    if api_key:
        app.add_middleware(AuthenticationMiddleware, api_key=api_key)

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, e: RequestError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        # Bad JSON (loc ("body", <offset>)) and fields of the wrong type (loc ("body", "<field>", ...)) are 400s,
        # as in vLLM (FastAPI's default is 422).
        first: Any = (e.errors() or [{}])[0]
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            message, param = f"the request body is not valid JSON: {first.get('msg', '')}", None
        else:
            param = loc[0] if loc else None
            message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}, got {first.get('input')!r}"
        return _error(RequestError(message, param))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if engine_client.errored else 200)

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def show_models() -> ModelList:
        return ModelList(data=[ModelCard(id=served_model_name, root=served_model_name,
                                         max_model_len=completion.max_model_len)])

    @app.post("/v1/completions", response_model=None)
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Any:
        return await _respond(request.stream, raw_request, completion.create_completion(request))

    @app.post("/v1/chat/completions", response_model=None)
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Any:
        return await _respond(request.stream, raw_request, chat.create_chat_completion(request))

    return app


async def _respond(stream: bool, raw_request: Request, handler: Awaitable[Any]) -> Any:
    """Turns a serving class's result (an error response, a whole response or a stream of SSE lines) into HTTP.

    A whole response is awaited under ``with_cancellation`` so a client that disconnects aborts its request; a
    stream notices the disconnect itself, when its next chunk cannot be sent.
    """
    result = await (handler if stream else with_cancellation(raw_request, handler))
    if isinstance(result, Response):
        return result
    if isinstance(result, BaseModel):
        return JSONResponse(result.model_dump(exclude_none=True))
    return StreamingResponse(result, media_type="text/event-stream")


class _Server(uvicorn.Server):
    """uvicorn's server, ending the engine's requests first when a signal asks it to stop."""

    def __init__(self, config: uvicorn.Config, engine_client: AsyncLLM) -> None:
        super().__init__(config)
        self.engine_client = engine_client

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.engine_client.shutdown(timeout=0)  # non-blocking: the engine thread aborts all between two steps
        super().handle_exit(sig, frame)
        # uvicorn would raise the signal again once stopped (a KeyboardInterrupt traceback from inside
        # asyncio.run); the shutdown is complete by then, so the process just exits with status 0.
        self._captured_signals.clear()


def create_server_socket(host: str, port: int) -> socket.socket:
    """The listening socket (vLLM 0.32: ``create_server_socket`` in ``vllm/entrypoints/launchers/launcher.py``).

    Made with ``IPPROTO_TCP`` as its protocol: asyncio sets ``TCP_NODELAY`` on an accepted socket only when its
    protocol says TCP, and an accepted socket inherits the listening one's. Without it Nagle's algorithm holds a
    response's last small segment until the client's delayed ACK, about 40 ms on every keep-alive request after
    the first. vLLM makes its socket with protocol 0 but runs on uvloop, which sets ``TCP_NODELAY`` itself.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def run_server(engine_client: AsyncLLM, served_model_name: str, host: str, port: int,
               api_key: Optional[str] = None) -> int:
    """Serve until SIGINT/SIGTERM; returns 0 after a clean shutdown (every request in flight reported aborted)."""
    app = build_app(engine_client, served_model_name, api_key)
    config = uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5,
                            access_log=False)
    server = _Server(config, engine_client)
    sock = create_server_socket(host, port)
    try:
        server.run(sockets=[sock])
    finally:
        engine_client.shutdown()
        sock.close()
    return 0
