"""The OpenAI-compatible HTTP front end: FastAPI routes, auth, error shapes, health, and its server.

Routes: POST /v1/completions, /v1/chat/completions, /v1/responses (stateless, over the chat
path: responses.py), GET /v1/models (LoRA adapters too), /health, /metrics,
/version, POST /tokenize, /detokenize, /reset_prefix_cache, /v1/load_lora_adapter,
/v1/unload_lora_adapter (lora_routes.py), and behind --enable-rollout-endpoints /sleep,
/wake_up, /pause, /resume, /update_weights_from_disk ... (rollout_routes.py) (vLLM's shapes).
Request bodies are pydantic models
(openai_protocol.py); the translation to engine calls is OpenAIServing's (openai_serving.py);
this module only routes, gates, reports the request fields it ignored (one warning per request
and the X-Jaxserve-Ignored-Fields header on its answer, stream and error included: ignored.py),
and shapes errors as OpenAI does ({"error": {message, type, param, code}}): 400 bad value
(pydantic's and the engine's messages, naming the field), 404 unknown model or path, 405 wrong
method, 429 full queue or a client at its bound (Retry-After), 503 while starting, draining or
after the engine died; never a 500 for bad input. The API key (401), body size (413), JSON
content type (415), readiness and the client's bound are checked before any route
(http_gate.py); with TLS files uvicorn serves only TLS (with client CAs, only to clients
holding a certificate they signed). A client that disconnects aborts its request: a stream's
response closes its engine stream, and a non-streaming request's work is cancelled the moment
the disconnect arrives.

Threading and lifecycle: uvicorn serves the app on the caller's asyncio loop (the one the gRPC
server runs on), from a socket bound at `start` (port 0: any free one); health is 503 until
`attach` gives it the started AsyncEngine. Draining (begin_drain, wait_idle, stop; or
`shutdown`): new requests get 503 while the in-flight ones finish (run_server ends the ones left
at its timeout with 503), then uvicorn stops and cancels anything still open, which closes their
engine streams and so aborts their requests. A failed engine is a 500 for the requests it held
and a 503 (/health too) afterwards; a request's `timeout` passed while queued is a 408. It
never touches the scheduler, the page manager or the runner, and installs no signal handlers
(run_server owns SIGTERM).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
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
from jaxserve.config.tool_calls import ToolCallSettings
from jaxserve.entrypoints.openai import protocol as api
from jaxserve.entrypoints.openai.http_gate import Gate, GateState
from jaxserve.entrypoints.openai.errors import OpenAIError, bad_request
from jaxserve.entrypoints.openai.lora_routes import adapter_cards, add_lora_routes
from jaxserve.entrypoints.openai.rollout_routes import add_rollout_routes
from jaxserve.entrypoints.openai.ignored import IGNORED_FIELDS_HEADER, describe, ignored_fields
from jaxserve.entrypoints.openai.responses import create_response
from jaxserve.entrypoints.openai.responses_protocol import ResponseObject, ResponsesRequest
from jaxserve.entrypoints.openai.serving import OpenAIServing
from jaxserve.entrypoints.security import ApiKeys, Security, TlsFiles

log = logging.getLogger(__name__)
_ERRORS = {code: {"model": api.ErrorResponse}
           for code in (400, 401, 404, 408, 413, 415, 429, 500, 503)}


@dataclass(frozen=True)
class HttpSettings:
    port: int = 8000                      # 0: any free port
    served_model_name: str | None = None  # default: the model's name
    chat_template: str | None = None      # template source overriding the model's own
    max_body_bytes: int = 16 << 20
    tool_calls: ToolCallSettings = ToolCallSettings()  # tool_choice "auto": flags and parser
    reasoning_parser: str | None = None   # chat replies' reasoning apart (config/reasoning.py)
    enable_rollout_endpoints: bool = False  # /sleep, /pause, ... (rollout_routes.py)


class _EventStream(StreamingResponse):
    """SSE whose event iterator is always closed (so the engine request is aborted), even when
    the client went away or the server cancelled the response."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:  # also when streaming never began (the client left before the first event)
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
        parent = param.rpartition(".")[0] or "the request"  # only closed objects refuse keys
        return bad_request(f"{param} is not a key {parent} accepts (unknown keys in an output "
                           f"constraint are refused, not ignored)", param)
    messages = list(dict.fromkeys(e["msg"] for e in errors if _param(e["loc"]) == param))
    shown = repr(first.get("input"))
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return bad_request(f"{param}={shown} is invalid: {'; or '.join(messages[:3])}", param)


