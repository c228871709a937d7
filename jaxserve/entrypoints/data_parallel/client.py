"""DataParallelClient: the front end's side of N rank processes, with AsyncEngine's surface.

The gRPC and HTTP front ends call `generate`, `abort`, `abort_all`, read `error`, `limits`,
`text_pool`, `clients` and `engine` (tokenizer, info, metrics; lora_registry None), as they do
an AsyncEngine; serve.py builds this instead when data_parallel_size > 1. Everything runs on the
server's event loop: a receiver task reads the ranks' batches from one ZMQ PULL socket and
hands each request's rebuilt RequestOutputs to its asyncio.Queue; a watcher task notices a rank
process that exited.

Per request, here and not in a rank: the prompt is tokenized (router.py routes on its token
ids) and checked at intake (core/intake.py: the same errors, naming the same fields, as one
engine), the caller's id refused while in flight, then router.Router picks a rank. The rank
sees a wire id of its own (`<id>#<serial>`), so a late message of an ended request never
reaches a later request reusing its id.

A dead rank: its in-flight requests end with EngineFailedError (INTERNAL / 500) naming the rank
and its exit code; the router skips it; rank_health() reports it "not_serving" (gRPC health
service `data_parallel_rank_<r>` NOT_SERVING, /health's data_parallel_ranks); `error` is set,
and the server goes down as for one failed engine, only once every rank is dead. No sampling,
no device work, no engine objects here.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

import zmq
import zmq.asyncio

from jaxserve.config import compatibility
from jaxserve.core import intake
from jaxserve.core.request import SamplingParams
from jaxserve.engine.async_engine import EngineDeadError, EngineFailedError
from jaxserve.engine.client_limits import ClientLimits
from jaxserve.entrypoints.data_parallel import wire
from jaxserve.entrypoints.data_parallel.launch import start_ranks
from jaxserve.entrypoints.data_parallel.metrics import DataParallelMetrics
from jaxserve.entrypoints.data_parallel.router import Router
from jaxserve.engine.prompt_intake import INLINE_MAX_CHARS, PromptLimits, TextPool, encode

log = logging.getLogger(__name__)
WATCH_PERIOD_S = 0.05
RESET_TIMEOUT_S = 60.0  # a rank that neither resets nor dies in this long fails the call


def rank_service_name(rank: int) -> str:
    """The gRPC health service that reports one rank."""
    return f"data_parallel_rank_{rank}"


@dataclass
class EngineFacade:
    """What front ends read as `async_engine.engine`: the ranks' shared facts."""
    config: object
    tokenizer: object
    info: object
    metrics: DataParallelMetrics
    lora_registry: None = None


@dataclass
class _Pending:
    request_id: str
    wire_id: str
    rank: int
    queue: asyncio.Queue
    rebuilder: wire.OutputRebuilder
    num_prompt_tokens: int
    ended: bool = False


@dataclass
class RankState:
    process: object                 # multiprocessing.Process
    pid: int | None = None
    cpus: tuple[int, ...] = ()
    info: object = None             # EngineInfo, from its ready message
    tokenizer: bytes | None = None
    stats: object = None            # its latest EngineStats
    exposition: bytes = b""         # its latest Prometheus text
    exit_code: int | None = None    # set once it exited
    failure: str | None = None      # why its engine did not start (its failed message)


