"""AsyncEngine: runs Engine.step() on its own thread for asyncio callers (the gRPC server).

Threading: the engine thread is the only one that touches the Engine's scheduler and runner.
Callers talk to it through an inbox (add, abort: a thread-safe queue) and get their outputs
through one asyncio.Queue per request, filled with loop.call_soon_threadsafe. Validation and
tokenization (Engine.make_request) are read-only and run on the caller's thread, so bad input
fails fast without waiting for a step. When idle, the thread blocks on the inbox (no busy wait).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import AsyncIterator

from jaxserve.engine import Engine, QueueFullError
from jaxserve.outputs import RequestOutput
from jaxserve.request import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped after an unexpected error."""


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._num_pending_adds = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.paused = threading.Event()  # set: the loop waits (tests use it to block the engine)
        self.error: BaseException | None = None

    # ---- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="jaxserve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        self._stopping = True
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- caller side ----------------------------------------------------------------
    async def generate(self, prompt=None, params: SamplingParams | None = None, *,
                       request_id: str | None = None, priority: int = 0,
                       prompt_token_ids: list[int] | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request; leaving the iterator early aborts the request."""
        if self.error is not None:
            raise EngineDeadError(f"engine stopped: {self.error!r}")
        request = self.engine.make_request(prompt, params, request_id=request_id,
                                           priority=priority, prompt_token_ids=prompt_token_ids)
        if request.sampling.structured_outputs is not None:
            # An invalid schema / regex / grammar raises its ValueError here, before queueing.
            await asyncio.wrap_future(
                self.engine.grammars.submit(request.sampling.structured_outputs))
        rid = request.request_id
        stream: asyncio.Queue = asyncio.Queue()
        with self._lock:
            limit = self.engine.config.max_queued_requests
            queued = self.engine.stats.num_waiting + self._num_pending_adds
            if limit is not None and queued >= limit:
                raise QueueFullError(f"waiting queue is full (max_queued_requests={limit})")
            if rid in self._streams:
                raise ValueError(f"request_id {rid!r} is already in use")
            self._streams[rid] = (asyncio.get_running_loop(), stream)
            self._num_pending_adds += 1
        self._inbox.put(("add", request))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    # ---- engine thread ----------------------------------------------------------------
    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            entry = self._streams.get(request_id)
            if entry is not None and (isinstance(item, BaseException) or item.finished):
                del self._streams[request_id]
        if entry is not None:
            loop, stream = entry
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "add":
                try:
                    # Under the lock, so that a caller's queue check sees this request either
                    # as pending or in the published stats' waiting count, never neither.
                    with self._lock:
                        self._num_pending_adds -= 1
                        self.engine.add(payload)
                except Exception as exc:  # one bad request must not stop the loop
                    self._deliver(payload.request_id, exc)
            elif kind == "abort":
                out = self.engine.abort(payload)
                if out is not None:
                    self._deliver(payload, out)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _loop(self) -> None:
        try:
            while not self._stopping:
                while self.paused.is_set() and not self._stopping:
                    time.sleep(0.05)
                self._drain_inbox(block=not self.engine.has_unfinished())
                if self._stopping or not self.engine.has_unfinished():
                    continue
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
        except BaseException as exc:  # the engine is broken: fail every open stream
            log.exception("engine loop failed")
            self.error = exc
            with self._lock:
                open_ids = list(self._streams)
            for rid in open_ids:
                self._deliver(rid, EngineDeadError(f"engine failed: {exc!r}"))
        finally:  # the loop owns the engine: it closes it (multi-host: stops the followers)
            self.engine.close()
