"""The gRPC server: jaxserve.v1.JaxServe (Generate, Tokenize, ModelInfo), health and reflection.

Threading: one asyncio event loop runs grpc.aio and every handler; the engine steps on
AsyncEngine's own thread. Handlers never touch the scheduler, page manager or runner: they read
fixed engine facts (config, tokenizer, model config, page size) and talk to the engine only
through AsyncEngine.generate, whose iterator is always closed when a handler ends, so a
cancelled call or a passed deadline aborts the request in the engine and frees its pages.
Tokenization (and chat templating) runs on the loop, in the handler.

Lifecycle (run_server): listen first with health NOT_SERVING, build the engine (load + compile)
on a worker thread while health checks are answered, then SERVING. On SIGTERM/SIGINT: health
NOT_SERVING, new calls refused with UNAVAILABLE, in-flight calls drained for up to
shutdown_timeout seconds, the rest cancelled (which aborts them), engine thread stopped, exit 0.
If the engine thread dies: health NOT_SERVING, every call UNAVAILABLE, exit 1.

Status codes: ValueError before the first token (validation) -> INVALID_ARGUMENT; a full
waiting queue, or a request the KV page pool can never hold -> RESOURCE_EXHAUSTED; starting,
draining or a dead engine -> UNAVAILABLE; any other failure of one request -> INTERNAL, and the
server goes on. This module does no sampling, scheduling or device work.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxserve.async_engine import AsyncEngine, EngineDeadError
from jaxserve.config import EngineConfig
from jaxserve.engine import QueueFullError
from jaxserve.server import convert
from jaxserve.server.pb import jaxserve_pb2 as pb
from jaxserve.server.pb import jaxserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["JaxServe"].full_name  # "jaxserve.v1.JaxServe"
_StatusError = tuple[grpc.StatusCode, str]


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _never_fits(engine, out, params) -> bool:
    """The scheduler's admission rule: prompt + max_tokens pages beyond the whole pool."""
    return not out.token_ids and engine.info.never_fits(
        len(out.prompt_token_ids) + params.max_tokens)


