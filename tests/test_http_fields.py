"""The OpenAI HTTP API's request fields, over test_http's `run_server` process: a field the server
does not know is ignored, as vLLM ignores it (200, one warning per request in the server's log,
the X-Jaxserve-Ignored-Fields header on the response, stream and error alike); known fields take
OpenAI's types strictly (no "yes" or "5" coerced) and a bad value is a 400 naming the field; the
fields accepted without effect (user, metadata, store=false, service_tier)
pass silently and change nothing; store=true and stream_options without stream are 400s. The
server keeps serving throughout. The header's sanitizing and the docs' list are checked without
the server.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")

from test_http import (client, http_process, server,  # noqa: E402,F401  (the same fixtures)
                       ALL_PAGES, free_pages, wait_for)

KEY = "sk-test"
MODEL = "tiny-llama"
HEADER = "X-Jaxserve-Ignored-Fields"
M = [{"role": "user", "content": "hi"}]
GREEDY = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
COMP = {"model": MODEL, "prompt": "the field test", **GREEDY}
CHAT = {"model": MODEL, "messages": M, **GREEDY}


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as http:
        yield http


def warnings_naming(http_process, marker: str) -> list[str]:
    return [line for line in http_process.lines
            if "ignored request fields" in line and marker in line]


def one_warning(http_process, marker: str) -> list[str]:
    """The server's warning lines naming `marker`, once it has logged one (stderr is read on a
    thread, so the line may come a moment after the response)."""
    wait_for(lambda: warnings_naming(http_process, marker), timeout=10)
    time.sleep(0.2)  # a second warning for the same request would be logged by now
    return warnings_naming(http_process, marker)


def named(response: httpx.Response) -> list[str]:
    return response.headers.get(HEADER, "").split(", ")


def test_unknown_fields_are_ignored_named_in_the_header_and_warned_once(http, http_process):
    r = http.post("/v1/completions", json={**COMP, "tools": [], "marker_completion": 1})
    assert r.status_code == 200, r.text
    assert named(r) == ["tools", "marker_completion"], r.headers
    assert len(r.json()["choices"][0]["token_ids"]) == 4
    lines = one_warning(http_process, "marker_completion")
    assert len(lines) == 1 and "tools" in lines[0] and "/v1/completions" in lines[0], lines


def test_a_stream_names_the_ignored_fields_nested_ones_by_path(http, http_process):
    body = {**CHAT, "stream": True, "reasoning_effort": "low", "marker_stream": True,
            "stream_options": {"include_usage": True, "include_obfuscation": False},
            "messages": [{"role": "user", "content": "hi", "refusal": None},
                         {"role": "assistant", "content": [{"type": "text", "text": "yes",
                                                            "cache_control": {}}],
                          "refusal": None, "annotations": []},
                         {"role": "user", "content": "again"}]}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert set(named(r)) == {"reasoning_effort", "marker_stream",
                             "stream_options.include_obfuscation", "messages[*].refusal",
                             "messages[*].annotations", "messages[*].content[*].cache_control"}
    assert events[-1] == "data: [DONE]" and '"usage"' in events[-2], events[-3:]
    assert len(one_warning(http_process, "marker_stream")) == 1


def test_the_openai_client_extra_body_fields_the_server_does_not_know_are_ignored(client):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=M, max_tokens=3, temperature=0.0,
        extra_body={"reasoning_effort": "low", "prediction": {"type": "content"}})
    assert set(raw.headers[HEADER].split(", ")) == {"reasoning_effort", "prediction"}
    assert raw.parse().usage.completion_tokens <= 3


def test_an_error_answer_names_the_ignored_fields_too(http):
    r = http.post("/v1/completions", json={**COMP, "max_tokens": 9999, "marker_error": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert named(r) == ["marker_error"], r.headers


def test_tokenize_and_detokenize_ignore_unknown_fields_too(http):
    r = http.post("/tokenize", json={"prompt": "hi", "marker_tokenize": 1})
    assert r.status_code == 200 and named(r) == ["marker_tokenize"], (r.text, r.headers)
    r = http.post("/detokenize", json={"tokens": r.json()["tokens"], "marker_detok": 1})
    assert r.status_code == 200 and named(r) == ["marker_detok"], (r.text, r.headers)


STRICT = [  # (path, body additions, field named): OpenAI's types, nothing coerced
    ("/v1/completions", {"stream": "yes"}, "stream"),
    ("/v1/completions", {"stream": "true"}, "stream"),
    ("/v1/completions", {"stream": 1}, "stream"),
    ("/v1/completions", {"max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"max_tokens": 5.0}, "max_tokens"),
    ("/v1/completions", {"max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"temperature": "0.5"}, "temperature"),
    ("/v1/completions", {"n": "2"}, "n"),
    ("/v1/completions", {"seed": "7"}, "seed"),
    ("/v1/completions", {"echo": 0}, "echo"),
    ("/v1/completions", {"ignore_eos": "yes"}, "ignore_eos"),
    ("/v1/completions", {"logit_bias": {"5": "1"}}, "logit_bias"),
    ("/v1/completions", {"stop_token_ids": ["3"]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": ["1", 2]}, "prompt"),
    ("/v1/completions", {"user": 5}, "user"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"max_completion_tokens": "3"}, "max_completion_tokens"),
    ("/v1/chat/completions", {"stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
    ("/v1/chat/completions", {"metadata": {"k": 1}}, "metadata"),
    ("/v1/chat/completions", {"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ("/v1/chat/completions", {"store": "no"}, "store"),
    ("/v1/chat/completions", {"service_tier": "fastest"}, "service_tier"),
    ("/v1/chat/completions", {"parallel_tool_calls": "true"}, "parallel_tool_calls"),
    # What OpenAI refuses whatever the types
    ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"stream": False, "stream_options": {}}, "stream_options"),
    ("/v1/chat/completions", {"store": True}, "store"),
    # An output constraint refuses keys it does not know
    ("/v1/chat/completions", {"response_format": {"type": "json_object", "strict": True}},
     "response_format.strict"),
    ("/v1/completions", {"structured_outputs": {"regex": "a+", "flags": "i"}},
     "structured_outputs.flags"),
]


@pytest.mark.parametrize("path,extra,field", STRICT,
                         ids=[f"{f}={e.get(f.split('.')[0])!r}"[:40] for _, e, f in STRICT])
def test_a_bad_value_is_a_400_naming_its_field(http, path, extra, field):
    r = http.post(path, json={**(COMP if "chat" not in path else CHAT), **extra})
    assert r.status_code == 400, (path, extra, r.text)
    error = r.json()["error"]
    assert re.fullmatch(re.escape(field) + r"(\[\d+\]|\.\w+)*", error["param"] or ""), \
        (extra, error)
    assert field.split(".")[-1] in error["message"], (extra, error)
    assert HEADER not in r.headers, r.headers


def test_store_true_says_the_server_stores_nothing(http):
    error = http.post("/v1/chat/completions", json={**CHAT, "store": True}).json()["error"]
    assert "stores nothing" in error["message"], error


NO_EFFECT = {"user": "someone", "metadata": {"team": "a"}, "store": False,
             "service_tier": "auto"}


def test_the_fields_without_effect_pass_silently_and_change_nothing(http, http_process):
    plain = http.post("/v1/chat/completions", json=CHAT)
    given = http.post("/v1/chat/completions", json={**CHAT, **NO_EFFECT})
    assert plain.status_code == given.status_code == 200, given.text
    assert HEADER not in given.headers, given.headers
    assert given.json()["choices"][0]["token_ids"] == plain.json()["choices"][0]["token_ids"]
    r = http.post("/v1/completions", json={**COMP, "user": "someone"})
    assert r.status_code == 200 and HEADER not in r.headers, (r.text, r.headers)
    time.sleep(0.2)
    assert not [line for line in http_process.lines if "ignored request fields" in line
                and re.search(r"\b(user|metadata|store|service_tier)\b",
                              line)], "a field accepted without effect was warned about"


def test_the_server_keeps_serving_and_frees_every_page(server, client):
    r = client.completions.create(model=MODEL, prompt="still here", max_tokens=3,
                                  temperature=0.0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
    assert wait_for(lambda: free_pages(server) == ALL_PAGES), "every KV page is free"


# ---- without the server --------------------------------------------------------------------
def test_the_header_shows_odd_names_as_json_and_caps_their_number():
    from jaxserve.entrypoints.openai import protocol as api
    from jaxserve.entrypoints.openai.ignored import MAX_NAMES, describe, ignored_fields

    body = {"model": MODEL, "prompt": "x", "a\r\nSet-Cookie: x": 1, "é": 2, "z" * 500: 3}
    shown = describe(ignored_fields(api.CompletionRequest.model_validate(body)))
    assert shown.isascii() and shown.isprintable() and len(shown) < 200, shown
    assert shown.startswith('"a\\r\\nSet-Cookie: x", "\\u00e9", "zzz'), shown
    many = {f"f{i}": i for i in range(MAX_NAMES + 5)}
    shown = describe(ignored_fields(api.CompletionRequest.model_validate({**body, **many})))
    assert shown.endswith(", and 8 more"), shown


def test_every_field_accepted_without_effect_is_declared_and_documented():
    from jaxserve.entrypoints.openai import protocol as api

    models = {"completions": api.CompletionRequest, "chat": api.ChatCompletionRequest}
    docs = (Path(__file__).resolve().parent.parent / "docs" / "openai_api.md").read_text()
    section = docs[docs.index("Accepted without effect"):]
    assert set(NO_EFFECT) == set(api.ACCEPTED_WITHOUT_EFFECT)
    for field, endpoints in api.ACCEPTED_WITHOUT_EFFECT.items():
        for endpoint in endpoints:
            assert field in models[endpoint].model_fields, (field, endpoint)
        assert f"| `{field}` | {', '.join(endpoints)} |" in section, field
