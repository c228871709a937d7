"""Process-level helpers for run_server: stop signals, a daemon-thread future, and an exit that
leaves the gRPC sockets for the kernel to close.

Nothing here knows about engines or requests; entrypoints/serve.py composes them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading


def in_daemon_thread(fn) -> asyncio.Future:
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


def install_stop_signals(stop: asyncio.Event) -> None:
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


def exit_now(code: int):
    """End the process now, the gRPC server still refusing calls. grpc.aio's stop() ends a
    call that reaches the server while it closes with CANCELLED (measured: a few per shutdown
    under a steady stream of calls); the process's exit closes the sockets instead, which every
    client sees as UNAVAILABLE. Logs and stdio are flushed first; nothing else is left to run."""
    _leave_cluster()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _leave_cluster() -> None:
    """Multi-host: leave the JAX cluster as a normal exit would (its atexit hook), so that the
    followers' own shutdown finds every process at the barrier instead of a dead leader."""
    jax = sys.modules.get("jax")
    if jax is None:
        return
    try:
        from jax._src import distributed
        if distributed.global_state.client is not None:
            jax.distributed.shutdown()
    except Exception:  # exiting anyway: a failed goodbye must not change the exit code
        logging.getLogger(__name__).exception("leaving the JAX cluster failed")
