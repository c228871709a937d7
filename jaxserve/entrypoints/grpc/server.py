"""The gRPC server: jaxserve.v1.JaxServe (Generate, Tokenize, ModelInfo), health and reflection.

Threading: one asyncio event loop runs grpc.aio and every handler; the engine steps on
AsyncEngine's own thread. Handlers never touch the scheduler, page manager or runner: they read
fixed engine facts (config, tokenizer, model config, page size) and talk to the engine only
through AsyncEngine.generate, whose iterator is always closed when a handler ends, so a
cancelled call or a passed deadline aborts the request in the engine and frees its pages.
Prompt size limits are checked before tokenizing; chat templating and long prompts are
tokenized on AsyncEngine's bounded text pool, never on the loop. A call's gRPC deadline goes
with its request: one still queued when it passes is dropped before it uses the device.

Lifecycle (run_server): listen first with health NOT_SERVING, build the engine (load + compile)
on a worker thread while health checks are answered, then SERVING. On SIGTERM/SIGINT: health
NOT_SERVING and every new call UNAVAILABLE (answered by the handlers, which keep running),
in-flight calls drained for up to shutdown_timeout seconds, the rest ended UNAVAILABLE and
aborted in the engine; then the process exits 0, its exit closing the listener (never a
grpc stop that would CANCEL racing calls: process.exit_now). If the engine fails: every
in-flight call INTERNAL, health NOT_SERVING, new calls UNAVAILABLE, exit 1.

Status codes (grpc/errors.py): an undecodable request, a RequestError (core/intake.py: every
check on a request) or another ValueError before the first token -> INVALID_ARGUMENT; a full
queue, or a request the KV page pool can never hold (RequestError.exceeds_kv_pool) ->
RESOURCE_EXHAUSTED; starting, draining or a dead engine -> UNAVAILABLE; a failed engine, or any
other failure of one request -> INTERNAL (the server goes on unless the engine failed). This
module does no sampling, scheduling or device work.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time

import grpc
from grpc._cython import cygrpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxserve.engine.async_engine import AsyncEngine, EngineDeadError
from jaxserve.config import EngineConfig
from jaxserve.config.tool_calls import ToolCallSettings
from jaxserve.core.request import SamplingParams
from jaxserve.entrypoints.prompt_intake import encode
from jaxserve.entrypoints.grpc import chat as chat_input
from jaxserve.entrypoints.grpc import convert
from jaxserve.entrypoints.grpc.errors import StatusError, add_servicer, status_for_exception
from jaxserve.entrypoints.grpc.pb import jaxserve_pb2 as pb
from jaxserve.entrypoints.openai.tool_calls import tool_parser_class
from jaxserve.entrypoints.process import exit_now, in_daemon_thread, install_stop_signals
from jaxserve.entrypoints.grpc.pb import jaxserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["JaxServe"].full_name  # "jaxserve.v1.JaxServe"
# After an engine failure, health probes get this long to see NOT_SERVING (and load balancers
# to route away) before the port closes and the process exits 1.
DEAD_LINGER_S = 1.0


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _write(context, response) -> bool:
    """Send one response; False when grpc refuses it because the call is already over: the
    client cancelled or went away, or the deadline passed, as the write raced it (grpc's state
    may not say so yet: context.done() can still be False). No status can follow a refused
    write, so the handler just returns, and closing the stream aborts the engine request."""
    try:
        await context.write(response)
        return True
    except cygrpc.BaseError as exc:  # grpc's ExecuteBatchError / UsageError have no public type
        log.info("a response write found the call already ended: %r", exc)
        return False


def _deadline(context) -> float | None:
    """The call's gRPC deadline as a time.monotonic() instant (None: no deadline)."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


