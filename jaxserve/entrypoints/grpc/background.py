"""ServerThread: a GrpcServer on its own asyncio loop thread, for synchronous programs and tests.

The caller owns the AsyncEngine (start and stop it); this only runs the gRPC side on a private
event loop, so a synchronous caller can serve an engine it built itself and call it with the
blocking client. It must not run the engine loop or share its event loop with anyone.
"""

from __future__ import annotations

import asyncio
import threading

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.entrypoints.grpc.server import GrpcServer
from jaxserve.entrypoints.security import Security


class ServerThread:
    def __init__(self, async_engine: AsyncEngine, host: str = "127.0.0.1", port: int = 0,
                 security: Security | None = None, tool_calls=None):
        """Listen on host:port (0: a free port) and serve async_engine (already started);
        security: API keys and TLS (Security.load(SecurityConfig(...)); None: neither);
        tool_calls: a ToolCallSettings (tool_choice "auto"), None for the defaults."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="jaxserve-grpc",
                                        daemon=True)
        self._thread.start()
        self._stopped = False
        self.handle: GrpcServer = self.call(GrpcServer.start(host, port, async_engine,
                                                               security, tool_calls=tool_calls))

    def call(self, coro, timeout: float | None = None):
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    @property
    def port(self) -> int:
        return self.handle.port

    @property
    def address(self) -> str:
        return self.handle.address

    def stop(self, timeout: float = 5.0) -> None:
        """Drain in-flight calls for up to timeout seconds, then stop the loop thread."""
        if self._stopped:
            return
        self._stopped = True
        self.call(self.handle.shutdown(timeout))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> "ServerThread":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
