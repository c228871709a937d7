"""One data-parallel rank: a process that builds its own Engine on its own CPU cores and devices
and serves the front end's requests through an AsyncEngine, over ZMQ (wire.py).

Started by launch.py with multiprocessing's spawn (a fresh interpreter: no state of the front
end's process, and the CPU set and device environment applied before jax makes its backend).
Its asyncio loop reads `add` / `abort` / `stop` from its PULL socket; each request is a task
walking AsyncEngine.generate and queueing every output for the PUSH socket, which sends what a
turn of the loop queued as one batch. Every STATS_PERIOD_S it sends its EngineStats and
Prometheus exposition when they changed. It exits when told to stop (0), when its engine fails
(1, after its requests got the failure), or when the front end's process is gone (its parent
pid changes, or the kernel's parent-death signal where Linux gives one). No routing here, no
HTTP or gRPC.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import pickle
import signal
import time

import zmq
import zmq.asyncio

from jaxserve.entrypoints.data_parallel import wire

log = logging.getLogger(__name__)
STATS_PERIOD_S = 0.2
STATS_MAX_AGE_S = 2.0  # sent at least this often even when nothing changed (a liveness sign)


def rank_main(rank: int, config, in_address: str, out_address: str, cpus: list[int] | None,
              environment: dict[str, str], log_level: str,
              served_model_name: str | None = None) -> None:
    """The process's target: CPU set and environment first, then the engine, then serve."""
    _die_with_parent()
    if cpus:
        os.sched_setaffinity(0, cpus)
    os.environ.update(environment)
    from jaxserve.entrypoints.logging_setup import configure
    configure(log_level)
    parent = os.getppid()
    code = asyncio.run(_serve(rank, config, in_address, out_address, parent,
                              served_model_name))
    from jaxserve.entrypoints.process import exit_now
    exit_now(code)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent exits (the front end ends with os._exit,
    which runs no clean-up that could stop its ranks)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # elsewhere the parent-pid check in _watch does it


class _Sender:
    """Queues items; what one turn of the event loop queued leaves as one message."""

    def __init__(self, socket: zmq.Socket):
        self.socket, self.items, self.scheduled = socket, [], False

    def put(self, item) -> None:
        self.items.append(item)
        if not self.scheduled:
            self.scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        items, self.items, self.scheduled = self.items, [], False
        if items:
            self.socket.send(wire.pack(items))


async def _serve(rank: int, config, in_address: str, out_address: str, parent: int,
                 served_model_name: str | None) -> int:
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.engine.engine import Engine

    ctx = zmq.asyncio.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(in_address)
    sync_ctx = zmq.Context()
    outbox = sync_ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDHWM, 0)  # never block the loop: the front end reads all along
    outbox.connect(out_address)
    sender = _Sender(outbox)
    try:
        engine = await asyncio.get_running_loop().run_in_executor(
            None, lambda: Engine(config, progress=False, data_parallel_rank=rank))
    except Exception as exc:  # the front end fails the server with this; exit_now follows
        log.exception("data-parallel rank %d: the engine did not start", rank)
        outbox.send(wire.pack([[wire.FAILED, rank, f"{type(exc).__name__}: {exc}"]]))
        return 1
    if served_model_name:  # vllm:* metrics' model_name label, as one engine's server sets it
        engine.metrics.vllm.set_model_name(served_model_name)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    tokenizer = pickle.dumps(engine.tokenizer)
    cpus = sorted(os.sched_getaffinity(0))
    sender.put([wire.READY, rank, os.getpid(), cpus, pickle.dumps(engine.info), tokenizer])
    log.info("data-parallel rank %d ready: pid %d, CPUs %s", rank, os.getpid(), cpus)
    tasks: dict[str, asyncio.Task] = {}

    async def run(request_id, prompt_token_ids, params, priority, deadline):
        try:
            async for out in async_engine.generate(None, params, request_id=request_id,
                                                   priority=priority,
                                                   prompt_token_ids=prompt_token_ids,
                                                   deadline=deadline):
                sender.put(wire.output_item(out))
        except asyncio.CancelledError:
            pass  # stopping: generate's exit aborted it
        except Exception as exc:  # refused or failed: the front end raises it to its caller
            sender.put(wire.error_item(request_id, exc))
        finally:
            tasks.pop(request_id, None)

    async def reset(serial: int):
        await async_engine.reset_prefix_cache()
        sender.put([wire.RESET_DONE, rank, serial])

    watcher = asyncio.ensure_future(_watch(async_engine, sender, rank, parent))
    receiver = asyncio.ensure_future(_receive(inbox, async_engine, tasks, run, reset))
    done, _ = await asyncio.wait({watcher, receiver}, return_when=asyncio.FIRST_COMPLETED)
    code = next(iter(done)).result()
    for task in (watcher, receiver, *tasks.values()):
        task.cancel()
    await asyncio.sleep(0)
    sender.flush()
    async_engine.stop(timeout=5.0)
    outbox.close(linger=1000)
    inbox.close(linger=0)
    return code


async def _receive(inbox, async_engine, tasks: dict, run, reset) -> int:
    while True:
        message = wire.unpack(await inbox.recv())
        kind = message[0]
        if kind == wire.ADD:
            _, request_id, ids, params, priority, deadline = message
            tasks[request_id] = asyncio.ensure_future(
                run(request_id, ids, pickle.loads(params), priority, deadline))
        elif kind == wire.ABORT:  # the engine's abort output ends the task's stream
            async_engine.abort(message[1])
        elif kind == wire.RESET:
            tasks[f"reset {message[1]}"] = asyncio.ensure_future(reset(message[1]))
        elif kind == wire.STOP:
            return 0


async def _watch(async_engine, sender: _Sender, rank: int, parent: int) -> int:
    """Stats to the front end; the exit code once the engine failed or the parent is gone."""
    from prometheus_client import generate_latest

    engine, last, sent_at = async_engine.engine, None, 0.0
    while True:
        await asyncio.sleep(STATS_PERIOD_S)
        if async_engine.error is not None:
            await asyncio.sleep(0.1)  # the failed requests' errors leave first
            log.error("data-parallel rank %d: engine failed (%r): exiting", rank,
                      async_engine.error)
            return 1
        if os.getppid() != parent:
            log.error("data-parallel rank %d: the front end's process is gone: exiting", rank)
            return 1
        stats, now = engine.stats, time.monotonic()
        if stats != last or now - sent_at > STATS_MAX_AGE_S:
            sender.put([wire.STATS, rank, pickle.dumps(stats),
                        generate_latest(engine.metrics.registry)])
            last, sent_at = stats, now