class JaxServeServicer(pb_grpc.JaxServeServicer):
    """The JaxServe handlers; async_engine is None until the engine is ready."""

    def __init__(self, async_engine: AsyncEngine | None = None,
                 tool_calls: ToolCallSettings | None = None):
        self.async_engine = async_engine
        self.tool_parser = tool_parser_class((tool_calls or ToolCallSettings()).auto_parser)
        self.draining = False
        self.num_in_flight = 0     # Generate calls past the readiness check, not yet ended
        self.max_request_bytes = 4 << 20  # grpc's own default, until an engine sets its limit

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

    async def _prompt(self, async_engine: AsyncEngine, request: pb.GenerateRequest,
                      params: SamplingParams):
        """(text, token ids, params, replies); a chat is size-checked, then planned (tools:
        grpc/chat.py), templated and tokenized on the text pool."""
        if request.WhichOneof("prompt") == "token_ids":
            async_engine.limits.check_num_tokens(len(request.token_ids.ids))
        if request.WhichOneof("prompt") != "chat":
            return (*convert.prompt_from_proto(request, async_engine.engine.tokenizer), params,
                    None)
        async_engine.limits.check_messages(chat_input.texts(request.chat), "chat.messages")
        ids, plan, params = await async_engine.text_pool.run(
            chat_input.prompt_and_plan, async_engine.engine.tokenizer, request.chat, params,
            self.tool_parser)
        replies = chat_input.Replies(plan, self.tool_parser) if plan.mode != "none" else None
        return None, ids, params, replies

    async def Generate(self, request: pb.GenerateRequest, context):
        async_engine = await self._engine(context)
        self.num_in_flight += 1
        try:
            await self._generate(async_engine, request, context)
        finally:
            self.num_in_flight -= 1

    async def _generate(self, async_engine: AsyncEngine, request, context) -> None:
        try:
            params = convert.sampling_from_proto(request.sampling)
            text, token_ids, params, replies = await self._prompt(async_engine, request,
                                                                  params)
        except Exception as exc:
            await context.abort(*status_for_exception(exc, validating=True))
        stream = async_engine.generate(text, params, request_id=request.request_id or None,
                                       priority=request.priority, prompt_token_ids=token_ids,
                                       deadline=_deadline(context))
        started, error, reported = False, None, set()
        # aclosing: however this handler ends (cancelled, deadline, error), the engine's
        # iterator is closed, which aborts an unfinished request.
        async with contextlib.aclosing(stream):
            try:
                async for out in stream:
                    started = True
                    if out.finished and out.finish_reason not in convert.ENGINE_FINISH_REASONS:
                        error = self._finish_error(out)
                        break
                    for response in convert.responses_from_output(
                            out, params.logprobs is not None, reported, replies):
                        if not await _write(context, response):
                            return
            except Exception as exc:
                error = status_for_exception(exc, validating=not started)
        if error is not None and error[0] == grpc.StatusCode.DEADLINE_EXCEEDED:
            # The engine's deadline is the call's: grpc ends the call with DEADLINE_EXCEEDED
            # (and cancels this handler) as it passes; a status sent now could race it and fail.
            await asyncio.sleep((context.time_remaining() or 0.0) + 1.0)
        if error is not None and not context.done():
            await context.abort(*error)

    @staticmethod
    def _finish_error(out) -> StatusError:
        """A request refused at intake never gets here (make_request raised RequestError), so
        an error finish is the engine's failure."""
        if out.finish_reason == "abort":
            return grpc.StatusCode.ABORTED, f"request {out.request_id} was aborted by the server"
        return grpc.StatusCode.INTERNAL, out.error or "request failed in the engine"

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        async_engine = await self._engine(context)
        try:
            text, token_ids = await self._tokenize(async_engine, request)
        except Exception as exc:
            await context.abort(*status_for_exception(exc, validating=True))
        return pb.TokenizeResponse(token_ids=[int(t) for t in token_ids], prompt_text=text)

    @staticmethod
    async def _tokenize(async_engine: AsyncEngine, request: pb.TokenizeRequest):
        tokenizer, limits, pool = (async_engine.engine.tokenizer, async_engine.limits,
                                   async_engine.text_pool)
        which = request.WhichOneof("input")
        if which == "text":
            add_special = (request.add_special_tokens
                           if request.HasField("add_special_tokens") else True)
            limits.check_text(request.text, "text")
            return request.text, await pool.run(encode, tokenizer, request.text, add_special)
        if which == "chat":
            limits.check_messages(chat_input.texts(request.chat), "chat.messages")
            return await pool.run(convert.chat_prompt, tokenizer, request.chat)
        raise ValueError("input is unset: exactly one of text or chat must be set")

    async def ModelInfo(self, request: pb.ModelInfoRequest, context) -> pb.ModelInfoResponse:
        info = (await self._engine(context)).engine.info
        return pb.ModelInfoResponse(
            model_name=info.model_name, max_model_len=info.max_model_len,
            vocab_size=info.vocab_size, page_size=info.page_size, dtype=info.dtype,
            num_pages=info.num_pages, max_num_seqs=info.max_num_seqs,
            eos_token_ids=list(info.eos_token_ids), quantization=info.quantization,
            weight_bytes=info.weight_bytes,
            weight_groups=[pb.WeightGroup(group=g, format=f, bytes=n)
                           for g, f, n in info.weight_formats])


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

    @property
    def num_in_flight(self) -> int:
        return self.servicer.num_in_flight

    @classmethod
    async def start(cls, host: str = "127.0.0.1", port: int = 0,
                    async_engine: AsyncEngine | None = None,
                    tool_calls: ToolCallSettings | None = None) -> "GrpcServer":
        """Listen on host:port (0: a free port); SERVING at once when an engine is given.
        tool_calls: the tool-calling settings (tool_choice "auto")."""
        servicer = JaxServeServicer(tool_calls=tool_calls)
        # No SO_REUSEPORT: a second server on a busy port must fail, not share its traffic.
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_servicer = health.aio.HealthServicer()
        add_servicer(servicer, server)
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
        self.servicer.max_request_bytes = async_engine.limits.max_request_bytes
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self._watch = asyncio.ensure_future(self._watch_engine(async_engine))

    async def _watch_engine(self, async_engine: AsyncEngine, period: float = 0.05) -> None:
        """Health NOT_SERVING once the engine thread has died (calls then get UNAVAILABLE)."""
        while async_engine.error is None:
            await asyncio.sleep(period)
        log.error("the engine failed (%r): health NOT_SERVING", async_engine.error)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.engine_dead.set()

    async def begin_drain(self) -> None:
        """Health NOT_SERVING and every new call UNAVAILABLE, answered by the handlers (the
        listener stays open, so no call races a closing server into CANCELLED)."""
        self.servicer.draining = True  # first: no handler may start between the two
        await self.health.enter_graceful_shutdown()
        if self._watch is not None:
            self._watch.cancel()

    async def wait_idle(self, deadline: float) -> bool:
        """Wait until no Generate call is in flight or time.monotonic() passes deadline."""
        while self.servicer.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return not self.servicer.num_in_flight

    async def stop(self, grace: float = 1.0) -> None:
        """Close the listener; calls still running get grace seconds, then are cancelled."""
        await self.server.stop(grace=grace)

    async def shutdown(self, timeout: float) -> None:
        """Drain for up to timeout seconds, then stop (cancelling what is left, which aborts
        their requests in the engine)."""
        await self.begin_drain()
        await self.wait_idle(time.monotonic() + timeout)
        await self.stop(grace=0.5)


