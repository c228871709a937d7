"""KV-cache events from a serving engine, end to end over ZeroMQ: a pyzmq subscriber rebuilds
the prefix cache from the events alone while requests with shared prefixes run through the
OpenAI HTTP API, and its map of page hashes (device and host tier) equals the page manager's
at the end, through evictions from a small pool, evictions to and hits in the host tier, and a
POST /reset_prefix_cache. It starts late on purpose: the batches it missed come back by
sequence number from the replay socket, as a subscriber fills any gap.

One in-process HttpServer over an AsyncEngine on the tiny model: 15 usable KV pages of 16
tokens and a 4-page host tier. Without a model: test_kv_events.py.
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import httpx
import pytest

zmq = pytest.importorskip("zmq")

from jaxserve.core.kv_events import MEDIUM_DEVICE, MEDIUM_HOST, BlockRemoved  # noqa: E402
from jaxserve.engine.kv_events import END_SEQ, decode_batch  # noqa: E402
from kv_event_view import KVCacheView, expected, parent_keys  # noqa: E402

TOPIC = b"kv@tiny"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from conftest import make_llm

    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.entrypoints.openai.http_server import HttpServer, HttpSettings

    sockets = tmp_path_factory.mktemp("kv")
    config = (f'{{"enable_kv_cache_events": true, "endpoint": "ipc://{sockets}/pub", '
              f'"replay_endpoint": "ipc://{sockets}/replay", "topic": "{TOPIC.decode()}"}}')
    llm = make_llm(num_pages=16, host_prefix_cache_size=4 * 16 * 512, kv_events_config=config)
    async_engine = AsyncEngine(llm.engine)
    async_engine.start()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    http = asyncio.run_coroutine_threadsafe(
        HttpServer.start("127.0.0.1", HttpSettings(port=0)), loop).result(60)
    http.attach(async_engine)

    def on_engine(fn):
        return asyncio.run_coroutine_threadsafe(async_engine.run_on_engine(fn), loop).result(60)

    yield SimpleNamespace(url=http.url, model=http.state.serving.model_name, on_engine=on_engine,
                          pub=f"ipc://{sockets}/pub", replay=f"ipc://{sockets}/replay")
    asyncio.run_coroutine_threadsafe(http.shutdown(timeout=1), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    async_engine.stop(timeout=10)
    llm.close()


class Subscriber:
    """SUB on the events, DEALER on the replay socket; batches applied in sequence order."""

    def __init__(self, pub: str, replay: str):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.sub.connect(pub)
        self.replay = self.ctx.socket(zmq.DEALER)
        self.replay.connect(replay)
        self.view, self.next_seq, self.num_replayed, self.removed = KVCacheView(), 0, 0, set()

    def _apply(self, seq: int, payload: bytes) -> None:
        if seq < self.next_seq:
            return  # already applied (a replayed batch that also came live)
        assert seq == self.next_seq, f"batch {seq} applied before {self.next_seq}"
        _, events, rank = decode_batch(payload)
        assert rank == 0
        self.removed |= {e.medium for e in events if isinstance(e, BlockRemoved)}
        self.view.apply(events)
        self.next_seq = seq + 1

    def _fill_gap(self) -> None:
        self.replay.send_multipart([b"", self.next_seq.to_bytes(8, "big")])
        while True:
            assert self.replay.poll(10_000), "no answer from the replay socket"
            _, seq, payload = self.replay.recv_multipart()
            if seq == END_SEQ:
                return
            self.num_replayed += 1
            self._apply(int.from_bytes(seq, "big"), payload)

    def receive_through(self, last_seq: int) -> None:
        """Apply every batch up to last_seq, live or replayed."""
        for _ in range(100):
            if self.next_seq > last_seq:
                return
            if not self.sub.poll(200):  # nothing live (it joined after them): ask for them
                self._fill_gap()
                continue
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic == TOPIC
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.next_seq:
                self._fill_gap()
            self._apply(seq, payload)
        raise AssertionError(f"batches {self.next_seq}..{last_seq} never came")

    def close(self) -> None:
        self.sub.close(0)
        self.replay.close(0)
        self.ctx.term()


def complete(server, prompts: list[list[int]]) -> None:
    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            for first in range(0, len(prompts), 4):  # four at a time share the steps
                answers = await asyncio.gather(*(client.post(
                    server.url + "/v1/completions", json={
                        "model": server.model, "prompt": p, "max_tokens": 3,
                        "temperature": 0.0, "ignore_eos": True}) for p in prompts[first:first + 4]))
                for r in answers:
                    assert r.status_code == 200, r.text
    asyncio.run(run())


def engine_state(engine):
    """(the page manager's prefix cache, its parents, the last batch's sequence number), read
    on the engine thread between steps."""
    return expected(engine.pages), parent_keys(engine.pages), engine.kv_events._next_seq - 1


def check_view(server, subscriber) -> dict:
    want, parents, last_seq = server.on_engine(engine_state)
    subscriber.receive_through(last_seq)
    view = subscriber.view
    for medium in (MEDIUM_DEVICE, MEDIUM_HOST):
        got = {key: tokens for key, (_, tokens, _) in view.blocks[medium].items()}
        assert got == want[medium], (
            f"{medium}: rebuilt from events {sorted(got)}, the cache holds {sorted(want[medium])}")
    for key, parent in parents.items():
        assert view.blocks[MEDIUM_DEVICE][key][0] == parent, f"page {key}'s parent"
    return want


def shared_prefix_prompts(num_families: int, seed: int) -> list[list[int]]:
    """Prompts of num_families 3-page prefixes, each family asked three times with new tails."""
    prefixes = [[(seed * 31 + f * 7 + i) % 120 + 3 for i in range(48)] for f in range(num_families)]
    return [prefix + [(f + t * 5 + seed) % 120 + 3 for _ in range(5)]
            for t in range(3) for f, prefix in enumerate(prefixes)]


def test_a_subscriber_rebuilds_the_prefix_cache_from_events_through_evictions_and_a_reset(
        server):
    complete(server, shared_prefix_prompts(2, seed=1))  # before anyone listens: replayed
    subscriber = Subscriber(server.pub, server.replay)
    try:
        want = check_view(server, subscriber)
        assert subscriber.num_replayed > 0, "the batches sent before it joined were replayed"
        assert want[MEDIUM_DEVICE], "shared prefixes are cached"

        complete(server, shared_prefix_prompts(6, seed=2))  # more prefixes than the pool holds
        want = check_view(server, subscriber)
        assert subscriber.removed >= {MEDIUM_DEVICE, MEDIUM_HOST}, (
            f"the small pool and host tier evicted pages: removals seen on {subscriber.removed}")

        r = httpx.post(server.url + "/reset_prefix_cache", timeout=60)
        assert r.status_code == 200, r.text
        want = check_view(server, subscriber)
        assert want == {MEDIUM_DEVICE: {}, MEDIUM_HOST: {}}

        complete(server, shared_prefix_prompts(3, seed=3))
        want = check_view(server, subscriber)
        assert len(want[MEDIUM_DEVICE]) >= 3, "the cache fills again after the reset"
    finally:
        subscriber.close()
