"""The OpenAI-compatible HTTP server: FastAPI routes on an ``AsyncLLM``, served by uvicorn
(vLLM 0.32: ``vllm/entrypoints/openai/api_server.py``, the routers in ``vllm/entrypoints/openai/*/api_router.py``,
and ``vllm/entrypoints/serve/middleware/authenticate.py`` for ``--api-key``).

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` for server-sent
events), ``GET /health`` (200 while the engine runs, 503 after), ``GET /metrics`` (Prometheus text format; see
``metrics.py``). With an API key every ``/v1`` route needs ``Authorization: Bearer <key>`` (401 otherwise);
``/health`` and ``/metrics`` stay open, as in vLLM.

Errors have OpenAI's body ``{"error": {"message", "type", "param", "code"}}``, also for what FastAPI and Starlette
refuse themselves (a body that is not UTF-8, an integer of more than 4,300 digits, JSON nested too deep, an unknown
route), as in vLLM (``vllm/entrypoints/serve/exception_handling/``): 400 for bad JSON, a body that is not
``application/json`` (checked here, as vLLM's ``validate_json_request`` does, not left to FastAPI's default), a
field of the wrong type, a value out of range, a prompt over ``max_model_len`` or text no tokenizer takes (a lone
surrogate); 404 for a model this server does not serve; 401 for a missing or wrong key; 413 for a body larger than
any prompt within ``max_model_len`` could need; 500 when the engine died under the request; 503 once the engine is
shut down. Messages echo at most a bounded part of the bad input, as vLLM's do. Where minivllm differs from vLLM:
vLLM's 401 body is ``{"error": "Unauthorized"}``; minivllm uses the same OpenAI shape as its other errors. vLLM
parses a body of any size; minivllm refuses one over ``max_body_bytes`` before parsing it, so that a 50 MB body
costs the event loop nothing but its reading, and refuses a token-id prompt over ``max_model_len`` by its length
before checking its ids (``protocol.prompt_token_limit``; vLLM checks the length after validating the request), as
it refuses more ``stop_token_ids`` or ``logit_bias`` entries than the vocabulary has ids
(``protocol.vocab_size_limit``; vLLM has no such bound).

Shutdown (SIGINT or SIGTERM): the engine aborts every request in flight first, so that each open stream ends
(``finish_reason: "abort"``, then ``data: [DONE]``) and uvicorn's graceful shutdown finds no connection left to wait
for; then the process exits with status 0. vLLM's server instead cancels its server task and shuts the engine-core
process down. An engine that dies (its loop raised) sends open streams an error event and the server stops with
status 1, so that a supervisor restarts it (vLLM: ``terminate_if_errored`` in
``vllm/entrypoints/launchers/launcher.py``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import secrets
import socket
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from typing import Any, Awaitable, Dict, List, Optional, Sequence

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from pydantic import BaseModel
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from minivllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, ModelCard, ModelList,
                                                  prompt_token_limit, vocab_size_limit)
from minivllm.entrypoints.openai.serving_chat import OpenAIServingChat
from minivllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from minivllm.entrypoints.openai.serving_engine import RequestError, engine_dead, truncate

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
logger = logging.getLogger("minivllm.serve")


class _ErrorJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: a message may quote a lone surrogate, which has no UTF-8 encoding."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def _error(e: RequestError) -> JSONResponse:
    return _ErrorJSONResponse(e.to_response().model_dump(), status_code=e.status.value)


def _summarize_input(value: Any) -> str:
    """A size-bounded stand-in for a rejected value (vLLM 0.32: ``_summarize_error_input`` in
    ``vllm/entrypoints/serve/exception_handling/handlers/validation.py``): containers are described, not rendered."""
    if isinstance(value, str):
        return repr(truncate(value, 200))
    if isinstance(value, (bytes, bytearray)):
        return f"<{type(value).__name__} of {len(value)} bytes>"
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    try:
        return truncate(repr(value), 200)
    except Exception:  # an int past sys.get_int_max_str_digits()
        return f"<{type(value).__name__}>"


def _forget_frames(e: BaseException) -> None:
    """Drops the tracebacks of ``e`` and of the exceptions it was raised from.

    FastAPI raises its ``RequestValidationError`` and ``HTTPException`` from a local variable of the raising frame
    (``fastapi/routing.py``), and that frame is in the exception's traceback: a reference cycle that keeps the
    request's body, parsed or not (up to ``max_body_bytes``), alive until a garbage collection runs. So does the
    ``ValueError`` of a field validator, which pydantic keeps in the error's ``ctx``: its traceback holds FastAPI's
    frame that holds the list of errors. The handlers below need the exceptions, not their frames. (vLLM 0.32's
    handlers keep them.)
    """
    seen = set()
    pending: List[Optional[BaseException]] = [e]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        current.__traceback__ = None
        pending += [current.__cause__, current.__context__]
        if isinstance(current, RequestValidationError):
            for error in current.errors():
                cause = (error.get("ctx") or {}).get("error") if isinstance(error, dict) else None
                if isinstance(cause, BaseException):
                    pending.append(cause)


def max_body_bytes(max_model_len: int, chars_per_token: int) -> int:
    """The largest request body worth parsing: ``max_model_len`` tokens of the longest vocabulary entry, each
    character escaped to 6 JSON bytes (``\\uXXXX``), 16 bytes per token id (digits, comma, indentation), and 1 MiB for
    the other fields."""
    return max_model_len * (6 * chars_per_token + 16) + (1 << 20)


# A JSON string, escapes included (the unrolled form: one C-level scan, no backtracking per character).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)


def count_json_containers(body: bytes) -> int:
    """The arrays and objects a JSON body opens: its ``[`` and ``{`` outside strings (strings are cut out first).

    Counted on the raw bytes in a few milliseconds (2.8 ms for 2.7 MB of ``[[],[],...]``, under 0.1 s for 400,000
    short strings), before ``json.loads`` and pydantic build one Python object per container on the event loop: a
    2 MB body of 700,000 empty lists held the loop, and every other stream, for 3.2 s. An invalid body may be
    miscounted; it is refused by the parser anyway.
    """
    stripped = _JSON_STRING.sub(b'""', body)
    return stripped.count(b"[") + stripped.count(b"{")


class RequestBodyGuard:
    """Checks a POST body before anything parses it: its media type must be ``application/json`` (400, vLLM's
    message), its size at most ``max_bytes`` (413), and, with ``max_prompt_tokens`` given, the arrays and objects
    it opens at most ``4 * max_prompt_tokens + 1024`` (400; ``count_json_containers``; minivllm's bound, vLLM has
    none). The body is read here and replayed to the app.

    An oversized body is still read to its end (and dropped) before the 413 is sent: a client such as httpx or
    ``openai`` sends its whole body before it reads the answer, and a connection closed under it gives a
    connection error (which ``openai`` retries) instead of the 413.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, max_prompt_tokens: Optional[int] = None,
                 vocab_size: Optional[int] = None) -> None:
        self.app, self.max_bytes = app, max_bytes
        self.max_prompt_tokens, self.vocab_size = max_prompt_tokens, vocab_size

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        # Read by the request's validators (protocol.prompt_token_limit, vocab_size_limit), which run in this
        # task's context.
        prompt_token_limit.set(self.max_prompt_tokens)
        vocab_size_limit.set(self.vocab_size)
        names = [name for name, _ in scope["headers"]]
        for once in (b"content-type", b"content-length"):
            if names.count(once) > 1:  # this guard and FastAPI would read different ones (the last, the first)
                await _error(RequestError(f"the request has {names.count(once)} {once.decode()} headers; send one"))(
                    scope, receive, send)
                return
        headers = dict(scope["headers"])
        media_type = headers.get(b"content-type", b"").decode("latin-1").split(";", 1)[0].strip().lower()
        if media_type != "application/json":
            await _error(RequestError("Unsupported Media Type: Only 'application/json' is allowed"))(
                scope, receive, send)
            return
        try:
            declared = int(headers.get(b"content-length", b"-1"))
        except ValueError:
            declared = -1
        chunks: List[bytes] = []
        size, too_big = 0, declared > self.max_bytes
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            too_big = too_big or size > self.max_bytes
            if too_big:
                chunks.clear()
            else:
                chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
            if size > 2 * self.max_bytes:
                break  # read no further: a declared length past any real body may never end (the 413 still goes)
        if too_big:
            err = RequestError(f"the request body has {max(size, declared)} bytes, more than the {self.max_bytes} "
                               "that a prompt within max_model_len can need", None, HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
            await _error(err)(scope, receive, send)
            return
        body: Optional[bytes] = b"".join(chunks)
        del chunks
        if self.max_prompt_tokens is not None:
            # minivllm's bound (vLLM has none): one prompt per request, at most max_model_len chat messages (each
            # an object, its content list and parts), a logit_bias object, a stop list: 4 x max_model_len + 1024
            # arrays and objects is more than any request within max_model_len needs.
            limit = 4 * self.max_prompt_tokens + 1024
            n = count_json_containers(body or b"")
            if n > limit:
                await _error(RequestError(
                    f"the request body opens {n} JSON arrays and objects, more than the {limit} that a request "
                    f"within max_model_len ({self.max_prompt_tokens}) can need"))(scope, receive, send)
                return

        async def replay() -> Message:
            nonlocal body
            if body is not None:
                message, body = {"type": "http.request", "body": body, "more_body": False}, None
                return message
            return await receive()  # after the body: the disconnect, which with_cancellation waits for

        await self.app(scope, replay, send)


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
        error = work.exception()
        if error is None:
            return work.result()
        # Raised from here, the error's traceback would hold this frame, which holds the task, which holds the
        # error: a cycle keeping the request (and its prompt) alive until a garbage collection.
        del work, done
        try:
            raise error
        finally:
            del error
    # cancel() only asks: the task is not cancelled until it runs again, so wait for it (its finally blocks
    # abort the request) instead of reading a result it does not have yet.
    work.cancel()
    await asyncio.wait({work})
    return Response(status_code=499)


def build_app(engine_client: AsyncLLM, served_model_name: str = DEFAULT_MODEL_NAME,
              api_key: Optional[str] = None, *, allowed_origins: Sequence[str] = (),
              allowed_methods: Sequence[str] = ("*",), allowed_headers: Sequence[str] = ("*",),
              allow_credentials: bool = False, disable_fastapi_docs: bool = False) -> FastAPI:
    """The FastAPI application serving ``engine_client`` under ``served_model_name``.

    ``api_key``: the key ``/v1`` routes require (``cli_args.api_key`` falls back to ``VLLM_API_KEY``).
    ``allowed_origins`` etc. are vLLM's CORS options (``cli_args.py``): with no
    origin given, as by default, no cross-origin browser request is allowed. ``disable_fastapi_docs`` removes
    ``/docs``, ``/redoc`` and ``/openapi.json``.

    Several apps may share one ``AsyncLLM`` (each stream is bound to the event loop that opened it).
    """
    docs: Dict[str, Any] = {} if not disable_fastapi_docs else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="minivllm OpenAI-compatible server", **docs)
    metrics = ServerMetrics(engine_client, served_model_name)
    executor = ThreadPoolExecutor(1, thread_name_prefix="minivllm-tokenize")
    completion = OpenAIServingCompletion(engine_client, served_model_name, metrics, executor)
    chat = OpenAIServingChat(engine_client, served_model_name, metrics, executor)
    app.state.engine_client, app.state.metrics = engine_client, metrics
    app.state.max_body_bytes = max_body_bytes(completion.max_model_len, completion.max_chars_per_token)
    # Starlette runs the last middleware added first: CORS (answers preflights), then the key, then the body.
    app.add_middleware(RequestBodyGuard, max_bytes=app.state.max_body_bytes, max_prompt_tokens=completion.max_model_len,
                       vocab_size=engine_client.engine.vocab_size)
    if api_key:
        app.add_middleware(AuthenticationMiddleware, api_key=api_key)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=list(allowed_methods),
                           allow_headers=list(allowed_headers), allow_credentials=allow_credentials)

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, e: RequestError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        # Bad JSON (loc ("body", <offset>)) and fields of the wrong type (loc ("body", "<field>", ...)) are 400s,
        # as in vLLM (FastAPI's default is 422). Only the first error is described, its input summarized.
        _forget_frames(e)
        errors = e.errors()
        first: Any = (errors or [{}])[0]
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            message, param = f"the request body is not valid JSON: {first.get('msg', '')}", None
        else:
            param = loc[0] if loc else None
            message = (f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}, got "
                       f"{_summarize_input(first.get('input'))}")
            if len(errors) > 1:
                message += f" (and {len(errors) - 1} more errors)"
        return _error(RequestError(message, param))

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, e: HTTPException) -> JSONResponse:
        # What FastAPI and Starlette refuse themselves: an unknown route (404), a wrong method (405), a body that
        # json.loads raised on other than a JSONDecodeError (not UTF-8, a 5,000-digit int, nesting too deep).
        _forget_frames(e)
        message = str(e.detail)
        cause = e.__cause__
        if cause is not None:
            message = f"the request body is not valid JSON: {type(cause).__name__}: {truncate(str(cause), 200)}"
        status = HTTPStatus(e.status_code)
        err = RequestError(message, None, status)
        response = _error(err)
        if e.headers:
            response.headers.update(e.headers)
        return response

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
        self.exit_code = 0

    async def on_tick(self, counter: int) -> bool:
        # Every 0.1 s (vLLM's watchdog_loop looks every 5 s): a dead engine stops the server, whose streams have
        # had their error event, so that a supervisor sees the exit status and restarts it.
        if not self.should_exit and engine_dead(self.engine_client):
            logger.error("the engine died; shutting the server down (exit status 1)")
            self.exit_code, self.should_exit = 1, True
        return await super().on_tick(counter)

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
    the first. vLLM makes its socket with protocol 0 too, but uvicorn runs it on uvloop (a vLLM dependency), whose
    TCP transports set ``TCP_NODELAY`` themselves; minivllm runs on asyncio's own loop.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def run_server(engine_client: AsyncLLM, served_model_name: str, host: str, port: int,
               api_key: Optional[str] = None, sock: Optional[socket.socket] = None, **app_options: Any) -> int:
    """Serve until SIGINT/SIGTERM (returns 0 after a clean shutdown: every request in flight reported aborted) or
    until the engine dies (returns 1). ``sock``: a listening socket to use instead of binding ``host:port``;
    ``app_options``: ``build_app``'s keyword options (CORS, docs)."""
    app = build_app(engine_client, served_model_name, api_key, **app_options)
    config = uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5,
                            access_log=False)
    server = _Server(config, engine_client)
    sock = sock or create_server_socket(host, port)
    try:
        server.run(sockets=[sock])
    finally:
        engine_client.shutdown()
        sock.close()
    return server.exit_code
