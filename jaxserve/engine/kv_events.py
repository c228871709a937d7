"""KV-cache event publishing on the wire vLLM uses: a ZeroMQ PUB socket sending msgpack batches,
and an optional ROUTER socket replaying past batches by sequence number.

The engine thread calls `publish(events)` once per step with the events its page manager logged
(core/kv_events.py); that only stamps the batch with the time and the next sequence number and
puts it on a bounded queue (never blocking: a full queue drops the batch, counted in
num_dropped, and its sequence number is skipped so subscribers see the gap). A sender thread
owns both sockets: it encodes each batch and sends it as the multipart message
[topic, seq (8 bytes, big-endian), payload], keeps the last buffer_steps payloads, and answers
replay requests. Payload: msgpack of vLLM's KVEventBatch as msgspec encodes it (array-like
structs, each event tagged by its class name first):

    [ts, [event, ...], data_parallel_rank]
    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

Replay: a client (DEALER, or vLLM's REQ) sends [b"", start_seq as 8 bytes big-endian]; it gets
one [b"", seq, payload] per buffered batch from start_seq on, then [b"", -1 as 8 signed bytes,
b""]. With data parallelism each rank publishes on its own ports (the endpoint's port plus the
rank, as vLLM offsets them). This module never touches the page manager or the device.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

from jaxserve.config.kv_events import KVEventsConfig
from jaxserve.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

log = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def encode_batch(ts: float, events: list[KVEvent], data_parallel_rank: int = 0) -> bytes:
    import msgpack

    wire = []
    for e in events:
        if type(e) is BlockStored:
            wire.append(["BlockStored", e.block_hashes, e.parent_block_hash, e.token_ids,
                         e.block_size, e.lora_id, e.medium])
        elif type(e) is BlockRemoved:
            wire.append(["BlockRemoved", e.block_hashes, e.medium])
        else:
            wire.append(["AllBlocksCleared"])
    return msgpack.packb([ts, wire, data_parallel_rank])


def decode_batch(payload: bytes) -> tuple[float, list[KVEvent], int | None]:
    """(ts, events, data_parallel_rank) of a payload (a subscriber's side, for tests and
    tools); trailing fields a newer vLLM adds to an event are ignored."""
    import msgpack

    ts, wire, *rest = msgpack.unpackb(payload)
    events: list[KVEvent] = []
    for item in wire:
        tag, fields = item[0], item[1:]
        if tag == "BlockStored":
            events.append(BlockStored(*fields[:6]))
        elif tag == "BlockRemoved":
            events.append(BlockRemoved(*fields[:2]))
        elif tag == "AllBlocksCleared":
            events.append(AllBlocksCleared())
        else:
            raise ValueError(f"unknown KV event tag {tag!r}")
    return ts, events, rest[0] if rest else None


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """A data-parallel rank's endpoint: tcp ports shifted by the rank, other schemes suffixed."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


class NullPublisher:
    num_dropped = 0

    def publish(self, events: list[KVEvent]) -> None:
        pass

    def close(self) -> None:
        pass


class ZmqPublisher:
    """PUB (+ ROUTER for replay) sockets driven by one sender thread; see the module doc."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0):
        import zmq

        self.rank = data_parallel_rank
        self.endpoint = offset_endpoint(config.endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint(config.replay_endpoint, data_parallel_rank)
        self._topic = config.topic.encode()
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self.num_dropped = 0  # batches the full queue refused (engine thread only)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            wildcard = "*" in self.endpoint or "::" in self.endpoint
            if wildcard or not self.endpoint.startswith("tcp://"):
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise OSError(f"kv_events_config: cannot open {self.endpoint} / "
                          f"{self.replay_endpoint}: {exc}") from None
        self._thread = threading.Thread(target=self._run, name="jaxserve-kv-events",
                                        daemon=True)
        self._thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one batch (engine thread); never blocks."""
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        try:
            self._queue.put_nowait((seq, time.time(), events))
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                log.warning("KV events: the send queue is full; %d batch(es) dropped so far "
                            "(subscribers see gaps in the sequence numbers)", self.num_dropped)

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (for up to timeout seconds), then close the sockets."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._ctx.term()

    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None:
                    while self._replay.poll(0):
                        self._serve_replay()
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if item is None:
                    return
                seq, ts, events = item
                try:
                    payload = encode_batch(ts, events, self.rank)
                    self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                except Exception:  # one bad batch must not end the stream
                    log.exception("KV events: sending batch %d failed", seq)
                    continue
                self._buffer.append((seq, payload))
        finally:
            self._close_sockets()

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: malformed replay request (%d frames): ignored", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in self._buffer:
            if seq >= start:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=200)  # (ms: what is sent already still leaves)
        if self._replay is not None:
            self._replay.close(linger=0)


def make_publisher(config: KVEventsConfig, data_parallel_rank: int = 0):
    """The publisher config asks for: a ZmqPublisher, or a NullPublisher when events are off."""
    if not config.enabled:
        return NullPublisher()
    return ZmqPublisher(config, data_parallel_rank)
