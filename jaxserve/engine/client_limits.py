"""Per-client fairness for both front ends: who a caller is, how many of its requests are in
flight, and the refusal of one more past `max_queued_requests_per_key`.

A client is its API key when keys are configured (the token of `Authorization: Bearer K`, an
HTTP header or gRPC metadata), else its address (the HTTP peer's host; the gRPC peer's host
without its port, so one client's many connections are one client). A request counts from its
admission until it ends, however it ends (finished, refused as invalid, failed, its client gone
or cancelled, its deadline passed): each front end calls `acquire` once it admits a call and
`release` in a `finally` around the whole call. Both front ends share one ClientLimits
(AsyncEngine.clients), so a client's HTTP and gRPC requests count together.

It never checks a key (authentication is the front ends'), never holds one in the clear (a
client keyed by its API key is known by a hash of it) and never touches the engine.
"""

from __future__ import annotations

import hashlib
import ipaddress
import threading
import urllib.parse
from typing import Callable

from jaxserve.core.errors import QueueFullError

RETRY_AFTER_S = 1  # the retry hint of every load refusal (HTTP Retry-After, gRPC retry-after)
_KEY_PREFIX, _ADDRESS_PREFIX = "key:", "address:"


class ClientLimitError(QueueFullError):
    """This client has max_queued_requests_per_key requests in flight already (429 /
    RESOURCE_EXHAUSTED, with the retry hint)."""


def bearer_token(authorization: str | None) -> str | None:
    """K from "Bearer K" (scheme case-insensitive), else None."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def grpc_peer_host(peer: str) -> str:
    """grpc's context.peer() without the port: "ipv4:10.0.0.7:51234" -> "10.0.0.7",
    "ipv6:[::1]:51234" -> "::1"; any other form (unix sockets) is kept whole."""
    kind, _, rest = peer.partition(":")
    rest = urllib.parse.unquote(rest)  # newer grpc writes "ipv6:%5B::1%5D:51234"
    if kind == "ipv4":
        return rest.rpartition(":")[0] or rest
    if kind == "ipv6" and rest.startswith("[") and "]" in rest:
        return rest[1:rest.index("]")]
    return peer


def client_id(authorization: str | None, peer_host: str | None, keyed: bool) -> str:
    """The client a request counts against. keyed: API keys are configured, so the bearer
    token names the client (a request without one falls back to its address)."""
    token = bearer_token(authorization) if keyed else None
    if token is not None:
        return _KEY_PREFIX + hashlib.sha256(token.encode()).hexdigest()[:24]
    return _ADDRESS_PREFIX + _plain_address(peer_host or "unknown")


def _plain_address(host: str) -> str:
    """An IPv4-mapped IPv6 address (a dual-stack listener's view of an IPv4 peer) as IPv4, so
    a client is one address whichever front end it calls."""
    try:
        mapped = getattr(ipaddress.ip_address(host), "ipv4_mapped", None)
    except ValueError:
        return host
    return str(mapped) if mapped is not None else host


def http_client(scope, headers: dict[bytes, bytes], keyed: bool) -> str:
    """The client of an ASGI HTTP request (scope, its headers as a dict)."""
    authorization = headers.get(b"authorization", b"").decode("latin-1") or None
    return client_id(authorization, (scope.get("client") or (None,))[0], keyed)


def grpc_client(context, keyed: bool) -> str:
    """The client of a grpc.aio call: its `authorization` metadata, its peer's host."""
    authorization = None
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            authorization = value if isinstance(value, str) else value.decode("latin-1")
    return client_id(authorization, grpc_peer_host(context.peer() or ""), keyed)


def describe(client: str) -> str:
    """A client as a refusal names it: its address, or just "this API key"."""
    if client.startswith(_KEY_PREFIX):
        return "this API key"
    return f"client address {client.removeprefix(_ADDRESS_PREFIX)}"


class ClientLimits:
    """Requests in flight per client. max_per_client: called at each admission, so a changed
    engine config applies at once (None: no bound, but requests are still counted)."""

    def __init__(self, max_per_client: Callable[[], int | None] = lambda: None):
        self.max_per_client = max_per_client
        self._lock = threading.Lock()  # the two front ends may run on different threads
        self._num_in_flight: dict[str, int] = {}

    def acquire(self, client: str) -> None:
        """Count one more request of client, or raise ClientLimitError (nothing counted)."""
        limit = self.max_per_client()
        with self._lock:
            num = self._num_in_flight.get(client, 0)
            if limit is not None and num >= limit:
                raise ClientLimitError(
                    f"{describe(client)} has {num} requests in flight, the limit "
                    f"max_queued_requests_per_key={limit}: retry once one of them has "
                    f"finished (retry after {RETRY_AFTER_S} s)")
            self._num_in_flight[client] = num + 1

    def release(self, client: str) -> None:
        """One request of client has ended (exactly once per successful acquire)."""
        with self._lock:
            num = self._num_in_flight.get(client, 0) - 1
            if num < 0:
                raise RuntimeError(f"released a request {describe(client)} never had in "
                                   f"flight")
            if num:
                self._num_in_flight[client] = num
            else:
                del self._num_in_flight[client]

    def num_in_flight(self, client: str | None = None) -> int:
        """One client's requests in flight (None: every client's)."""
        with self._lock:
            if client is None:
                return sum(self._num_in_flight.values())
            return self._num_in_flight.get(client, 0)

    def snapshot(self) -> dict[str, int]:
        """Every client with a request in flight -> how many."""
        with self._lock:
            return dict(self._num_in_flight)
