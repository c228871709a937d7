"""The server process: both front ends (gRPC, and the OpenAI HTTP API) over one engine.

run_server: listen first with health NOT_SERVING, build the engine (load + compile)
on a worker thread while health checks are answered, then SERVING. On SIGTERM/SIGINT: health
NOT_SERVING and every new call UNAVAILABLE (answered by the handlers, which keep running),
in-flight calls drained for up to shutdown_timeout seconds, the rest ended UNAVAILABLE and
aborted in the engine; then the process exits 0, its exit closing the listener (never a
grpc stop that would CANCEL racing calls: process.exit_now). If the engine fails: every
in-flight call INTERNAL, health NOT_SERVING, new calls UNAVAILABLE, exit 1.
data_parallel_size N > 1: N engine processes behind the same front ends instead of one engine
here (entrypoints/data_parallel/: a rank that dies fails its own requests only; the server
goes down as above once every rank is dead).

Composes grpc/server.py's GrpcServer, openai/http_server.py's HttpServer, the Engine, its
AsyncEngine and the metrics endpoint; it handles no request itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from jaxserve.config import EngineConfig, SecurityConfig, compatibility
from jaxserve.config.reasoning import ReasoningSettings
from jaxserve.config.tool_calls import ToolCallSettings
from jaxserve.engine.async_engine import AsyncEngine, EngineDeadError
from jaxserve.entrypoints.grpc.server import GrpcServer
from jaxserve.entrypoints.process import exit_now, in_daemon_thread, install_stop_signals
from jaxserve.entrypoints.security import Security

log = logging.getLogger(__name__)
# After an engine failure, health probes get this long to see NOT_SERVING (and load balancers
# to route away) before the port closes and the process exits 1.
DEAD_LINGER_S = 1.0


async def serve(engine_config: EngineConfig, host: str, port: int, shutdown_timeout: float,
                loaded=None, metrics_port: int | None = None, http=None,
                exit_process: bool = False, security: SecurityConfig | None = None,
                reasoning: ReasoningSettings | None = None,
                tool_calls: ToolCallSettings | None = None,
                data_parallel_size: int = 1) -> int:
    """run_server's body, on the running event loop; returns the exit code. http: an
    http_server.HttpSettings to serve the OpenAI HTTP API too, over the same AsyncEngine (None:
    gRPC only). exit_process: once drained, end the process with the code (see exit_now).
    security: API keys and TLS files for both ports, read and checked before either listens;
    reasoning: both ports' reasoning parser (None: http's own, none on gRPC); tool_calls: both
    front ends' tool-calling settings (None: the defaults); data_parallel_size: engine
    processes (1: one engine in this process)."""
    from jaxserve.engine.engine import Engine

    if data_parallel_size > 1 and loaded is not None:
        raise ValueError("data_parallel_size > 1 loads the model in each rank process: a "
                         "preloaded model (loaded) cannot be given")
    compatibility.check_data_parallel(
        data_parallel_size, rollout_endpoints=http is not None and http.enable_rollout_endpoints)

    parser = None if reasoning is None else reasoning.reasoning_parser
    if reasoning is not None and http is not None:
        http = dataclasses.replace(http, reasoning_parser=parser)
    if tool_calls is not None and http is not None:
        http = dataclasses.replace(http, tool_calls=tool_calls)

    guard = Security.load(security)
    if (warning := guard.exposure_warning(host)) is not None:
        log.warning(warning)
    stop = asyncio.Event()
    install_stop_signals(stop)
    handle = await GrpcServer.start(host, port, security=guard, reasoning_parser=parser,
                                    tool_calls=tool_calls)
    log.info("jaxserve gRPC server listening on %s (%s; health NOT_SERVING until the engine "
             "is ready)", handle.address, guard.describe())
    fronts = [handle]
    if http is not None:
        from jaxserve.entrypoints.openai.http_server import HttpServer
        try:
            fronts.append(await HttpServer.start(host, http, guard))
        except BaseException:
            await handle.server.stop(0)
            raise
        log.info("jaxserve HTTP (OpenAI API) server listening on %s (/health 503 until the "
                 "engine is ready)", fronts[1].url)
    if data_parallel_size > 1:
        from jaxserve.entrypoints.data_parallel.client import DataParallelClient
        loading = asyncio.ensure_future(
            DataParallelClient.launch(engine_config, data_parallel_size,
                                      http.served_model_name if http is not None else None))
    else:
        loading = in_daemon_thread(lambda: Engine(engine_config, loaded=loaded))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not loading.done():
        log.info("stop signal during loading: exiting without serving")
        loading.cancel()  # data parallel: ends the rank processes
        await asyncio.gather(*(front.shutdown(0) for front in fronts))
        return 0
    try:
        engine = loading.result()
    except BaseException:
        stopping.cancel()
        await handle.server.stop(0)
        await asyncio.gather(*(front.shutdown(0) for front in fronts[1:]))
        raise
    if data_parallel_size > 1:
        async_engine = engine
    else:
        if http is not None and http.served_model_name:  # vllm:* metrics' model_name label
            engine.metrics.vllm.set_model_name(http.served_model_name)
        async_engine = AsyncEngine(engine)
    engine = async_engine.engine
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
               http=None, security: SecurityConfig | None = None,
               reasoning: ReasoningSettings | None = None,
               tool_calls: ToolCallSettings | None = None, data_parallel_size: int = 1) -> int:
    """The server process: serve until SIGTERM/SIGINT, drain, then end the process with exit
    code 0 (1 when the engine failed); it returns only when loading fails or a stop signal came
    during loading, and raises ValueError before listening when security's files are bad.
    http: HttpSettings to serve the OpenAI HTTP API too (None: off); security: API keys and
    TLS for both (None: neither); reasoning: both ports' reasoning parser; tool_calls: both
    front ends' tool-calling settings; data_parallel_size: engine processes behind the front
    ends (1: one engine in this process)."""
    return asyncio.run(serve(engine_config, host, port, shutdown_timeout, loaded=loaded,
                             metrics_port=metrics_port, http=http, exit_process=True,
                             security=security, reasoning=reasoning, tool_calls=tool_calls,
                             data_parallel_size=data_parallel_size))