def build_app(settings: HttpSettings, state: GateState,
              keys: ApiKeys | None = None) -> FastAPI:
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

    def report_ignored(raw: Request, request) -> str | None:
        """The unknown fields of the request, described, after one warning naming them."""
        fields = ignored_fields(request)
        if not fields:
            return None
        names = describe(fields)
        log.warning("%s %s: ignored request fields this server does not know: %s",
                    raw.method, raw.url.path, names)
        return names

    async def answer(request, raw: Request, response: Response, work,
                     watch_disconnect: bool = True):
        """Run work(serving) for a validated request; every answer (a response, a stream,
        an error) names the request's ignored fields in IGNORED_FIELDS_HEADER."""
        ignored = report_ignored(raw, request)
        try:
            result = work(serving())
            result = respond(await (_unless_disconnected(raw, result) if watch_disconnect
                                    else result))
        except OpenAIError as exc:
            if ignored is not None:
                exc.headers[IGNORED_FIELDS_HEADER] = ignored
            raise
        if ignored is not None:  # a route's returned model is sent with `response`'s headers
            headers = result.headers if isinstance(result, Response) else response.headers
            headers[IGNORED_FIELDS_HEADER] = ignored
        return result

    @app.post("/v1/completions", response_model=api.Completion, responses=_ERRORS)
    async def completions(request: api.CompletionRequest, raw: Request, response: Response):
        return await answer(request, raw, response, lambda s: s.completions(request))

    @app.post("/v1/chat/completions", response_model=api.ChatCompletion, responses=_ERRORS)
    async def chat_completions(request: api.ChatCompletionRequest, raw: Request,
                               response: Response):
        return await answer(request, raw, response, lambda s: s.chat(request))

    @app.post("/v1/responses", response_model=ResponseObject, responses=_ERRORS)
    async def responses(request: ResponsesRequest, raw: Request, response: Response):
        return await answer(request, raw, response, lambda s: create_response(s, request))

    @app.get("/v1/models", response_model=api.ModelList, responses=_ERRORS)
    async def models():
        s = serving()
        return api.ModelList(data=[api.ModelCard(
            id=s.model_name, created=state.started, root=s.info.model_name,
            max_model_len=s.info.max_model_len, vocab_size=s.info.vocab_size)]
            + adapter_cards(s, state.started))

    add_lora_routes(app, serving, _ERRORS)
    add_rollout_routes(app, serving, _ERRORS, settings.enable_rollout_endpoints)

    @app.post("/tokenize", response_model=api.TokenizeResponse, responses=_ERRORS)
    async def tokenize(request: api.TokenizeCompletionRequest | api.TokenizeChatRequest,
                       raw: Request, response: Response):
        return await answer(request, raw, response, lambda s: s.tokenize(request), False)

    @app.post("/detokenize", response_model=api.DetokenizeResponse, responses=_ERRORS)
    async def detokenize(request: api.DetokenizeRequest, raw: Request, response: Response):
        return await answer(request, raw, response, lambda s: s.detokenize(request), False)

    @app.get("/health")
    async def health():
        reason = state.unavailable()
        ranks = None if state.serving is None else state.serving.async_engine.rank_health()
        extra = {} if ranks is None else {"data_parallel_ranks": {str(r): s
                                                                  for r, s in ranks.items()}}
        if reason is None:
            return {"status": "serving", **extra}
        return JSONResponse({"status": "unavailable", "reason": reason, **extra}, 503)

    @app.get("/metrics")
    async def metrics():
        if state.serving is None:
            return JSONResponse(OpenAIError(503, "the server is starting").body(), 503)
        registry = state.serving.async_engine.engine.metrics.registry
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():  # vLLM's: 200, empty body; KV-event subscribers are told
        await serving().async_engine.reset_prefix_cache()
        return Response(status_code=200)

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
        param = None
        if exc.status_code == 400:  # FastAPI could not read the body: bad UTF-8, too deep
            message, param = (f"the request body is not valid JSON ({exc.detail.lower()}: "
                              f"invalid UTF-8, or nested too deeply?)"), "body"
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        error = OpenAIError(exc.status_code, message, param, kind)
        return JSONResponse(error.body(), exc.status_code, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception):
        log.error("HTTP request failed", exc_info=exc)
        return JSONResponse(OpenAIError(500, f"internal error: {exc!r}", None,
                                        "internal_error").body(), 500)

    app.add_middleware(Gate, settings=settings, state=state, keys=keys or ApiKeys())
    return app


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: run_server handles SIGTERM for both fronts."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def _ssl_options(tls: TlsFiles | None) -> dict:
    """uvicorn's ssl_* options for the TLS files: with client CAs, a client certificate signed
    by one of them is required (the handshake fails without one)."""
    if tls is None:
        return {}
    return dict(ssl_certfile=tls.certfile, ssl_keyfile=tls.keyfile, ssl_ca_certs=tls.ca_certs,
                ssl_cert_reqs=ssl.CERT_REQUIRED if tls.require_client_cert else ssl.CERT_NONE)


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

    def __init__(self, host: str, settings: HttpSettings, security: Security | None = None):
        security = security or Security(ApiKeys())
        self.host, self.settings, self.state = host, settings, GateState()
        self.app = build_app(settings, self.state, security.keys)
        self.sock = _bind(host, settings.port)
        self.port = self.sock.getsockname()[1]
        self.tls = security.tls is not None
        self.server = _Uvicorn(uvicorn.Config(
            self.app, lifespan="off", log_config=None, access_log=False,
            timeout_graceful_shutdown=1, timeout_keep_alive=30, **_ssl_options(security.tls)))
        self._task: asyncio.Future | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    @classmethod
    async def start(cls, host: str, settings: HttpSettings,
                    security: Security | None = None) -> "HttpServer":
        """Listen (TLS and the API keys as security says; None: neither), health 503 until
        attach."""
        self = cls(host, settings, security)
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
        self.state.serving = OpenAIServing(async_engine, s.served_model_name, s.chat_template,
                                           s.tool_calls, s.reasoning_parser)

    @property
    def num_in_flight(self) -> int:
        return self.state.num_in_flight

    async def begin_drain(self) -> None:
        """503 for every new request from now on (/health included)."""
        self.state.draining = True

    async def wait_idle(self, deadline: float) -> bool:
        """Wait until no request is in flight or time.monotonic() passes deadline."""
        while self.state.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return not self.state.num_in_flight

    async def stop(self) -> None:
        """Stop uvicorn (cancelling what is left, which aborts their requests in the engine)."""
        self.server.should_exit = True
        if self._task is not None:
            await self._task

    async def shutdown(self, timeout: float) -> None:
        """503 for new requests, let in-flight ones finish for up to timeout seconds, then
        stop."""
        await self.begin_drain()
        await self.wait_idle(time.monotonic() + timeout)
        await self.stop()
