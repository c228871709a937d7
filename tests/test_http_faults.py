"""Faults the OpenAI HTTP front end must contain, in-process: prompts over the size limits
(400 naming the limit, before any tokenizer work) and a `timeout` that passes while the request
is queued (408, dropped before it runs).

One HttpServer on a private event loop thread, over an AsyncEngine on the tiny model. A failing
engine (500, then 503) is test_http_lifecycle.py's; invalid UTF-8 bodies are test_http.py's.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import httpx
import pytest


@pytest.fixture(scope="module")
def http():
    from conftest import make_llm

    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.entrypoints.openai.http_server import HttpServer, HttpSettings

    llm = make_llm()
    async_engine = AsyncEngine(llm.engine)
    async_engine.start()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = asyncio.run_coroutine_threadsafe(
        HttpServer.start("127.0.0.1", HttpSettings(port=0)), loop).result(60)
    server.attach(async_engine)
    yield SimpleNamespace(url=server.url, engine=llm.engine, async_engine=async_engine,
                          model=server.state.serving.model_name)
    asyncio.run_coroutine_threadsafe(server.shutdown(timeout=1), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    async_engine.stop(timeout=10)
    llm.close()


@pytest.fixture
def encode_calls(http, monkeypatch):
    tokenizer, calls = http.engine.tokenizer, []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, *a, **k: (calls.append(len(text)),
                                                                    encode(text, *a, **k))[1])
    monkeypatch.setattr(tokenizer, "apply_chat_template",
                        lambda *a, **k: calls.append("template") or "")
    return calls


def post(http, path: str, body: dict) -> httpx.Response:
    return httpx.post(http.url + path, json={"model": http.model, **body}, timeout=60)


def test_a_prompt_over_the_character_limit_is_a_400_before_tokenizing(http, encode_calls):
    limit = http.async_engine.limits.max_prompt_chars
    r = post(http, "/v1/completions", {"prompt": "x" * (limit + 1), "max_tokens": 2})
    error = r.json()["error"]
    assert (r.status_code, error["param"]) == (400, "prompt"), r.text
    assert "max_prompt_chars" in error["message"] and str(limit) in error["message"], r.text
    assert encode_calls == [], "the tokenizer ran on a prompt refused for its size"


def test_token_ids_over_max_model_len_are_a_400_naming_the_limit(http):
    r = post(http, "/v1/completions", {"prompt": [5] * 513, "max_tokens": 2})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "prompt"), r.text
    assert "max_model_len" in r.json()["error"]["message"], r.text


def test_chat_messages_over_the_character_limit_are_a_400_before_templating(http,
                                                                              encode_calls):
    limit = http.async_engine.limits.max_prompt_chars
    messages = [{"role": "user", "content": "y" * (limit + 1)}]
    r = post(http, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "messages"), r.text
    assert "max_prompt_chars" in r.json()["error"]["message"], r.text
    assert encode_calls == [], "the chat was templated or tokenized despite its size"


def test_a_timeout_that_passes_in_the_queue_is_a_408_and_the_request_never_runs(http):
    async_engine, metrics = http.async_engine, http.engine.metrics.registry
    sample = lambda name: metrics.get_sample_value(name) or 0.0  # noqa: E731
    dropped = sample("jaxserve_requests_deadline_expired_total")
    prompt_tokens = sample("jaxserve_prompt_tokens_total")
    async_engine.paused.set()
    try:
        async_engine.abort("wake-up")  # an unknown id: wakes an idle loop, which then holds
        assert async_engine.holding.wait(10), "the engine loop never held"
        result = {}
        sender = threading.Thread(target=lambda: result.update(r=post(
            http, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "timeout": 0.05})))
        sender.start()
        while not async_engine.num_in_flight:  # submitted, not yet seen by the engine
            time.sleep(0.005)
        time.sleep(0.1)  # past its timeout
    finally:
        async_engine.paused.clear()
    sender.join(timeout=60)
    r = result["r"]
    assert (r.status_code, r.json()["error"]["type"]) == (408, "timeout_error"), r.text
    assert "waited in the queue" in r.json()["error"]["message"], r.text
    assert sample("jaxserve_requests_deadline_expired_total") == dropped + 1
    assert sample("jaxserve_prompt_tokens_total") == prompt_tokens, "the request ran"


def test_an_invalid_timeout_is_a_400_naming_it(http):
    r = post(http, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "timeout": 0})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "timeout"), r.text
