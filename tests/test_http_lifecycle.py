"""The OpenAI HTTP front end under pressure: a full waiting queue, a client that goes away while
a non-streaming request runs, and SIGTERM with streams in flight on both front ends.

One `run_server` process (tests/http_server_main.py) with two running slots, two waiting slots
(--max-queued-requests 2) and every engine step slowed by 10 ms, so requests stay in flight long
enough to be overtaken; the SIGTERM test runs last and ends the process. KV pages are read
through /metrics, never the scheduler.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time

import grpc
import httpx
import pytest

from jaxserve import SamplingParams
from jaxserve.entrypoints.grpc.client import JaxServeClient, JaxServeError
from jaxserve.entrypoints.grpc.pb import jaxserve_pb2 as pb

ALL_PAGES = 47  # SMALL_ENGINE's 48, less the reserved page 0
ABORTED = 'jaxserve_requests_finished_total{finish_reason="abort"}'
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    from http_server_main import server_process

    with server_process("--max-queued-requests", "2", "--max-num-seqs", "2", "--seq-buckets",
                        "2", "--step-delay-ms", "10") as process:
        yield process


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def wait_for(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def pages_all_free(server) -> bool:
    return metric(server, "jaxserve_kv_cache_free_pages") == ALL_PAGES


def test_health_is_503_while_the_engine_loads_then_200(server):
    assert server.health_seen == [503, 200], server.health_seen
    r = httpx.get(server.url + "/health")
    assert r.json() == {"status": "serving"}, r.text


def test_the_request_in_a_failing_engine_is_500_then_health_and_requests_are_503():
    """In-process: the engine's step raises, as a broken device would make it."""
    from conftest import make_llm

    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.entrypoints.openai.http_server import HttpServer, HttpSettings

    llm = make_llm()

    def broken_step():
        raise RuntimeError("device lost")

    async def scenario():
        async_engine = AsyncEngine(llm.engine)
        async_engine.start()
        http = await HttpServer.start("127.0.0.1", HttpSettings(port=0))
        http.attach(async_engine)
        body = {"model": http.state.serving.model_name, "prompt": [1, 2, 3], "max_tokens": 4}
        try:
            async with httpx.AsyncClient(base_url=http.url, timeout=60) as client:
                assert (await client.get("/health")).status_code == 200
                llm.engine.step = broken_step
                failed = await client.post("/v1/completions", json=body)
                health = await client.get("/health")
                after = await client.post("/v1/completions", json=body)
        finally:
            await http.shutdown(timeout=0)
            async_engine.stop(timeout=10)
        return failed, health, after

    failed, health, after = asyncio.run(scenario())
    # The request the engine held when it failed is a 500; later ones are 503.
    assert failed.status_code == 500 and "device lost" in failed.text, failed.text
    assert (health.status_code, health.json()["status"]) == (503, "unavailable"), health.text
    assert "device lost" in health.json()["reason"], health.text
    assert after.status_code == 503 and "engine stopped" in after.json()["error"]["message"]
    llm.close()


def test_a_burst_beyond_the_queue_gets_429_with_retry_after_and_the_accepted_complete(server):
    body = {"model": "tiny-llama", "prompt": "burst", "max_tokens": 20, **GREEDY}

    async def burst():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=body)
                                          for _ in range(10)))

    responses = asyncio.run(burst())
    accepted = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    # 2 running + 2 waiting at most; the first two always fit, whatever the timing.
    assert 2 <= len(accepted) <= 4, [r.status_code for r in responses]
    for r in refused:
        assert r.status_code == 429, r.text
        assert r.headers.get("Retry-After") == "1", r.headers
        assert r.json()["error"]["type"] == "rate_limit_error", r.text
    for r in accepted:
        choice = r.json()["choices"][0]
        assert (r.json()["usage"]["completion_tokens"], choice["finish_reason"]) == \
            (20, "length"), r.text
    assert wait_for(lambda: pages_all_free(server)), "every KV page free after the burst"


def test_a_non_streaming_request_whose_client_disconnects_is_aborted(server):
    before = metric(server, ABORTED)
    body = json.dumps({"model": "tiny-llama", "prompt": "never read", "max_tokens": 400,
                       **GREEDY}).encode()
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        assert wait_for(lambda: metric(server, "jaxserve_num_requests_running") == 1), \
            "the request never started running"
    # 400 tokens at >= 10 ms a step are seconds away: the close came first.
    assert wait_for(lambda: metric(server, ABORTED) - before == 1), \
        "the request of a client that went away must be aborted"
    assert wait_for(lambda: pages_all_free(server))


def test_a_stream_whose_client_leaves_while_it_waits_in_the_queue_is_aborted(server):
    before = metric(server, ABORTED)
    busy = {"model": "tiny-llama", "prompt": "hold a slot", "max_tokens": 60, **GREEDY}

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            runners = [asyncio.ensure_future(http.post("/v1/completions", json=busy))
                       for _ in range(2)]  # both running slots
            assert await asyncio.to_thread(
                wait_for, lambda: metric(server, "jaxserve_num_requests_running") == 2)
            await asyncio.to_thread(send_and_leave_while_waiting, server)
            return await asyncio.gather(*runners)

    for r in asyncio.run(scenario()):
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 60, r.text
    assert wait_for(lambda: metric(server, ABORTED) - before == 1), \
        "the queued stream of a client that went away must be aborted"
    assert wait_for(lambda: pages_all_free(server))


def send_and_leave_while_waiting(server) -> None:
    body = json.dumps({"model": "tiny-llama", "prompt": "queued", "max_tokens": 5,
                       "stream": True, **GREEDY}).encode()
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        assert wait_for(lambda: metric(server, "jaxserve_num_requests_waiting") == 1), \
            "the third request never queued"


def test_sigterm_drains_http_and_grpc_streams_in_flight_then_exits_0(server):
    """Runs last: it ends the server process."""
    body = {"model": "tiny-llama", "prompt": "drain me", "max_tokens": 100, "stream": True,
            "stream_options": {"include_usage": True}, **GREEDY}
    grpc_client = JaxServeClient(server.grpc_address, timeout=60.0)
    call = grpc_client.generate("drain me too", SamplingParams(max_tokens=100, **GREEDY))
    grpc_first = next(call)
    with httpx.Client(base_url=server.url, timeout=60) as http, \
            http.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        server.proc.terminate()
        assert wait_for(lambda: http.get("/health").status_code == 503), "health while draining"
        late = http.post("/v1/completions", json={**body, "stream": False})
        assert late.status_code == 503, late.text
        with pytest.raises(JaxServeError) as info:
            grpc_client.generate_text("too late", SamplingParams(max_tokens=2))
        assert info.value.code == grpc.StatusCode.UNAVAILABLE, info.value
        events = [first] + [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 100, events[-2]
    grpc_rest = list(call)
    num_grpc_tokens = len(grpc_first.token_ids) + sum(len(r.token_ids) for r in grpc_rest)
    assert (num_grpc_tokens, grpc_rest[-1].finish_reason) == (100, pb.FINISH_REASON_LENGTH)
    grpc_client.close()
    assert server.proc.wait(timeout=60) == 0
    assert "draining 2 in-flight request(s)" in server.log, server.log[-3000:]
    assert "Traceback" not in server.log, server.log[-3000:]
