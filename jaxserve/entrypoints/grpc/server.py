"""The gRPC server: jaxserve.v1.JaxServe (Generate, Tokenize, ModelInfo), health and reflection.

Threading: one asyncio event loop runs grpc.aio and every handler; the engine steps on
AsyncEngine's own thread. Handlers never touch the scheduler, page manager or runner: they read
fixed engine facts (config, tokenizer, model config, page size) and talk to the engine only
through AsyncEngine.generate, whose iterator is always closed when a handler ends, so a
cancelled call or a passed deadline aborts the request in the engine and frees its pages.
Prompt size limits are checked before tokenizing; chat templating and long prompts are
tokenized on AsyncEngine's text pool, never on the loop (token ids never wait for it). A call's
gRPC deadline goes with its request: one still queued when it passes is dropped before it uses
the device. A Generate or Tokenize call counts against its client (client_limits.py) until its
handler ends, however it ends.

The process around it (listen, load, serve, drain, exit) is entrypoints/serve.py's.

Status codes (grpc/errors.py): an undecodable request, a RequestError (core/intake.py: every
check on a request, a request the KV page pool can never hold included) or another ValueError
before the first token -> INVALID_ARGUMENT; a full queue or a client at its bound (both with
trailing metadata `retry-after`) -> RESOURCE_EXHAUSTED; starting,
draining or a dead engine -> UNAVAILABLE; a failed engine, or any other failure of one request
-> INTERNAL (the server goes on unless the engine failed). This module does no sampling,
scheduling or device work.

Security (grpc/auth.py): with API keys an interceptor ends calls without one UNAUTHENTICATED
before any handler runs (so a call's bearer token, a checked key, names its client for the
per-client bound); with TLS files the port serves only TLS (and, with client CAs, only clients
holding a certificate they signed). One Security serves this port and the HTTP one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc
from grpc._cython import cygrpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxserve.config.tool_calls import ToolCallSettings
from jaxserve.core.intake import RequestError
from jaxserve.core.request import SamplingParams
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.client_limits import ClientLimitError, grpc_client
from jaxserve.engine.prompt_intake import encode
from jaxserve.entrypoints.grpc import chat as chat_input
from jaxserve.entrypoints.grpc import convert
from jaxserve.entrypoints.grpc.auth import interceptors, server_credentials
from jaxserve.entrypoints.grpc.errors import (add_servicer, status_for_exception,
                                             status_for_finish)
from jaxserve.entrypoints.grpc.pb import jaxserve_pb2 as pb
from jaxserve.entrypoints.openai.reasoning import ReasoningFormat
from jaxserve.entrypoints.openai.reasoning_parsers import reasoning_parser_class
from jaxserve.entrypoints.security import ApiKeys, Security
from jaxserve.entrypoints.openai.tool_calls import tool_parser_class
from jaxserve.entrypoints.grpc.pb import jaxserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["JaxServe"].full_name  # "jaxserve.v1.JaxServe"


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
    """The JaxServe handlers; async_engine is None until the engine is ready. keyed_clients:
    API keys are configured, so a call's bearer token names its client (else its address)."""

    def __init__(self, async_engine: AsyncEngine | None = None, keyed_clients: bool = False,
                 reasoning_parser: str | None = None,
                 tool_calls: ToolCallSettings | None = None):
        self.async_engine = async_engine
        self.keyed_clients = keyed_clients
        # --reasoning-parser (checked here, before any engine): a ReasoningFormat once attached
        self.reasoning_parser = reasoning_parser and reasoning_parser_class(reasoning_parser).name
        self.reasoning = None
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

    async def _admit(self, async_engine: AsyncEngine, context) -> str:
        """Count the call against its client, or end it RESOURCE_EXHAUSTED with retry-after;
        the caller releases the returned client once the call ends."""
        client = grpc_client(context, self.keyed_clients)
        try:
            async_engine.clients.acquire(client)
        except ClientLimitError as exc:
            await context.abort(*status_for_exception(exc, validating=True))
        return client

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
        client = await self._admit(async_engine, context)
        self.num_in_flight += 1
        try:
            await self._generate(async_engine, request, context)
        finally:  # also when the call is cancelled or its deadline passes
            self.num_in_flight -= 1
            async_engine.clients.release(client)

    async def _generate(self, async_engine: AsyncEngine, request, context) -> None:
        try:
            params = convert.sampling_from_proto(request.sampling)
            text, token_ids, params, replies = await self._prompt(async_engine, request,
                                                                  params)
            params, splitter = convert.chat_reasoning(self.reasoning, request, token_ids, params)
            lora = _lora_request(async_engine, request.lora_name)
        except Exception as exc:
            await context.abort(*status_for_exception(exc, validating=True))
        stream = async_engine.generate(text, params, request_id=request.request_id or None,
                                       priority=request.priority, prompt_token_ids=token_ids,
                                       deadline=_deadline(context),
                                       **({} if lora is None else {"lora_request": lora}))
        started, error, reported = False, None, set()
        # aclosing: however this handler ends (cancelled, deadline, error), the engine's
        # iterator is closed, which aborts an unfinished request.
        async with contextlib.aclosing(stream):
            try:
                async for out in stream:
                    started = True
                    if out.finished and out.finish_reason not in convert.ENGINE_FINISH_REASONS:
                        error = status_for_finish(out)
                        break
                    for response in convert.responses_from_output(
                            out, params.logprobs is not None, reported, splitter, replies):
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

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        async_engine = await self._engine(context)
        client = await self._admit(async_engine, context)
        try:
            text, token_ids = await self._tokenize(async_engine, request)
        except Exception as exc:
            await context.abort(*status_for_exception(exc, validating=True))
        finally:
            async_engine.clients.release(client)
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
        return convert.model_info_response((await self._engine(context)).engine.info)


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
                    async_engine: AsyncEngine | None = None, security: Security | None = None,
                    reasoning_parser: str | None = None,
                    tool_calls: ToolCallSettings | None = None) -> "GrpcServer":
        """Listen on host:port (0: a free port); SERVING at once when an engine is given.
        security: the API keys and TLS files (None: neither); reasoning_parser: chats'
        reasoning apart (ValueError listing the parsers for an unknown name); tool_calls: the
        tool-calling settings (tool_choice "auto")."""
        security = security or Security(ApiKeys())
        # No SO_REUSEPORT: a second server on a busy port must fail, not share its traffic.
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)],
                                 interceptors=interceptors(security.keys,
                                                           security.grpc_open_health))
        servicer = JaxServeServicer(keyed_clients=len(security.keys) > 0,
                                    reasoning_parser=reasoning_parser, tool_calls=tool_calls)
        health_servicer = health.aio.HealthServicer()
        add_servicer(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        try:
            bound = (server.add_insecure_port(_host_port(host, port)) if security.tls is None
                     else server.add_secure_port(_host_port(host, port),
                                                 server_credentials(security.tls)))
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
        self.servicer.reasoning = ReasoningFormat.load(self.servicer.reasoning_parser,
                                                       async_engine.engine.tokenizer)
        self.servicer.max_request_bytes = async_engine.limits.max_request_bytes
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self._watch = asyncio.ensure_future(self._watch_engine(async_engine))

    async def _set_rank_health(self, ranks: dict[int, str] | None, known: dict) -> None:
        """Data parallelism: service data_parallel_rank_<r> follows rank r's health."""
        for rank, status in (ranks or {}).items():
            if known.get(rank) != status:
                known[rank] = status
                await self.health.set(f"data_parallel_rank_{rank}", (
                    health_pb2.HealthCheckResponse.SERVING if status == "serving"
                    else health_pb2.HealthCheckResponse.NOT_SERVING))

    async def _watch_engine(self, async_engine: AsyncEngine, period: float = 0.05) -> None:
        """Health NOT_SERVING once the engine thread has died (calls then get UNAVAILABLE);
        with data-parallel ranks, each rank's own service too."""
        known: dict[int, str] = {}
        await self._set_rank_health(async_engine.rank_health(), known)
        while async_engine.error is None:
            await asyncio.sleep(period)
            await self._set_rank_health(async_engine.rank_health(), known)
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


def _lora_request(async_engine: AsyncEngine, name: str):
    """The LoRARequest GenerateRequest.lora_name names (None: empty, the base model)."""
    if not name:
        return None
    registry = async_engine.engine.lora_registry
    lora = None if registry is None else registry.lookup(name)
    if lora is None:
        served = [] if registry is None else [r.lora_name for r in registry.requests]
        raise RequestError("lora_name", f"lora_name={name!r} names no LoRA adapter this "
                                        f"server serves (served: {', '.join(served) or 'none'})")
    return lora
