"""KVEventsConfig: vLLM's --kv-events-config, the KV-cache event publisher's settings, read from
its JSON text (CacheConfig.kv_events_config holds the text; the CLI flag takes it as vLLM's).

Plain data and validation only: the publisher is engine/kv_events.py's; no jax, no zmq here.
A bad value is a ValueError naming the key, the value and the limit.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

PUBLISHERS = ("null", "zmq")
ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig fields, with its defaults."""
    enable_kv_cache_events: bool = False
    publisher: str | None = None     # None: "zmq" when enable_kv_cache_events, else "null"
    endpoint: str = "tcp://*:5557"   # PUB socket: bound when it has a wildcard, else connected
    replay_endpoint: str | None = None  # ROUTER socket serving past batches by sequence number
    buffer_steps: int = 10_000       # past batches kept for replay
    hwm: int = 100_000               # the PUB socket's high-water mark (messages)
    max_queue_size: int = 100_000    # batches waiting for the sender thread; more are dropped
    topic: str = ""                  # first frame of every message

    @property
    def enabled(self) -> bool:
        """Whether events are collected and sent (a "null" publisher sends nothing)."""
        return self.enable_kv_cache_events and self.resolved_publisher == "zmq"

    @property
    def resolved_publisher(self) -> str:
        if self.publisher is not None:
            return self.publisher
        return "zmq" if self.enable_kv_cache_events else "null"


def _bad(key: str, value, limit: str) -> ValueError:
    return ValueError(f"kv_events_config: {key}={value!r} is invalid: must be {limit}")


def parse_kv_events_config(value) -> KVEventsConfig:
    """The validated KVEventsConfig of value: None (events off), a JSON object's text, a dict
    or a KVEventsConfig."""
    if value is None:
        return KVEventsConfig()
    if isinstance(value, KVEventsConfig):
        fields = dataclasses.asdict(value)
    elif isinstance(value, dict):
        fields = dict(value)
    elif isinstance(value, str):
        try:
            fields = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"kv_events_config is not valid JSON ({exc.msg} at character "
                             f"{exc.pos}): {value[:200]!r}") from None
        if not isinstance(fields, dict):
            raise ValueError(f"kv_events_config must be a JSON object, got {value[:200]!r}")
    else:
        raise ValueError(f"kv_events_config must be a JSON object's text, got {value!r}")
    known = {f.name for f in dataclasses.fields(KVEventsConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"kv_events_config: unknown key(s) {', '.join(unknown)}; known: "
                         f"{', '.join(sorted(known))}")
    for key in ("buffer_steps", "hwm", "max_queue_size"):
        if key in fields and (type(fields[key]) is not int or fields[key] < 0
                              or (key != "hwm" and fields[key] < 1)):
            raise _bad(key, fields[key], "an integer >= " + ("0" if key == "hwm" else "1"))
    if type(fields.get("enable_kv_cache_events", False)) is not bool:
        raise _bad("enable_kv_cache_events", fields["enable_kv_cache_events"], "true or false")
    if fields.get("publisher") not in (None,) + PUBLISHERS:
        raise _bad("publisher", fields["publisher"], f"one of {', '.join(PUBLISHERS)}")
    if not isinstance(fields.get("topic", ""), str):
        raise _bad("topic", fields["topic"], "a string")
    for key in ("endpoint", "replay_endpoint"):
        endpoint = fields.get(key)
        if key not in fields or (key == "replay_endpoint" and endpoint is None):
            continue
        if not isinstance(endpoint, str) or not endpoint.startswith(ENDPOINT_SCHEMES):
            raise _bad(key, endpoint, "a ZeroMQ endpoint starting with "
                       + ", ".join(ENDPOINT_SCHEMES) + " (tcp://*:5557 binds all interfaces)")
    return KVEventsConfig(**fields)
