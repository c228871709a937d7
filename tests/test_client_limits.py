"""Who a client is and how its requests are counted (jaxserve/engine/client_limits.py):
plain functions and one counter, no server. The servers' use of them is test_front_load.py's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from jaxserve.core.errors import QueueFullError
from jaxserve.engine.client_limits import (ClientLimitError, ClientLimits, client_id,
                                           grpc_client, grpc_peer_host, http_client)


@pytest.mark.parametrize("peer, host", [
    ("ipv4:10.0.0.7:51234", "10.0.0.7"),
    ("ipv6:[::1]:51234", "::1"),
    ("ipv6:%5B::1%5D:51234", "::1"),
    ("unix:/run/jaxserve.sock", "unix:/run/jaxserve.sock"),
])
def test_a_grpc_peer_is_its_host_without_the_port(peer, host):
    assert grpc_peer_host(peer) == host


def test_with_keys_configured_the_bearer_token_is_the_client_else_the_address():
    a, b = "Bearer key-a", "Bearer key-b"
    assert client_id(a, "10.0.0.1", keyed=True) == client_id(a, "10.0.0.2", keyed=True), \
        "one key from two addresses must be one client"
    assert client_id(a, "10.0.0.1", keyed=True) != client_id(b, "10.0.0.1", keyed=True)
    assert client_id("bearer key-a", "x", keyed=True) == client_id(a, "y", keyed=True)
    # Without keys configured a bearer token is anyone's to invent: the address decides.
    assert client_id(a, "10.0.0.1", keyed=False) == client_id(b, "10.0.0.1", keyed=False)
    assert client_id(a, "10.0.0.1", keyed=False) != client_id(a, "10.0.0.2", keyed=False)
    # Keyed, but no bearer token sent: the address.
    assert client_id(None, "10.0.0.1", keyed=True) == client_id(None, "10.0.0.1", keyed=False)


def test_a_client_id_never_holds_the_key_in_the_clear():
    client = client_id("Bearer sk-very-secret", "10.0.0.1", keyed=True)
    assert "sk-very-secret" not in client, client


def test_an_ipv4_mapped_address_is_the_ipv4_client():
    assert client_id(None, "::ffff:10.0.0.9", False) == client_id(None, "10.0.0.9", False)


def test_http_and_grpc_name_the_same_caller_the_same_client():
    scope = {"client": ("10.0.0.3", 40000)}
    context = SimpleNamespace(invocation_metadata=lambda: (("authorization", "Bearer k"),),
                              peer=lambda: "ipv4:10.0.0.3:40001")
    assert http_client(scope, {}, keyed=False) == grpc_client(context, keyed=False)
    assert (http_client(scope, {b"authorization": b"Bearer k"}, keyed=True)
            == grpc_client(context, keyed=True))


def test_a_client_at_its_bound_is_refused_naming_the_limit_while_others_are_admitted():
    limits = ClientLimits(lambda: 2)
    a, b = client_id(None, "10.0.0.1", False), client_id(None, "10.0.0.2", False)
    limits.acquire(a)
    limits.acquire(a)
    with pytest.raises(ClientLimitError) as info:
        limits.acquire(a)
    assert isinstance(info.value, QueueFullError), "a load refusal: 429 / RESOURCE_EXHAUSTED"
    assert "max_queued_requests_per_key=2" in str(info.value), info.value
    assert "10.0.0.1" in str(info.value) and "retry" in str(info.value), info.value
    limits.acquire(b)  # another client is still admitted
    assert limits.snapshot() == {a: 2, b: 1}, "a refusal must count nothing"
    limits.release(a)
    limits.acquire(a)  # room again once one has ended
    for client in (a, a, b):
        limits.release(client)
    assert limits.num_in_flight() == 0 and limits.snapshot() == {}


def test_a_refusal_names_an_api_key_client_without_its_key():
    limits = ClientLimits(lambda: 1)
    client = client_id("Bearer sk-secret", "10.0.0.1", keyed=True)
    limits.acquire(client)
    with pytest.raises(ClientLimitError) as info:
        limits.acquire(client)
    assert "this API key" in str(info.value) and "sk-secret" not in str(info.value)
    limits.release(client)


def test_without_a_bound_requests_are_counted_but_never_refused():
    limits = ClientLimits()
    for _ in range(1000):
        limits.acquire("address:x")
    assert limits.num_in_flight("address:x") == 1000


def test_the_bound_is_read_at_each_admission():
    bound = [1]
    limits = ClientLimits(lambda: bound[0])
    limits.acquire("address:x")
    with pytest.raises(ClientLimitError):
        limits.acquire("address:x")
    bound[0] = 2
    limits.acquire("address:x")
    assert limits.num_in_flight("address:x") == 2


def test_releasing_more_than_was_admitted_is_an_error_not_a_negative_count():
    limits = ClientLimits()
    with pytest.raises(RuntimeError, match="never had in flight"):
        limits.release("address:x")

