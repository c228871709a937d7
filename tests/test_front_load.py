"""Both front ends under load: a burst far past max_num_seqs is queued, never refused, and each
request gets the tokens it gets alone; a prompt of token ids never waits for the text pool; one
client at max_queued_requests_per_key is refused (429 / RESOURCE_EXHAUSTED with a retry hint)
while another is admitted; and no client count outlives its request, however it ends.

One in-process server for every check: the gRPC and HTTP front ends on one event loop thread
over one AsyncEngine (the tiny Llama over the tiny BPE vocabulary, conftest.SMALL_ENGINE: 16
requests a step, no queue bound, no per-client bound unless a test sets one on the engine's
config, which is read per request). HTTP clients are told apart by address (no API key; a
second client connects from 127.0.0.2), gRPC ones by their bearer token (keys configured, as
`jaxserve serve --api-key` sets it).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from types import SimpleNamespace

import grpc
import httpx
import numpy as np
import pytest

from front_load_helpers import (KEY_A, KEY_B, MODEL, UNBOUNDED, address_client, body,
                                engine_held, grpc_generate, http_completion, key_client,
                                per_key_bound, until, wait_for)
from jaxserve import SamplingParams
from jaxserve.entrypoints.grpc import convert
from jaxserve.entrypoints.grpc.pb import jaxserve_pb2_grpc as pb_grpc

NUM_TEXT_WORKERS = 2
WORDS = "the cat sat on a mat and dog ran far away from home to see big red sun".split()


@pytest.fixture(scope="module")
def fronts():
    from conftest import SMALL_ENGINE
    from http_server_main import tiny_bpe_loaded

    from jaxserve.config import EngineConfig
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.engine.engine import Engine
    from jaxserve.entrypoints.grpc.background import ServerThread
    from jaxserve.entrypoints.openai.http_server import HttpServer, HttpSettings
    from jaxserve.engine.prompt_intake import TextPool

    engine = Engine(EngineConfig.from_kwargs(**SMALL_ENGINE), loaded=tiny_bpe_loaded(),
                    progress=False)
    async_engine = AsyncEngine(engine, text_pool=TextPool(num_workers=NUM_TEXT_WORKERS))
    async_engine.start()
    grpc_server = ServerThread(async_engine)
    grpc_server.handle.servicer.keyed_clients = True
    http = grpc_server.call(HttpServer.start("127.0.0.1", HttpSettings(port=0)), 60)
    http.attach(async_engine)
    yield SimpleNamespace(engine=engine, async_engine=async_engine, url=http.url,
                          address=grpc_server.address)
    grpc_server.call(http.shutdown(timeout=1), 60)
    grpc_server.stop(timeout=1.0)
    async_engine.stop(timeout=10.0)


@pytest.fixture(scope="module")
def specs(fronts):
    """64 requests: text, its token ids, max_tokens, the tokens it gets alone; the same text as
    a user message (chat) and the tokens that chat gets alone. Each run by itself on an offline
    LLM over the same model (greedy)."""
    from conftest import SMALL_ENGINE
    from http_server_main import tiny_bpe_loaded

    from jaxserve.entrypoints.llm import LLM

    rng, tokenizer = np.random.default_rng(7), fronts.engine.tokenizer
    llm = LLM(loaded=tiny_bpe_loaded(), progress=False, **SMALL_ENGINE)
    out = []
    for _ in range(64):
        text = " ".join(rng.choice(WORDS, int(rng.integers(1, 12))))
        chat = [{"role": "user", "content": text}]
        ids, max_tokens = tokenizer.encode(text), int(rng.integers(1, 13))
        chat_ids = tokenizer.encode(tokenizer.apply_chat_template(
            chat, add_generation_prompt=True), add_special_tokens=False)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        alone, chat_alone = (llm.generate([p], params, use_tqdm=False)[0].token_ids
                             for p in (ids, chat_ids))
        out.append(SimpleNamespace(text=text, ids=ids, max_tokens=max_tokens, alone=alone,
                                   chat=chat, chat_alone=chat_alone))
    llm.close()
    return out


# ---- a burst is queued, never refused ----------------------------------------------------------
def test_256_http_completions_at_once_are_all_served_each_with_its_tokens_alone(fronts, specs):
    """Half text, half token ids; half streamed: 16 times max_num_seqs, no bound configured."""
    requests = [(k, body(spec.text if as_text else spec.ids, spec.max_tokens, stream))
                for k, spec in enumerate(specs)
                for as_text in (True, False) for stream in (True, False)]

    async def burst():
        async with httpx.AsyncClient(base_url=fronts.url, timeout=600, limits=UNBOUNDED) as http:
            return await asyncio.gather(*(http_completion(http, r) for _, r in requests))

    results = asyncio.run(burst())
    refused = [(status, got.text) for status, got in results if status != 200]
    assert not refused, f"{len(refused)} of 256 refused, e.g. {refused[:3]}"
    for (k, request), (_, (prompt_ids, ids, reason)) in zip(requests, results):
        what = f"request {k} ({'text' if isinstance(request['prompt'], str) else 'ids'}, " \
               f"stream={request['stream']})"
        assert ids == specs[k].alone, f"{what}: tokens differ from its run alone"
        assert reason == "length", f"{what}: finish {reason}"
        assert prompt_ids in (None, specs[k].ids), f"{what}: prompt tokenized differently"
    assert fronts.async_engine.clients.num_in_flight() == 0


def test_256_grpc_generate_calls_at_once_are_all_served_each_with_its_tokens_alone(fronts,
                                                                                 specs):
    """Per request: its text, its chat and its token ids twice (gRPC always streams)."""
    calls = [(prompt, spec.max_tokens, want) for spec in specs
             for prompt, want in ((spec.text, spec.alone), (spec.chat, spec.chat_alone),
                                  (spec.ids, spec.alone), (spec.ids, spec.alone))]

    async def burst():
        async with grpc.aio.insecure_channel(fronts.address) as channel:
            stub = pb_grpc.JaxServeStub(channel)
            return await asyncio.gather(*(grpc_generate(stub, p, n) for p, n, _ in calls))

    results = asyncio.run(burst())
    refused = [r for r in results if r[0] != "OK"]
    assert not refused, f"{len(refused)} of 256 refused, e.g. {refused[:3]}"
    for i, ((prompt, _, want), (_, ids, reason)) in enumerate(zip(calls, results)):
        assert (ids, reason) == (want, "length"), f"call {i} ({prompt!r})"
    assert fronts.async_engine.clients.num_in_flight() == 0


def test_token_ids_never_wait_for_a_busy_text_pool_and_text_work_queues_behind_it(fronts,
                                                                                specs):
    text, ids, n, alone = specs[0].text, specs[0].ids, specs[0].max_tokens, specs[0].alone
    release, pool = threading.Event(), fronts.async_engine.text_pool
    blockers = [threading.Thread(target=lambda: asyncio.run(pool.run(release.wait)))
                for _ in range(NUM_TEXT_WORKERS)]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": n}

    async def scenario():
        async with httpx.AsyncClient(base_url=fronts.url, timeout=60) as http, \
                grpc.aio.insecure_channel(fronts.address) as channel:
            queued = asyncio.ensure_future(http.post("/v1/chat/completions", json=chat))
            try:  # every text worker is busy: token ids must not wait for one
                http_ids = await asyncio.wait_for(http_completion(http, body(ids, n)), 30)
                grpc_ids = await asyncio.wait_for(
                    grpc_generate(pb_grpc.JaxServeStub(channel), ids, n), 30)
                chat_waited = not queued.done()
            finally:
                release.set()
            return http_ids, grpc_ids, chat_waited, await queued

    for blocker in blockers:
        blocker.start()
    try:
        http_ids, grpc_ids, chat_waited, chat_response = asyncio.run(scenario())
    finally:
        release.set()
        for blocker in blockers:
            blocker.join(timeout=10)
    assert http_ids == (200, (ids, alone, "length")), http_ids
    assert grpc_ids == ("OK", alone, "length"), grpc_ids
    assert chat_waited, "the chat did not wait for the busy text pool: the test proves nothing"
    assert chat_response.status_code == 200, f"queued text work was refused: {chat_response.text}"


# ---- one client at its bound, another admitted -------------------------------------------------
def test_an_http_client_at_its_bound_gets_429_while_another_client_is_admitted(fronts):
    a, b = address_client("127.0.0.2"), address_client("127.0.0.1")
    clients, request = fronts.async_engine.clients, body("fair share", 6)

    async def scenario(release):
        transport = httpx.AsyncHTTPTransport(local_address="127.0.0.2", limits=UNBOUNDED)
        async with httpx.AsyncClient(base_url=fronts.url, timeout=120,
                                     transport=transport) as http_a, \
                httpx.AsyncClient(base_url=fronts.url, timeout=120, limits=UNBOUNDED) as http_b:
            from_a = [asyncio.ensure_future(http_a.post("/v1/completions", json=request))
                      for _ in range(50)]
            from_b = [asyncio.ensure_future(http_b.post("/v1/completions", json=request))
                      for _ in range(5)]
            answered = await until(lambda: sum(t.done() for t in from_a) == 45
                                   and clients.snapshot() == {a: 5, b: 5})
            snapshot, b_answered = clients.snapshot(), [t for t in from_b if t.done()]
            release()
            return answered, snapshot, b_answered, await asyncio.gather(*from_a, *from_b)

    with per_key_bound(fronts, 5), engine_held(fronts.async_engine) as release:
        answered, snapshot, b_answered, responses = asyncio.run(scenario(release))
    assert answered, f"in flight while the engine was held: {snapshot}"
    assert not b_answered, "client B was answered before the engine ran: refused?"
    refused = [r for r in responses[:50] if r.status_code != 200]
    assert len(refused) == 45, [r.status_code for r in responses[:50]]
    for r in refused:
        assert r.status_code == 429 and r.headers.get("Retry-After") == "1", (r, r.headers)
        error = r.json()["error"]
        assert error["type"] == "rate_limit_error", error
        assert "max_queued_requests_per_key=5" in error["message"], error
        assert "127.0.0.2" in error["message"], error
    for r in [r for r in responses[:50] if r.status_code == 200] + responses[50:]:
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert wait_for(lambda: clients.snapshot() == {}), clients.snapshot()


def test_a_grpc_client_at_its_bound_gets_resource_exhausted_while_another_key_is_admitted(
        fronts):
    a, b = key_client(KEY_A), key_client(KEY_B)
    clients = fronts.async_engine.clients

    async def scenario(release):
        async with grpc.aio.insecure_channel(fronts.address) as channel:
            stub = pb_grpc.JaxServeStub(channel)
            from_a = [asyncio.ensure_future(grpc_generate(stub, "fair share", 6, KEY_A))
                      for _ in range(50)]
            from_b = [asyncio.ensure_future(grpc_generate(stub, [5, 6, 7], 6, KEY_B))
                      for _ in range(5)]
            answered = await until(lambda: sum(t.done() for t in from_a) == 45
                                   and clients.snapshot() == {a: 5, b: 5})
            snapshot, b_answered = clients.snapshot(), [t for t in from_b if t.done()]
            release()
            return answered, snapshot, b_answered, await asyncio.gather(*from_a, *from_b)

    with per_key_bound(fronts, 5), engine_held(fronts.async_engine) as release:
        answered, snapshot, b_answered, results = asyncio.run(scenario(release))
    assert answered, f"in flight while the engine was held: {snapshot}"
    assert not b_answered, "the other key was answered before the engine ran: refused?"
    refused = [r for r in results[:50] if r[0] != "OK"]
    assert len(refused) == 45, [r[0] for r in results[:50]]
    for code, details, trailing in refused:
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
        assert "max_queued_requests_per_key=5" in details and "API key" in details, details
        assert "key-a" not in details, f"the refusal shows the key: {details}"
        assert trailing.get("retry-after") == "1", trailing
    for result in [r for r in results[:50] if r[0] == "OK"] + results[50:]:
        assert result[0] == "OK" and result[2] == "length", result
    assert wait_for(lambda: clients.snapshot() == {}), clients.snapshot()


def test_the_grpc_client_reports_the_retry_hint(fronts):
    from jaxserve.entrypoints.grpc.client import JaxServeClient, JaxServeError

    with JaxServeClient(fronts.address, timeout=60) as client:
        with per_key_bound(fronts, 1), engine_held(fronts.async_engine):
            held = client.generate([5, 6], SamplingParams(max_tokens=2))
            assert wait_for(lambda: fronts.async_engine.clients.num_in_flight() == 1)
            with pytest.raises(JaxServeError) as info:
                client.generate_text([5, 6], SamplingParams(max_tokens=2))
        assert list(held)[-1].finish_reason, "the admitted call did not finish"
    assert (info.value.code, info.value.retry_after) == (grpc.StatusCode.RESOURCE_EXHAUSTED, 1)
    assert wait_for(lambda: fronts.async_engine.clients.num_in_flight() == 0)


# ---- no count outlives its request -------------------------------------------------------------
def metric(fronts, name: str, **labels) -> float:
    return fronts.engine.metrics.registry.get_sample_value(name, labels or None) or 0.0


def aborted(fronts) -> float:
    return metric(fronts, "jaxserve_requests_finished_total", finish_reason="abort")


@pytest.fixture
def slow_steps(fronts, monkeypatch):
    """Each engine step 5 ms slower, so a long request is still running when its client goes."""
    step = fronts.engine.step
    monkeypatch.setattr(fronts.engine, "step", lambda: (time.sleep(0.005), step())[1])


def http_post(fronts, request: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(fronts.url + path, json=request, timeout=60)


def http_finished(fronts):
    assert http_post(fronts, body([5, 6], 4)).status_code == 200
    assert asyncio.run(_one_stream(fronts, body("a b", 4, stream=True)))[0] == 200


async def _one_stream(fronts, request):
    async with httpx.AsyncClient(base_url=fronts.url, timeout=60) as http:
        return await http_completion(http, request)


def http_refused_by_the_engine(fronts):
    r = http_post(fronts, body([5, 99999], 4))
    assert (r.status_code, r.json()["error"]["param"]) == (400, "prompt"), r.text


def http_refused_by_validation(fronts):
    assert http_post(fronts, body([5], "many")).status_code == 400
    assert http_post(fronts, {"model": MODEL, "prompt": "x"}, "/tokenize").status_code == 200


def http_stream_closed_midway(fronts):
    async def scenario():
        async with httpx.AsyncClient(base_url=fronts.url, timeout=60) as http:
            async with http.stream("POST", "/v1/completions",
                                   json=body("go on", 400, stream=True)) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        return  # leaving the block closes the connection
    before = aborted(fronts)
    asyncio.run(scenario())
    assert wait_for(lambda: aborted(fronts) == before + 1), "the request was not aborted"


def http_client_gone_before_the_answer(fronts):
    before, data = aborted(fronts), json.dumps(body("never read", 400)).encode()
    host, port = fronts.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
        assert wait_for(lambda: fronts.engine.stats.num_running == 1), "it never ran"
    assert wait_for(lambda: aborted(fronts) == before + 1), "the request was not aborted"


def http_timeout_in_the_queue(fronts):
    result = {}
    with engine_held(fronts.async_engine):
        sender = threading.Thread(target=lambda: result.update(
            r=http_post(fronts, body([5, 6], 2, timeout=0.05))))
        sender.start()
        assert wait_for(lambda: fronts.async_engine.num_in_flight == 1)
        time.sleep(0.1)  # past its timeout
    sender.join(timeout=60)
    assert result["r"].status_code == 408, result["r"].text


def grpc_ended(fronts, prompt, max_tokens=4, timeout=60, cancel_after_first=False):
    async def scenario():
        async with grpc.aio.insecure_channel(fronts.address) as channel:
            call = pb_grpc.JaxServeStub(channel).Generate(convert.generate_request(
                prompt, SamplingParams(max_tokens=max_tokens)), timeout=timeout,
                metadata=KEY_A)
            try:
                async for _ in call:
                    if cancel_after_first:
                        call.cancel()
                        return grpc.StatusCode.CANCELLED
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK
    return asyncio.run(scenario())


def grpc_finished_refused_and_tokenized(fronts):
    from jaxserve.entrypoints.grpc.client import JaxServeClient

    assert grpc_ended(fronts, [5, 6]) == grpc.StatusCode.OK
    assert grpc_ended(fronts, [5, 99999]) == grpc.StatusCode.INVALID_ARGUMENT
    with JaxServeClient(fronts.address, timeout=60) as client:
        assert client.tokenize("a b") == fronts.engine.tokenizer.encode("a b")


def grpc_cancelled_midway(fronts):
    before = aborted(fronts)
    assert grpc_ended(fronts, "go on", 400, cancel_after_first=True) == \
        grpc.StatusCode.CANCELLED
    assert wait_for(lambda: aborted(fronts) == before + 1), "the request was not aborted"


def grpc_deadline_in_the_queue(fronts):
    with engine_held(fronts.async_engine):
        assert grpc_ended(fronts, [5, 6], timeout=0.2) == grpc.StatusCode.DEADLINE_EXCEEDED


ENDINGS = [http_finished, http_refused_by_the_engine, http_refused_by_validation,
           http_stream_closed_midway, http_client_gone_before_the_answer,
           http_timeout_in_the_queue, grpc_finished_refused_and_tokenized,
           grpc_cancelled_midway, grpc_deadline_in_the_queue]


@pytest.mark.parametrize("ending", ENDINGS, ids=[e.__name__ for e in ENDINGS])
def test_no_client_count_outlives_its_request(fronts, slow_steps, ending):
    clients = fronts.async_engine.clients
    with per_key_bound(fronts, 4):
        ending(fronts)
        assert wait_for(lambda: clients.snapshot() == {}), \
            f"{ending.__name__}: counts left behind: {clients.snapshot()}"
        # and the bound still admits its full share afterwards
        assert http_post(fronts, body([7], 2)).status_code == 200
    assert wait_for(lambda: not fronts.engine.has_unfinished())
