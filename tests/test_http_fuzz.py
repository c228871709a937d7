"""Fuzz: schemathesis draws requests from the server's own /openapi.json for the two generation
endpoints, valid ones (positive) and schema-violating ones (negative), and sends them to a live
`run_server` process over HTTP. No answer may be a 5xx, none may hang (every call has a timeout),
and afterwards the server still serves and every KV page is free.

Bounded: a few hundred examples in all. Each valid draw generates at most MAX_TOKENS tokens (a
drawn max_tokens above it is lowered, an absent one set), so the run stays cheap on the tiny
model; the drawn model name is replaced by the served one (unknown models: test_http's table).
"""

from __future__ import annotations

import re
import time

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402

MAX_TOKENS = 4
EXAMPLES = {"positive": 100, "negative": 60}  # per endpoint
ALL_PAGES = 47  # SMALL_ENGINE's 48, less the reserved page 0
TIMEOUT_S = 60  # per call: a hang fails the test instead of blocking it


@pytest.fixture(scope="module")
def server():
    from http_server_main import server_process

    with server_process() as process:
        yield process


@pytest.fixture(scope="module")
def schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


def cheap(body):
    """Valid token budgets lowered to MAX_TOKENS, a drawn model name (a string) replaced by the
    served one (else every draw is a 404), and the tool fields whose valid values depend on each
    other or on server flags made consistent; everything else left as drawn."""
    if isinstance(body, dict):
        if isinstance(body.get("model"), str):
            body["model"] = "tiny-llama"
        for key in ("max_tokens", "max_completion_tokens"):
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS:
                body[key] = MAX_TOKENS
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = MAX_TOKENS
        # tool_choice "auto" (the default with tools) needs server flags this server lacks, and
        # a choice without tools is refused: both are 400s by design, so most drawn tool
        # fields would leave no valid draw; "none" keeps the tools (they reach the template)
        if body.get("tools"):
            body["tool_choice"] = "none"
        else:
            body.pop("tool_choice", None)
        if isinstance(body.get("messages"), list):  # a tool message needs its call's id
            body["messages"] = [m for m in body["messages"]
                                if not (isinstance(m, dict) and m.get("role") == "tool")] or \
                [{"role": "user", "content": "hi"}]
    return body


def free_pages(server) -> float:
    text = httpx.get(server.url + "/metrics").text
    return float(re.search(r"^jaxserve_kv_cache_free_pages (\S+)$", text, re.M).group(1))


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_fuzzed_requests_never_get_a_5xx(server, schema, path, mode):
    operation = schema[path]["POST"]
    statuses: dict[int, int] = {}

    @settings(max_examples=EXAMPLES[mode], deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode)))
    def send(case):
        if isinstance(getattr(case, "body", None), dict):
            case.body = cheap(case.body)
        response = case.call(base_url=server.url, timeout=TIMEOUT_S)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, (case.body, response.text[:2000])
        if response.status_code >= 400:
            assert "error" in response.json(), response.text[:2000]

    send()
    assert sum(statuses.values()) >= 10, statuses
    if mode == "positive":
        assert statuses.get(200), f"no drawn request was served: {statuses}"


def test_after_the_fuzzing_the_server_serves_and_every_page_is_free(server):
    r = httpx.post(server.url + "/v1/completions", timeout=TIMEOUT_S,
                   json={"model": "tiny-llama", "prompt": "still here", "max_tokens": 3,
                         "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    deadline = time.monotonic() + 30
    while free_pages(server) != ALL_PAGES and time.monotonic() < deadline:
        time.sleep(0.05)
    assert free_pages(server) == ALL_PAGES
    assert "Traceback" not in server.log, server.log[-3000:]
