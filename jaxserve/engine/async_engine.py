"""AsyncEngine: runs Engine.step() on its own thread for asyncio callers (gRPC and HTTP servers).

Threading: the engine thread is the only one that touches the Engine's scheduler and runner.
Callers talk to it through an inbox (add, abort, and control calls that run between two
steps: a thread-safe queue) and get their outputs
through one asyncio.Queue per request, filled with loop.call_soon_threadsafe. Validation runs on
the caller's thread, so bad input fails fast without waiting for a step; a prompt is checked
against PromptLimits before any tokenizer work, and a long one is tokenized on the TextPool,
never on the caller's event loop (a prompt of token ids never waits for it). The front ends
count each client's requests in `clients` (engine/client_limits.py). When idle, the thread
blocks on the inbox (no busy wait).

Before each step the thread drops requests whose deadline has passed (engine.abort: one still
waiting never uses the device) and, after it, records how long newly admitted requests waited
(the queue-time metric). If a step raises, the engine is broken: every open stream fails with
EngineFailedError (INTERNAL / 500), `error` is set (front ends then answer UNAVAILABLE / 503 and
health NOT_SERVING) and the thread ends; the server process exits non-zero. An error confined to
one request (its output processing) is the engine's to contain: that request alone finishes with
an error. No device work, no scheduling decisions here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import logging
import queue
import threading
import time
from typing import AsyncIterator

from jaxserve.core import intake
from jaxserve.engine.engine import Engine, frozen_heap
from jaxserve.engine.outputs import RequestOutput
from jaxserve.engine.client_limits import ClientLimits
from jaxserve.engine.prompt_intake import INLINE_MAX_CHARS, PromptLimits, TextPool, encode
from jaxserve.core.request import RequestStatus, SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine has stopped (failed, or shutting down): a new request is refused
    (UNAVAILABLE / 503)."""


class EngineFailedError(RuntimeError):
    """The engine failed while this request was in it (INTERNAL / 500)."""


class DeadlineExceededError(TimeoutError):
    """The request's deadline passed before it finished."""