def _status_for_exception(exc: Exception, validating: bool) -> _StatusError:
    """validating: the request has produced no output yet, so a ValueError is bad input."""
    if isinstance(exc, EngineDeadError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if validating and isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if validating and isinstance(exc, QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    log.error("request failed", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {exc!r}"


class JaxServeServicer(pb_grpc.JaxServeServicer):
    """The JaxServe handlers; async_engine is None until the engine is ready."""

    def __init__(self, async_engine: AsyncEngine | None = None):
        self.async_engine = async_engine
        self.draining = False

    async def _engine(self, context) -> AsyncEngine:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        if self.async_engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is starting: the engine "
                                "is loading and compiling (health is NOT_SERVING until ready)")
        if self.async_engine.error is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"engine stopped: {self.async_engine.error!r}")
        return self.async_engine

    async def Generate(self, request: pb.GenerateRequest, context):
        async_engine = await self._engine(context)
        engine = async_engine.engine
        try:
            params = convert.sampling_from_proto(request.sampling)
            text, token_ids = convert.prompt_from_proto(request, engine.tokenizer)
        except Exception as exc:
            await context.abort(*_status_for_exception(exc, validating=True))
        stream = async_engine.generate(text, params, request_id=request.request_id or None,
                                       priority=request.priority, prompt_token_ids=token_ids)
        started, error, reported = False, None, set()
        # aclosing: however this handler ends (cancelled, deadline, error), the engine's
        # iterator is closed, which aborts an unfinished request.
        async with contextlib.aclosing(stream):
            try:
                async for out in stream:
                    started = True
                    if out.finished and out.finish_reason not in convert.FINISH_REASONS:
                        error = self._finish_error(engine, out, params)
                        break
                    for response in convert.responses_from_output(
                            out, params.logprobs is not None, reported):
                        await context.write(response)
            except Exception as exc:
                error = _status_for_exception(exc, validating=not started)
        if error is not None:
            await context.abort(*error)

    @staticmethod
    def _finish_error(engine, out, params) -> _StatusError:
        if out.finish_reason == "abort":
            return grpc.StatusCode.ABORTED, f"request {out.request_id} was aborted by the server"
        message = out.error or "request failed in the engine"
        if _never_fits(engine, out, params):
            return grpc.StatusCode.RESOURCE_EXHAUSTED, message
        return grpc.StatusCode.INTERNAL, message

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        tokenizer = (await self._engine(context)).engine.tokenizer
        try:
            which = request.WhichOneof("input")
            if which == "text":
                add_special = (request.add_special_tokens
                               if request.HasField("add_special_tokens") else True)
                text = request.text
                token_ids = tokenizer.encode(text, add_special_tokens=add_special)
            elif which == "chat":
                text, token_ids = convert.chat_prompt(tokenizer, request.chat)
            else:
                raise ValueError("input is unset: exactly one of text or chat must be set")
        except Exception as exc:
            await context.abort(*_status_for_exception(exc, validating=True))
        return pb.TokenizeResponse(token_ids=[int(t) for t in token_ids], prompt_text=text)

    async def ModelInfo(self, request: pb.ModelInfoRequest, context) -> pb.ModelInfoResponse:
        info = (await self._engine(context)).engine.info
        return pb.ModelInfoResponse(
            model_name=info.model_name, max_model_len=info.max_model_len,
            vocab_size=info.vocab_size, page_size=info.page_size, dtype=info.dtype,
            num_pages=info.num_pages, max_num_seqs=info.max_num_seqs,
            eos_token_ids=list(info.eos_token_ids))


class GrpcServer:
    """A listening grpc.aio server: JaxServe + health + reflection. Build it with `start`."""

    def __init__(self, server: grpc.aio.Server, host: str, port: int,
                 servicer: JaxServeServicer, health_servicer: health.aio.HealthServicer):
        self.server, self.host, self.port = server, host, port
        self.servicer, self.health = servicer, health_servicer
        self.engine_dead = asyncio.Event()
        self._watch: asyncio.Task | None = None

    @property
    def address(self) -> str:
        return _host_port(self.host, self.port)

    @classmethod
    async def start(cls, host: str = "127.0.0.1", port: int = 0,
                    async_engine: AsyncEngine | None = None) -> "GrpcServer":
        """Listen on host:port (0: a free port); SERVING at once when an engine is given."""
        # No SO_REUSEPORT: a second server on a busy port must fail, not share its traffic.
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        servicer = JaxServeServicer()
        health_servicer = health.aio.HealthServicer()
        pb_grpc.add_JaxServeServicer_to_server(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        try:
            bound = server.add_insecure_port(_host_port(host, port))
        except RuntimeError as exc:  # grpc's "Failed to bind"
            raise OSError(f"cannot listen on {_host_port(host, port)}: {exc}") from None
        self = cls(server, host, bound, servicer, health_servicer)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        if async_engine is not None:
            await self.attach(async_engine)
        return self

    async def _set_health(self, status) -> None:
        for service in (health.OVERALL_HEALTH, SERVICE_NAME):
            await self.health.set(service, status)

    async def attach(self, async_engine: AsyncEngine) -> None:
        """Serve with this (started) engine: health becomes SERVING."""
        self.servicer.async_engine = async_engine
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self._watch = asyncio.ensure_future(self._watch_engine(async_engine))

    async def _watch_engine(self, async_engine: AsyncEngine, period: float = 0.25) -> None:
        """Health NOT_SERVING once the engine thread has died (calls then get UNAVAILABLE)."""
        while async_engine.error is None:
            await asyncio.sleep(period)
        log.error("the engine thread died (%r): health NOT_SERVING", async_engine.error)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.engine_dead.set()

    async def shutdown(self, timeout: float) -> None:
        """NOT_SERVING, refuse new calls, drain in-flight ones for up to timeout seconds, then
        cancel the rest (their requests are aborted in the engine)."""
        await self.health.enter_graceful_shutdown()
        self.servicer.draining = True
        if self._watch is not None:
            self._watch.cancel()
        await self.server.stop(grace=timeout)


def _in_daemon_thread(fn) -> asyncio.Future:
    """fn() on a daemon thread (a stop signal during loading must not wait for it)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(setter, value):
        if not future.done():
            setter(value)

    def target():
        try:
            result = fn()
        except BaseException as exc:
            loop.call_soon_threadsafe(settle, future.set_exception, exc)
        else:
            loop.call_soon_threadsafe(settle, future.set_result, result)

    threading.Thread(target=target, name="jaxserve-load", daemon=True).start()
    return future


def _install_stop_signals(stop: asyncio.Event) -> None:
    """SIGTERM/SIGINT set stop. Signals reach only the main thread: run_server elsewhere never
    sees them (embed a GrpcServer and call shutdown instead)."""
    if threading.current_thread() is not threading.main_thread():
        return
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except NotImplementedError:  # event loops without signal support (Windows)
            signal.signal(sig, lambda *_: loop.call_soon_threadsafe(stop.set))


async def serve(engine_config: EngineConfig, host: str, port: int, shutdown_timeout: float,
                loaded=None, metrics_port: int | None = None, http=None) -> int:
    """run_server's body, on the running event loop. http: an http_server.HttpSettings to
    serve the OpenAI HTTP API too, over the same AsyncEngine (None: gRPC only)."""
    from jaxserve.engine import Engine

    stop = asyncio.Event()
    _install_stop_signals(stop)
    handle = await GrpcServer.start(host, port)
    log.info("jaxserve gRPC server listening on %s (health NOT_SERVING until the engine is "
             "ready)", handle.address)
    fronts = [handle]
    if http is not None:
        from jaxserve.server.http_server import HttpServer
        try:
            fronts.append(await HttpServer.start(host, http))
        except BaseException:
            await handle.server.stop(0)
            raise
        log.info("jaxserve HTTP (OpenAI API) server listening on %s (/health 503 until the "
                 "engine is ready)", fronts[1].url)
    loading = _in_daemon_thread(lambda: Engine(engine_config, loaded=loaded))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not loading.done():
        log.info("stop signal during loading: exiting without serving")
        await asyncio.gather(*(front.shutdown(0) for front in fronts))
        return 0
    try:
        engine = loading.result()
    except BaseException:
        stopping.cancel()
        await handle.server.stop(0)
        await asyncio.gather(*(front.shutdown(0) for front in fronts[1:]))
        raise
    async_engine = AsyncEngine(engine)
    async_engine.start()
    metrics_http = None
    if metrics_port is not None:
        metrics_http, _ = engine.metrics.serve_http(metrics_port, host)
        log.info("Prometheus metrics on http://%s:%d/metrics", host, metrics_http.server_port)
    await handle.attach(async_engine)
    for front in fronts[1:]:
        front.attach(async_engine)
    log.info("serving %s on %s: max_model_len %d, %d KV pages of %d tokens (health SERVING)",
             engine.info.model_name, handle.address, engine.info.max_model_len,
             engine.info.num_pages, engine.info.page_size)
    dead = asyncio.ensure_future(handle.engine_dead.wait())
    await asyncio.wait({stopping, dead}, return_when=asyncio.FIRST_COMPLETED)
    if not stopping.done():  # nothing left to drain: every open stream has failed
        stopping.cancel()
        await asyncio.gather(*(front.shutdown(0) for front in fronts))
        return 1
    dead.cancel()
    log.info("stop signal: draining %d in-flight request(s) for up to %.1f s",
             async_engine.num_in_flight, shutdown_timeout)
    await asyncio.gather(*(front.shutdown(shutdown_timeout) for front in fronts))
    async_engine.stop(timeout=10.0)
    if metrics_http is not None:
        metrics_http.shutdown()
    log.info("shutdown complete")
    return 0


def run_server(engine_config: EngineConfig, host: str = "127.0.0.1", port: int = 50051,
               shutdown_timeout: float = 30.0, loaded=None, metrics_port: int | None = None,
               http=None) -> int:
    """Serve until SIGTERM/SIGINT, then drain and return 0 (the process exit code); 1 when the
    engine thread dies. http: HttpSettings to serve the OpenAI HTTP API too (None: off)."""
    return asyncio.run(serve(engine_config, host, port, shutdown_timeout, loaded=loaded,
                             metrics_port=metrics_port, http=http))
