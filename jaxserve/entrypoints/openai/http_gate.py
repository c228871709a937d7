"""The HTTP front end's gate: ASGI middleware that checks every request before any route runs.

In order: the API key (401 when keys are set, one message for a missing and a wrong key;
entrypoints/security.py's ApiKeys compares in constant time against every key), the body size
(413: Content-Length against the limit, or a chunked body read here up to it), a JSON Content-Type on the generation, tokenize
and detokenize routes (415), readiness (503 while starting, draining or after the engine
died), and the client's bound (429 with Retry-After once the client, its API key when one is
set or else its address, has max_queued_requests_per_key requests on those routes in flight;
engine/client_limits.py). It counts the requests in flight, which shutdown waits on, and
each client's until its request ends, however it ends (a streamed response included).
Probes, scrapers and the schema (/health, /metrics, /version, /openapi.json, /docs) pass without any check. No routes,
no engine calls: it reads only the state that http_server.py gives it.
"""

from __future__ import annotations

import time

from fastapi.responses import JSONResponse

from jaxserve.engine.client_limits import ClientLimitError, http_client
from jaxserve.entrypoints.openai.errors import OpenAIError, error_for_exception
from jaxserve.entrypoints.security import UNAUTHENTICATED_MESSAGE, ApiKeys

# Paths served whatever the state and without the API key (probes, scrapers, the schema).
_OPEN_PATHS = {"/health", "/metrics", "/version", "/openapi.json", "/docs", "/redoc",
               "/docs/oauth2-redirect"}
_JSON_PATHS = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize",
               "/detokenize"}


class GateState:
    """What the routes and the gate share; `serving` (an OpenAIServing) is None until attach."""

    def __init__(self):
        self.serving = None
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


async def send_error(error: OpenAIError, scope, receive, send) -> None:
    await JSONResponse(error.body(), error.status, error.headers)(scope, receive, send)


class Gate:
    """ASGI middleware before any route: API key, body size, content type, readiness, the
    client's bound, and the in-flight counts."""

    def __init__(self, app, settings: HttpSettings, state: GateState, keys: ApiKeys):
        self.app, self.settings, self.state, self.keys = app, settings, state, keys

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in _OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if len(self.keys):
            given = [v for k, v in scope["headers"] if k == b"authorization"]
            if len(given) != 1 or not self.keys.allows(given[0]):
                return await send_error(OpenAIError(
                    401, f"{UNAUTHENTICATED_MESSAGE}: send the header 'Authorization: Bearer "
                         "<key>'", "authorization", "authentication_error",
                    {"WWW-Authenticate": "Bearer"}), scope, receive, send)
        limit = self.settings.max_body_bytes
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > limit:
            return await send_error(OpenAIError(
                413, f"the request body ({length.decode('latin-1')} bytes) exceeds the limit of "
                     f"{limit} bytes", "body", "request_too_large"), scope, receive, send)
        if scope["path"] in _JSON_PATHS and scope["method"] == "POST":
            given = headers.get(b"content-type", b"").decode("latin-1")
            if given.partition(";")[0].strip().lower() != "application/json":
                return await send_error(OpenAIError(
                    415, f"the request body must be JSON, sent with the header 'Content-Type: "
                         f"application/json' (got {given or 'none'!r})", "content-type",
                    "unsupported_media_type"), scope, receive, send)
        reason = self.state.unavailable()
        if reason is not None:
            return await send_error(OpenAIError(503, reason, None, "service_unavailable"),
                                     scope, receive, send)
        if scope["path"] not in _JSON_PATHS:
            return await self._counted(scope, receive, send, headers, limit)
        # The routes that do work count against their client until they end.
        clients = self.state.serving.async_engine.clients
        client = http_client(scope, headers, keyed=len(self.keys) > 0)  # (a checked key)
        try:
            clients.acquire(client)
        except ClientLimitError as exc:
            return await send_error(error_for_exception(exc), scope, receive, send)
        try:
            await self._counted(scope, receive, send, headers, limit)
        finally:  # however it ended: answered, failed, its client gone, cancelled
            clients.release(client)

    async def _counted(self, scope, receive, send, headers: dict, limit: int) -> None:
        """The route, counted in flight; a chunked body is read first, up to the limit."""
        if b"content-length" not in headers and scope["method"] == "POST":
            # A chunked body has no length to check first: read it here, up to the limit.
            messages, received, more = [], 0, True
            while more:
                message = await receive()
                if message["type"] != "http.request":
                    return
                received += len(message.get("body", b""))
                if received > limit:
                    return await send_error(OpenAIError(
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