class AsyncEngine:
    def __init__(self, engine: Engine, text_pool: TextPool | None = None):
        self.engine = engine
        self.limits = PromptLimits.for_engine(engine.max_model_len, engine.tokenizer)
        self.text_pool = text_pool or TextPool()
        # Requests in flight per client, shared by both front ends (which count and refuse
        # there); the bound is read per admission, so a changed config applies at once.
        self.clients = ClientLimits(
            lambda: self.engine.config.scheduler.max_queued_requests_per_key)
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._num_pending_adds = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.paused = threading.Event()  # set: the loop waits (tests use it to block the engine)
        self.holding = threading.Event()  # set while the loop is waiting on `paused`
        self.error: BaseException | None = None
        # Engine thread only: (deadline, engine id, caller id) heap; engine id -> time queued.
        self._deadlines: list[tuple[float, str, str]] = []
        self._queued_at: dict[str, float] = {}

    # ---- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="jaxserve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        with self._lock:
            self._stopping = True
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)
        self.text_pool.close()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    data_parallel_size = 1  # one engine (EngineClient's field)

    def rank_health(self) -> dict[int, str] | None:
        """Per data-parallel rank health (entrypoints/data_parallel/); one engine has none."""
        return None

    def abort_all(self, error: BaseException) -> int:
        """End every open stream with `error` and abort its request (shutdown after the drain
        timeout); returns how many there were."""
        with self._lock:
            open_ids = list(self._streams)
        for rid in open_ids:
            self._deliver(rid, error)
            self.abort(rid)
        return len(open_ids)

    # ---- caller side ----------------------------------------------------------------
    async def generate(self, prompt=None, params: SamplingParams | None = None, *,
                       request_id: str | None = None, priority: int = 0,
                       prompt_token_ids: list[int] | None = None,
                       deadline: float | None = None,
                       lora_request=None) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request; leaving the iterator early aborts the request.
        lora_request: the LoRARequest to run under (None: the base model).
        deadline: a time.monotonic() instant; past it the request is dropped (still waiting:
        before it uses the device) and the stream raises DeadlineExceededError."""
        self._check_alive()
        prompt, prompt_token_ids = await self._tokenized(prompt, prompt_token_ids)
        request = self.engine.make_request(prompt, params, request_id=request_id,
                                           priority=priority, prompt_token_ids=prompt_token_ids,
                                           lora_request=lora_request)
        rid = request.external_id
        stream: asyncio.Queue = asyncio.Queue()
        try:
            if request.sampling.structured_outputs is not None:
                # An invalid schema / regex / grammar raises its ValueError here, before
                # queueing.
                await asyncio.wrap_future(
                    self.engine.grammars.submit(request.sampling.structured_outputs))
            with self._lock:
                self._check_alive()
                intake.check_admission(
                    rid, self._streams, self.engine.stats.num_waiting + self._num_pending_adds,
                    1, self.engine.config.scheduler.max_queued_requests)
                self._streams[rid] = (asyncio.get_running_loop(), stream)
                self._num_pending_adds += 1
        except BaseException:
            self.engine.release_lora(request)  # never queued
            raise
        self._inbox.put(("add", (request, deadline)))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine side has ended it already
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"engine stopped: {self.error!r}")
        if self._stopping:
            raise EngineDeadError("the engine is stopping: the server is shutting down")

    async def _tokenized(self, prompt, prompt_token_ids):
        """(prompt, prompt_token_ids) for make_request, the limits checked first; a long text
        prompt comes back as token ids, tokenized on the text pool."""
        if isinstance(prompt, (list, tuple)):
            prompt, prompt_token_ids = None, prompt
        if prompt_token_ids is not None:
            self.limits.check_num_tokens(len(prompt_token_ids))
        if isinstance(prompt, str):
            self.limits.check_text(prompt)
            if len(prompt) > INLINE_MAX_CHARS and prompt_token_ids is None:
                ids = await self.text_pool.run(encode, self.engine.tokenizer, prompt)
                return None, ids
        return prompt, prompt_token_ids

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    async def control(self, fn):
        """Run fn() on the engine thread between two steps (the rollout verbs: pause, sleep,
        weight updates; engine/rollout.py) and return its result. fn returns (result, outputs
        it made): those go to their streams first."""
        self._check_alive()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", (fn, future)))
        return await asyncio.wrap_future(future)

    async def reset_prefix_cache(self) -> None:
        """Empty the prefix cache between steps (KV-event subscribers are told)."""
        await self.run_on_engine(lambda engine: engine.reset_prefix_cache())

    async def run_on_engine(self, fn):
        """fn(engine)'s result, run on the engine thread between steps (e.g. resetting the
        prefix cache); EngineDeadError if the engine stops first."""
        return await self.control(lambda: (fn(self.engine), ()))

    # ---- engine thread ----------------------------------------------------------------
    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            entry = self._streams.get(request_id)
            if entry is not None and (isinstance(item, BaseException) or item.finished):
                del self._streams[request_id]
        if entry is not None:
            loop, stream = entry
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _add(self, request, deadline: float | None) -> None:
        try:
            # Under the lock, so that a caller's queue check sees this request either as
            # pending or in the published stats' waiting count, never neither.
            with self._lock:
                self._num_pending_adds -= 1
                if request.external_id not in self._streams:
                    self.engine.release_lora(request)
                    return  # already ended (shutdown's abort_all)
                self.engine.add(request)
        except Exception as exc:  # one bad request must not stop the loop
            self._deliver(request.external_id, exc)
            return
        # keyed by the engine's id: a later request under the caller's id is another request
        self._queued_at[request.request_id] = time.monotonic()
        if deadline is not None:
            heapq.heappush(self._deadlines, (deadline, request.request_id, request.external_id))

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "add":
                self._add(*payload)
            elif kind == "call":
                self._call(*payload)
            elif kind == "abort":  # (its _queued_at entry goes once its status is gone)
                out = self.engine.abort(payload)
                if out is not None:
                    self._deliver(payload, out)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _call(self, fn, future: concurrent.futures.Future) -> None:
        try:
            result, outputs = fn()
        except Exception as exc:  # refused (a bad argument, requests running): the caller's
            future.set_exception(exc)
            return
        for out in outputs:
            self._deliver(out.request_id, out)
        future.set_result(result)

    def _status(self, request_id: str) -> RequestStatus | None:
        request = self.engine.scheduler.requests.get(request_id)
        return None if request is None else request.status

    def _drop_expired(self) -> None:
        """Abort every request whose deadline has passed; one still waiting never runs."""
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, rid, external_id = heapq.heappop(self._deadlines)
            status = self._status(rid)
            if status is None or external_id not in self._streams:
                continue  # finished or aborted already
            queued_at = self._queued_at.pop(rid, None)
            if status == RequestStatus.WAITING and queued_at is not None:
                self.engine.metrics.deadline_expired.inc()
                error = DeadlineExceededError(
                    f"the request's deadline passed while it waited in the queue "
                    f"({now - queued_at:.3f} s): dropped before it ran")
            else:
                error = DeadlineExceededError("the request's deadline passed while it ran")
            self.engine.abort(external_id)
            self._deliver(external_id, error)

    def _observe_admitted(self) -> None:
        """Queue time of each request that left the waiting queue for the first time."""
        if not self._queued_at:
            return
        now = time.monotonic()
        for rid in [r for r in self._queued_at if self._status(r) != RequestStatus.WAITING]:
            started = self._queued_at.pop(rid)
            if self._status(rid) is not None:
                self.engine.metrics.observe_queue_time(now - started)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:  # after this, generate() refuses new requests
            self.error = exc
            open_ids = list(self._streams)
        for rid in open_ids:
            self._deliver(rid, EngineFailedError(
                f"the engine failed while this request was in it: {exc!r}; the server is "
                f"going down (its health is NOT_SERVING)"))

    def _loop(self) -> None:
        try:
            with frozen_heap():  # the engine's long-lived objects stay out of GC scans
                self._serve()
        except BaseException as exc:  # the engine is broken: fail every open stream
            log.exception("engine loop failed: failing %d open request(s)", len(self._streams))
            self._fail_all(exc)
        finally:  # the loop owns the engine: it closes it (multi-host: stops the followers)
            try:
                self.engine.close()
            except Exception:
                log.exception("closing the engine failed")
            self._refuse_calls()

    def _refuse_calls(self) -> None:
        """Calls still in the inbox when the loop ends get EngineDeadError."""
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "call":
                payload[1].set_exception(EngineDeadError("the engine stopped"))

    def _serve(self) -> None:
        while not self._stopping:
            while self.paused.is_set() and not self._stopping:
                self.holding.set()
                time.sleep(0.01)
            self.holding.clear()
            self._drain_inbox(block=not self.engine.has_unfinished())
            if self._deadlines:
                self._drop_expired()
            if self._stopping or not self.engine.has_unfinished():
                continue
            outputs = self.engine.step()
            self._observe_admitted()
            for out in outputs:
                self._deliver(out.request_id, out)
