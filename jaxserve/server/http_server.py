"""The OpenAI-compatible HTTP front end: FastAPI routes, auth, error shapes, health, and its server.

Routes: POST /v1/completions, /v1/chat/completions, GET /v1/models, /health, /metrics,
/version, POST /tokenize, /detokenize (vLLM's shapes). Request bodies are pydantic models
(openai_protocol.py); the translation to engine calls is OpenAIServing's (openai_serving.py);
this module only routes, gates and shapes errors as OpenAI does ({"error": {message, type,
param, code}}): 400 bad value (pydantic's and the engine's messages, naming the field), 401 bad
key, 404 unknown model or path, 413 oversized body, 429 full queue (Retry-After), 503 while
starting, draining or after the engine died; never a 500 for bad input.

Threading and lifecycle: uvicorn serves the app on the caller's asyncio loop (the one the gRPC
server runs on), from a socket bound at `start` (port 0: any free one); health is 503 until
`attach` gives it the started AsyncEngine. `shutdown` drains: new requests get 503 while the
in-flight ones finish (up to a timeout), then uvicorn stops and cancels what is left, which
closes their engine streams and so aborts their requests. It never touches the scheduler, the
page manager or the runner, and installs no signal handlers (run_server owns SIGTERM).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
import time
from dataclasses import dataclass

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxserve import __version__
from jaxserve.server import openai_protocol as api
from jaxserve.server.openai_errors import OpenAIError, bad_request
from jaxserve.server.openai_serving import OpenAIServing

log = logging.getLogger(__name__)
# Paths served whatever the state and without the API key (probes, scrapers, the schema).
_OPEN_PATHS = {"/health", "/metrics", "/version", "/openapi.json", "/docs", "/redoc",
               "/docs/oauth2-redirect"}
_JSON_PATHS = {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
_ERRORS = {code: {"model": api.ErrorResponse} for code in (400, 401, 404, 413, 415, 429, 503)}


@dataclass(frozen=True)
class HttpSettings:
    port: int = 8000                      # 0: any free port
    api_key: str | None = None            # required as "Authorization: Bearer KEY" when set
    served_model_name: str | None = None  # default: the model's name
    chat_template: str | None = None      # template source overriding the model's own
    max_body_bytes: int = 16 << 20


class _State:
    """What the routes and the gate share; the engine is None until attach."""

    def __init__(self):
        self.serving: OpenAIServing | None = None
        self.draining = False
        self.num_in_flight = 0
        self.started = int(time.time())

    def unavailable(self) -> str | None:
        if self.draining:
            return "the server is shutting down"
        if self.serving is None:
            return "the server is starting: the engine is loading and compiling"
        error = self.serving.async_engine.error
        return None if error is None else f"engine stopped: {error!r}"


async def _send_error(error: OpenAIError, scope, receive, send) -> None:
    await JSONResponse(error.body(), error.status, error.headers)(scope, receive, send)


class _Gate:
    """ASGI middleware before any route: API key, body size, readiness, in-flight count."""

    def __init__(self, app, settings: HttpSettings, state: _State):
        self.app, self.settings, self.state = app, settings, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in _OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        key = self.settings.api_key
        if key is not None:
            given = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                return await _send_error(OpenAIError(
                    401, "missing or invalid API key: send the header 'Authorization: Bearer "
                         "<key>'", "authorization", "authentication_error"), scope, receive, send)
        limit = self.settings.max_body_bytes
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > limit:
            return await _send_error(OpenAIError(
                413, f"the request body ({length.decode('latin-1')} bytes) exceeds the limit of "
                     f"{limit} bytes", "body", "request_too_large"), scope, receive, send)
        if scope["path"] in _JSON_PATHS and scope["method"] == "POST":
            given = headers.get(b"content-type", b"").decode("latin-1")
            if given.partition(";")[0].strip().lower() != "application/json":
                return await _send_error(OpenAIError(
                    415, f"the request body must be JSON, sent with the header 'Content-Type: "
                         f"application/json' (got {given or 'none'!r})", "content-type",
                    "unsupported_media_type"), scope, receive, send)
        reason = self.state.unavailable()
        if reason is not None:
            return await _send_error(OpenAIError(503, reason, None, "service_unavailable"),
                                     scope, receive, send)
        if b"content-length" not in headers and scope["method"] == "POST":
            # A chunked body has no length to check first: read it here, up to the limit.
            messages, received, more = [], 0, True
            while more:
                message = await receive()
                if message["type"] != "http.request":
                    return
                received += len(message.get("body", b""))
                if received > limit:
                    return await _send_error(OpenAIError(
                        413, f"the request body exceeds the limit of {limit} bytes", "body",
                        "request_too_large"), scope, receive, send)
                messages.append(message)
                more = message.get("more_body", False)

            async def replayed():
                return messages.pop(0) if messages else await receive()
        else:
            replayed = receive

        self.state.num_in_flight += 1
        try:
            await self.app(scope, replayed, send)
        finally:
            self.state.num_in_flight -= 1


class _EventStream(StreamingResponse):
    """SSE whose event iterator is always closed (so the engine request is aborted), even when
    the client went away or the server cancelled the response."""

    media_type = "text/event-stream"

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


async def _until_disconnected(raw: Request) -> None:
    """Returns once the client has gone (the body is already read, so the next ASGI message
    is the disconnect, or the end of the response)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(raw: Request, work):
    """Await the coroutine `work`, unless the client disconnects first: then cancel it (which
    closes its engine streams, so its requests are aborted) and answer nobody."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnected(raw))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (watch, task):
            pending.cancel()  # a no-op when done; also when this route itself is cancelled
        await asyncio.gather(watch, return_exceptions=True)
    if not task.done() or task.cancelled():
        await asyncio.gather(task, return_exceptions=True)
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    return task.result()


def _param(loc) -> str:
    """pydantic's error location -> "messages[0].role" (union member tags dropped)."""
    param = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part.isidentifier() and part[:1].islower() and part not in _TYPE_TAGS:
            param += f".{part}" if param else part
    return param or "body"


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    errors = exc.errors()
    first = errors[0]
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", first["msg"])
        return bad_request(f"the request body is not valid JSON: {detail}", "body")
    param = _param(first["loc"])
    if first["type"] == "missing":
        return bad_request(f"{param} is required", param)
    if first["type"] == "extra_forbidden":
        return bad_request(f"{param} is not a parameter this server accepts", param)
    messages = list(dict.fromkeys(e["msg"] for e in errors if _param(e["loc"]) == param))
    shown = repr(first.get("input"))
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return bad_request(f"{param}={shown} is invalid: {'; or '.join(messages[:3])}", param)