class DataParallelClient:
    def __init__(self, config, num_ranks: int):
        self.config, self.num_ranks = config, num_ranks
        self.error: BaseException | None = None
        self.ranks: list[RankState] = []
        self.engine: EngineFacade | None = None
        self.router: Router | None = None
        self.text_pool = TextPool()
        self.clients = ClientLimits(lambda: config.scheduler.max_queued_requests_per_key)
        self._by_wire: dict[str, _Pending] = {}
        self._by_id: dict[str, _Pending] = {}
        self._serials = itertools.count()
        self._dir = tempfile.mkdtemp(prefix="jaxserve-dp-")
        self._ctx = zmq.asyncio.Context()
        self._sync_ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(f"ipc://{self._dir}/out")
        self._push = []
        for rank in range(num_ranks):
            push = self._sync_ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 0)
            push.setsockopt(zmq.LINGER, 0)
            push.bind(f"ipc://{self._dir}/in-{rank}")
            self._push.append(push)
        self._tasks: list[asyncio.Task] = []
        self._stopped = False
        self._resets: dict[int, tuple[asyncio.Future, set[int]]] = {}  # serial -> ranks left

    # ---- lifecycle ------------------------------------------------------------------
    @classmethod
    async def launch(cls, config, num_ranks: int,
                     served_model_name: str | None = None) -> "DataParallelClient":
        """Start the ranks and return once every one is ready (they load and compile in
        parallel); a rank that exits first is a RuntimeError, and cancelling this (a stop
        signal while loading) ends them all."""
        if num_ranks < 2:
            raise ValueError(f"data_parallel_size={num_ranks}: must be >= 2 here (1 is one "
                             f"engine in the server's own process)")
        compatibility.check_data_parallel(num_ranks, enable_lora=config.lora.enable_lora)
        self = cls(config, num_ranks)
        try:
            processes = start_ranks(config, num_ranks,
                                    [f"ipc://{self._dir}/in-{r}" for r in range(num_ranks)],
                                    f"ipc://{self._dir}/out", served_model_name)
            self.ranks = [RankState(p) for p in processes]
            self._tasks.append(asyncio.ensure_future(self._receive()))
            while not all(r.info is not None for r in self.ranks):
                for rank, state in enumerate(self.ranks):
                    if state.failure is not None:
                        raise RuntimeError(f"data-parallel rank {rank} failed to start: "
                                           f"{state.failure}")
                    if state.info is None and not state.process.is_alive():
                        raise RuntimeError(f"data-parallel rank {rank} exited with code "
                                           f"{state.process.exitcode} before it was ready "
                                           f"(its log says why)")
                await asyncio.sleep(WATCH_PERIOD_S)
        except BaseException:
            self.stop(timeout=5.0)
            raise
        info = self.ranks[0].info
        tokenizer = pickle.loads(self.ranks[0].tokenizer)
        self.limits = PromptLimits.for_engine(info.max_model_len, tokenizer)
        self.router = Router(num_ranks, info.page_size, info.num_pages - 1)
        self.engine = EngineFacade(config, tokenizer, info, DataParallelMetrics(self))
        self._tasks.append(asyncio.ensure_future(self._watch()))
        return self

    def start(self) -> None:
        """AsyncEngine's start: the ranks run already."""

    def stop(self, timeout: float | None = None) -> None:
        """Tell every rank to stop, wait up to timeout seconds for each, kill what is left."""
        if self._stopped:
            return
        self._stopped = True
        for task in self._tasks:
            task.cancel()
        for push in self._push:
            try:  # a PUSH with no peer (a rank that exited) would block the loop for good
                push.send(wire.pack([wire.STOP]), zmq.NOBLOCK)
            except zmq.Again:
                pass
        for state in self.ranks:
            state.process.join(timeout)
            if state.process.is_alive():
                state.process.kill()
                state.process.join(5.0)
        for socket in (*self._push, self._pull):
            socket.close(linger=0)
        self.text_pool.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def num_in_flight(self) -> int:
        return len(self._by_wire)

    @property
    def data_parallel_size(self) -> int:
        return self.num_ranks

    async def reset_prefix_cache(self) -> None:
        """Every live rank empties its prefix cache (its KV-event subscribers are told)."""
        serial = next(self._serials)
        live = {r for r, s in enumerate(self.ranks) if s.exit_code is None}
        done = asyncio.get_running_loop().create_future()
        self._resets[serial] = (done, live)
        for rank in live:
            self._push[rank].send(wire.pack([wire.RESET, serial]), zmq.NOBLOCK)
        try:
            await asyncio.wait_for(done, RESET_TIMEOUT_S)
        finally:
            self._resets.pop(serial, None)

    def _reset_done(self, serial: int, rank: int) -> None:
        done, left = self._resets.get(serial, (None, set()))
        left.discard(rank)
        if done is not None and not left and not done.done():
            done.set_result(None)

    def rank_health(self) -> dict[int, str]:
        """Per rank: "serving", or "not_serving" once its process exited."""
        return {r: "serving" if s.exit_code is None else "not_serving"
                for r, s in enumerate(self.ranks)}

    def abort_all(self, error: BaseException) -> int:
        pending = list(self._by_wire.values())
        for p in pending:
            self._send_abort(p)
            self._finish(p, error)
        return len(pending)

    # ---- caller side ----------------------------------------------------------------
    async def generate(self, prompt=None, params: SamplingParams | None = None, *,
                       request_id: str | None = None, priority: int = 0,
                       prompt_token_ids: list[int] | None = None,
                       deadline: float | None = None,
                       lora_request=None) -> AsyncIterator:
        """AsyncEngine.generate over the ranks: the same outputs, errors and abort on early
        exit."""
        self._check_alive()
        intake.check_adapter_served(lora_request, False, "not with data_parallel_size > 1")
        params = params or SamplingParams()
        ids, field = await self._prompt_ids(prompt, prompt_token_ids)
        intake.check_request(self.engine.info, ids, params, prompt_field=field)
        rid = request_id or uuid.uuid4().hex
        # the ranks' own queues refuse load; here only an id already in flight
        intake.check_admission(rid, self._by_id, 0, 1, None)
        self._check_alive()
        rank, hashes = self.router.choose(ids)
        p = _Pending(rid, f"{rid}#{next(self._serials)}", rank, asyncio.Queue(),
                     wire.OutputRebuilder(rid, ids, params), len(ids))
        self._by_wire[p.wire_id] = self._by_id[rid] = p
        self.router.sent(rank, hashes, len(ids))
        self._push[rank].send(wire.add_message(p.wire_id, ids, params, priority, deadline))
        finished = False
        try:
            while True:
                item = await p.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._send_abort(p)
                self._end(p)

    def abort(self, request_id: str) -> None:
        """Abort the caller's request: its rank's abort output ends its stream."""
        p = self._by_id.get(request_id)
        if p is not None:
            self._send_abort(p)

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"engine stopped: {self.error!r}")
        if self._stopped:
            raise EngineDeadError("the engine is stopping: the server is shutting down")

    async def _prompt_ids(self, prompt, prompt_token_ids) -> tuple[list[int], str]:
        """Token ids and the field they came from, as Engine.make_request reads a prompt."""
        if isinstance(prompt, (list, tuple)):
            prompt, prompt_token_ids = None, prompt
        if (prompt is None) == (prompt_token_ids is None):
            raise intake.RequestError("prompt", "exactly one of prompt (text) and "
                                      "prompt_token_ids must be given")
        if prompt_token_ids is not None:
            self.limits.check_num_tokens(len(prompt_token_ids))
            return [int(t) for t in prompt_token_ids], "prompt_token_ids"
        if not isinstance(prompt, str) or not prompt:
            raise intake.RequestError("prompt", "prompt must be a non-empty string")
        self.limits.check_text(prompt)
        tokenizer = self.engine.tokenizer
        if len(prompt) > INLINE_MAX_CHARS:
            return await self.text_pool.run(encode, tokenizer, prompt), "prompt"
        return tokenizer.encode(prompt), "prompt"

    def _send_abort(self, p: _Pending) -> None:
        if self.ranks[p.rank].exit_code is None and not self._stopped:
            self._push[p.rank].send(wire.pack([wire.ABORT, p.wire_id]))

    def _end(self, p: _Pending) -> None:
        if p.ended:
            return
        p.ended = True
        self._by_wire.pop(p.wire_id, None)
        if self._by_id.get(p.request_id) is p:
            del self._by_id[p.request_id]
        self.router.ended(p.rank, p.num_prompt_tokens, p.rebuilder.started)

    def _finish(self, p: _Pending, item) -> None:
        """The request's last item: its stream gets it, the tables forget the request."""
        self._end(p)
        p.queue.put_nowait(item)

    # ---- event loop tasks -------------------------------------------------------------
    async def _receive(self) -> None:
        while True:
            for item in wire.unpack(await self._pull.recv()):
                try:
                    self._on_item(item)
                except Exception:  # one bad item must not stop the front end's reading
                    log.exception("data-parallel: a rank's message failed to apply")

    def _on_item(self, item: list) -> None:
        kind = item[0]
        if kind == wire.OUT:
            p = self._by_wire.get(item[1])
            if p is None:
                return  # ended here already (aborted, or its rank declared dead)
            was_started = p.rebuilder.started
            out = p.rebuilder.rebuild(item)
            if p.rebuilder.started and not was_started:
                self.router.started(p.rank, p.num_prompt_tokens)
            if out.finished:
                self._finish(p, out)
            else:
                p.queue.put_nowait(out)
        elif kind == wire.ERR:
            p = self._by_wire.get(item[1])
            if p is not None:
                self._finish(p, wire.load_error(item[2]))
        elif kind == wire.STATS:
            state = self.ranks[item[1]]
            state.stats, state.exposition = pickle.loads(item[2]), item[3]
        elif kind == wire.RESET_DONE:
            self._reset_done(item[2], item[1])
        elif kind == wire.FAILED:
            self.ranks[item[1]].failure = item[2]
        elif kind == wire.READY:
            _, rank, pid, cpus, info, tokenizer = item
            state = self.ranks[rank]
            state.pid, state.cpus = pid, tuple(cpus)
            state.info, state.tokenizer = pickle.loads(info), tokenizer
            log.info("data-parallel rank %d ready: pid %d, CPUs %s", rank, pid, list(cpus))

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_PERIOD_S)
            for rank, state in enumerate(self.ranks):
                if state.exit_code is None and not state.process.is_alive():
                    self._rank_died(rank, state.process.exitcode)

    def _rank_died(self, rank: int, exit_code: int) -> None:
        state = self.ranks[rank]
        state.exit_code = exit_code
        self.router.died(rank)
        lost = [p for p in self._by_wire.values() if p.rank == rank]
        for serial in list(self._resets):  # a dead rank's cache is gone: nothing to wait for
            self._reset_done(serial, rank)
        log.error("data-parallel rank %d (pid %s) exited with code %s: failing its %d "
                  "in-flight request(s); health of %s NOT_SERVING", rank, state.pid, exit_code,
                  len(lost), rank_service_name(rank))
        for p in lost:
            self._finish(p, EngineFailedError(
                f"data-parallel rank {rank} (pid {state.pid}) exited with code {exit_code} "
                f"while this request was in it; the other ranks keep serving"))
        if all(s.exit_code is not None for s in self.ranks):
            self.error = RuntimeError(f"every data-parallel rank has exited (the last: rank "
                                      f"{rank}, exit code {exit_code})")