async def serve(engine_config: EngineConfig, host: str, port: int, shutdown_timeout: float,
                loaded=None, metrics_port: int | None = None, http=None,
                exit_process: bool = False, tool_calls: ToolCallSettings | None = None) -> int:
    """run_server's body, on the running event loop; returns the exit code. http: an
    http_server.HttpSettings to serve the OpenAI HTTP API too, over the same AsyncEngine (None:
    gRPC only). exit_process: once drained, end the process with the code (see exit_now).
    tool_calls: both front ends' tool-calling settings (None: the defaults)."""
    from jaxserve.engine.engine import Engine

    if tool_calls is not None and http is not None:
        http = dataclasses.replace(http, tool_calls=tool_calls)
    stop = asyncio.Event()
    install_stop_signals(stop)
    handle = await GrpcServer.start(host, port, tool_calls=tool_calls)
    log.info("jaxserve gRPC server listening on %s (health NOT_SERVING until the engine is "
             "ready)", handle.address)
    fronts = [handle]
    if http is not None:
        from jaxserve.entrypoints.openai.http_server import HttpServer
        try:
            fronts.append(await HttpServer.start(host, http))
        except BaseException:
            await handle.server.stop(0)
            raise
        log.info("jaxserve HTTP (OpenAI API) server listening on %s (/health 503 until the "
                 "engine is ready)", fronts[1].url)
    loading = in_daemon_thread(lambda: Engine(engine_config, loaded=loaded))
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
    if not stopping.done():  # every open stream has failed: let the handlers say so, exit 1
        stopping.cancel()
        await _drain(fronts, async_engine, 5.0, "engine failed", DEAD_LINGER_S, exit_process)
        async_engine.stop(timeout=10.0)
        return exit_now(1) if exit_process else 1
    dead.cancel()
    await _drain(fronts, async_engine, shutdown_timeout, "stop signal", 0.0, exit_process)
    async_engine.stop(timeout=10.0)
    if metrics_http is not None:
        metrics_http.shutdown()
    log.info("shutdown complete")
    return exit_now(0) if exit_process else 0


async def _drain(fronts, async_engine: AsyncEngine, timeout: float, why: str,
                 linger: float = 0.0, exiting: bool = False) -> None:
    """Every front refuses new calls (UNAVAILABLE / 503) at once; in-flight ones get timeout
    seconds to finish, then end UNAVAILABLE / 503 (their requests aborted in the engine); then,
    after linger seconds more of refusing, the listeners close. exiting: the process ends next,
    so the gRPC listener is left open for exit_now to close."""
    for front in fronts:
        await front.begin_drain()
    log.info("%s: draining %d in-flight request(s) for up to %.1f s", why,
             async_engine.num_in_flight, timeout)
    idle = await asyncio.gather(*(front.wait_idle(time.monotonic() + timeout)
                                  for front in fronts))
    if not all(idle):
        num = async_engine.abort_all(EngineDeadError(
            f"the server shut down before this request finished (shutdown timeout "
            f"{timeout:g} s)"))
        log.info("shutdown timeout: %d request(s) aborted", num)
        await asyncio.gather(*(front.wait_idle(time.monotonic() + 5.0) for front in fronts))
    await asyncio.sleep(linger)
    await asyncio.gather(*(front.stop() for front in fronts
                           if not (exiting and isinstance(front, GrpcServer))))


def run_server(engine_config: EngineConfig, host: str = "127.0.0.1", port: int = 50051,
               shutdown_timeout: float = 30.0, loaded=None, metrics_port: int | None = None,
               http=None, tool_calls: ToolCallSettings | None = None) -> int:
    """The server process: serve until SIGTERM/SIGINT, drain, then end the process with exit
    code 0 (1 when the engine failed); it returns only when loading fails or a stop signal came
    during loading. http: HttpSettings to serve the OpenAI HTTP API too (None: off);
    tool_calls: both front ends' tool-calling settings."""
    return asyncio.run(serve(engine_config, host, port, shutdown_timeout, loaded=loaded,
                             metrics_port=metrics_port, http=http, exit_process=True,
                             tool_calls=tool_calls))