def build_app(settings: HttpSettings, state: _State) -> FastAPI:
    app = FastAPI(title="jaxserve OpenAI-compatible API", version=__version__)

    def serving() -> OpenAIServing:
        reason = state.unavailable()
        if reason is not None:
            raise OpenAIError(503, reason, None, "service_unavailable")
        return state.serving

    def respond(result):
        if isinstance(result, (api.BaseModel, Response)):
            return result
        return _EventStream(result, headers={"Cache-Control": "no-cache",
                                             "X-Accel-Buffering": "no"})

    @app.post("/v1/completions", response_model=api.Completion, responses=_ERRORS)
    async def completions(request: api.CompletionRequest, raw: Request):
        return respond(await _unless_disconnected(raw, serving().completions(request)))

    @app.post("/v1/chat/completions", response_model=api.ChatCompletion, responses=_ERRORS)
    async def chat_completions(request: api.ChatCompletionRequest, raw: Request):
        return respond(await _unless_disconnected(raw, serving().chat(request)))

    @app.get("/v1/models", response_model=api.ModelList, responses=_ERRORS)
    async def models():
        s = serving()
        return api.ModelList(data=[api.ModelCard(
            id=s.model_name, created=state.started, root=s.info.model_name,
            max_model_len=s.info.max_model_len, vocab_size=s.info.vocab_size)])

    @app.post("/tokenize", response_model=api.TokenizeResponse, responses=_ERRORS)
    async def tokenize(request: api.TokenizeCompletionRequest | api.TokenizeChatRequest):
        return await serving().tokenize(request)

    @app.post("/detokenize", response_model=api.DetokenizeResponse, responses=_ERRORS)
    async def detokenize(request: api.DetokenizeRequest):
        return await serving().detokenize(request)

    @app.get("/health")
    async def health():
        reason = state.unavailable()
        if reason is None:
            return {"status": "serving"}
        return JSONResponse({"status": "unavailable", "reason": reason}, 503)

    @app.get("/metrics")
    async def metrics():
        if state.serving is None:
            return JSONResponse(OpenAIError(503, "the server is starting").body(), 503)
        registry = state.serving.async_engine.engine.metrics.registry
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError):
        return JSONResponse(exc.body(), exc.status, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError):
        error = _validation_error(exc)
        return JSONResponse(error.body(), error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = (f"no route {request.method} {request.url.path}" if exc.status_code in
                   (404, 405) else str(exc.detail))
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        error = OpenAIError(exc.status_code, message, None, kind)
        return JSONResponse(error.body(), exc.status_code, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception):
        log.error("HTTP request failed", exc_info=exc)
        return JSONResponse(OpenAIError(500, f"internal error: {exc!r}", None,
                                        "internal_error").body(), 500)

    app.add_middleware(_Gate, settings=settings, state=state)
    return app


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: run_server handles SIGTERM for both fronts."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} for HTTP: {exc}") from None
    sock.set_inheritable(True)
    return sock


class HttpServer:
    """A listening uvicorn server for the app. Build it with `start`, then `attach`."""

    def __init__(self, host: str, settings: HttpSettings):
        self.host, self.settings, self.state = host, settings, _State()
        self.app = build_app(settings, self.state)
        self.sock = _bind(host, settings.port)
        self.port = self.sock.getsockname()[1]
        self.server = _Uvicorn(uvicorn.Config(
            self.app, lifespan="off", log_config=None, access_log=False,
            timeout_graceful_shutdown=1, timeout_keep_alive=30))
        self._task: asyncio.Future | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @classmethod
    async def start(cls, host: str, settings: HttpSettings) -> "HttpServer":
        self = cls(host, settings)
        self._task = asyncio.ensure_future(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start
                raise OSError(f"the HTTP server on {self.url} stopped while starting")
            await asyncio.sleep(0.01)
        return self

    def attach(self, async_engine) -> None:
        """Serve with this (started) engine: /health becomes 200."""
        s = self.settings
        self.state.serving = OpenAIServing(async_engine, s.served_model_name, s.chat_template)

    @property
    def num_in_flight(self) -> int:
        return self.state.num_in_flight

    async def shutdown(self, timeout: float) -> None:
        """503 for new requests, let in-flight ones finish for up to timeout seconds, then
        stop (cancelling the rest, which aborts their requests in the engine)."""
        self.state.draining = True
        deadline = time.monotonic() + timeout
        while self.state.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.server.should_exit = True
        if self._task is not None:
            await self._task
