"""Reasoning output (--reasoning-parser) on /v1/chat/completions and gRPC, end to end.

One engine (reasoning_fixtures' tiny random model: <think> and </think> are single added tokens)
serves five front ends on one private event loop: HTTP with deepseek_r1 (the model's own
template opens <think> in the prompt) and without a parser, HTTP with qwen3 (a Qwen3 style
template that leaves <think> to the reply) and without a parser over the same template, and gRPC
with deepseek_r1. The random model writes the tags because a logit_bias makes them likely; each
request is seeded, so its tokens are the same on every front end with the same prompt, and what
a reply must split into is worked out here from the parser-less front end's reply. Checked: reasoning_content and content split at the tags, streamed and
not (the stream's pieces add up to the whole answer, its tokens and logprobs included); a JSON
schema constrains only what follows </think> (the reasoning is free text); enable_thinking=false
reaches the template and makes a qwen3 reply all content, with the constraint from its first
token; without a parser nothing changes.
"""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

import httpx
import pytest
from reasoning_fixtures import QWEN3, think_ids, think_loaded

jsonschema = pytest.importorskip("jsonschema")

HELLO = [{"role": "user", "content": "answer in JSON"}]
SCHEMA = {"type": "object", "properties": {"b": {"enum": ["x", "yy"]},
                                           "n": {"type": "integer", "minimum": 0,
                                                 "maximum": 99}},
          "required": ["b", "n"], "additionalProperties": False}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}}
JSON_CHARS = set('{}[]":,.-+eE0123456789 \t\r\nbnxy')  # all the schema's JSON can hold


@pytest.fixture(scope="module")
def served():
    from conftest import SMALL_ENGINE

    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.entrypoints.grpc.client import JaxServeClient
    from jaxserve.entrypoints.grpc.server import GrpcServer
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.entrypoints.openai.http_server import HttpServer, HttpSettings

    loaded = think_loaded()
    llm = LLM(loaded=loaded, progress=False, **SMALL_ENGINE)
    async_engine = AsyncEngine(llm.engine)
    async_engine.start()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(60)  # noqa: E731
    settings = {"plain": HttpSettings(port=0),
                "deepseek_r1": HttpSettings(port=0, reasoning_parser="deepseek_r1"),
                "plain_qwen3": HttpSettings(port=0, chat_template=QWEN3),
                "qwen3": HttpSettings(port=0, chat_template=QWEN3, reasoning_parser="qwen3")}
    https = {name: run(HttpServer.start("127.0.0.1", s)) for name, s in settings.items()}
    for http in https.values():
        http.attach(async_engine)
    grpc_server = run(GrpcServer.start("127.0.0.1", 0, async_engine,
                                       reasoning_parser="deepseek_r1"))
    client = JaxServeClient(grpc_server.address, timeout=60.0)
    start, end = think_ids(loaded.tokenizer)
    yield SimpleNamespace(urls={name: h.url for name, h in https.items()}, client=client,
                          tokenizer=loaded.tokenizer, start=start, end=end, engine=llm.engine)
    client.close()
    for server in (*https.values(), grpc_server):
        run(server.shutdown(timeout=1))
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    async_engine.stop(timeout=10)
    llm.close()


def post(served, front: str, body: dict, path: str = "/v1/chat/completions") -> dict:
    r = httpx.post(served.urls[front] + path, json={"model": "tiny", **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def chat(served, front: str, **body) -> dict:
    return post(served, front, {"messages": HELLO, "temperature": 1.0, **body})


def stream(served, front: str, **body) -> list[dict]:
    """Every SSE chunk of a streamed chat request, [DONE] checked and left out."""
    with httpx.stream("POST", served.urls[front] + "/v1/chat/completions", timeout=120,
                      json={"model": "tiny", "messages": HELLO, "temperature": 1.0,
                            "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def gathered(chunks: list[dict]) -> dict:
    """A stream's deltas added up: reasoning, content, token ids, logprob entries, finish."""
    out = {"reasoning_content": "", "content": "", "token_ids": [], "logprobs": [],
           "finish_reason": None, "keys": set()}
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            out["keys"] |= set(delta)
            out["reasoning_content"] += delta.get("reasoning_content") or ""
            out["content"] += delta.get("content") or ""
            out["token_ids"] += choice.get("token_ids") or []
            out["logprobs"] += (choice["logprobs"] or {}).get("content") or []
            out["finish_reason"] = choice["finish_reason"] or out["finish_reason"]
    return out


def expected_split(text: str, opened_in_prompt: bool) -> tuple:
    """(reasoning, content) a reply's text must split into: the reasoning ends at the first
    </think> (a reply that opens <think> itself starts with it), whitespace around it dropped;
    None for an empty part."""
    if not opened_in_prompt:
        assert text.startswith("<think>"), f"the seed no longer opens <think>: {text!r}"
        text = text[len("<think>"):]
    reasoning, tag, content = text.partition("</think>")
    assert tag, f"the seed no longer writes </think>: {text!r}"
    return reasoning.strip() or None, content.lstrip() or None


# Seeded requests whose random replies write the tags early (the model and seed are fixed).
DEEPSEEK = lambda s: dict(seed=1, max_tokens=40, logit_bias={str(s.end): 4})  # noqa: E731
QWEN = lambda s: dict(seed=39, max_tokens=40,  # noqa: E731
                      logit_bias={str(s.start): 3, str(s.end): 3})


@pytest.mark.parametrize("front", ["deepseek_r1", "qwen3"])
def test_reasoning_and_content_split_at_the_tags_streamed_and_not(served, front):
    body = (DEEPSEEK if front == "deepseek_r1" else QWEN)(served)
    whole = chat(served, front, return_token_ids=True, **body)["choices"][0]
    raw = chat(served, "plain" if front == "deepseek_r1" else "plain_qwen3",
               return_token_ids=True, **body)["choices"][0]
    assert raw["token_ids"] == whole["token_ids"], "a parser must not change the tokens"
    reasoning, content = expected_split(raw["message"]["content"],
                                        opened_in_prompt=front == "deepseek_r1")
    assert reasoning and content, f"the seed's reply has an empty part: {whole}"
    assert whole["message"]["reasoning_content"] == reasoning, whole
    assert whole["message"]["content"] == content, whole
    streamed = gathered(stream(served, front, return_token_ids=True, logprobs=True, **body))
    assert streamed["reasoning_content"] == reasoning, streamed
    assert streamed["content"] == content, streamed
    assert streamed["token_ids"] == whole["token_ids"], "the stream lost or moved tokens"
    assert len(streamed["logprobs"]) == len(whole["token_ids"]), "held tokens lost logprobs"
    assert streamed["finish_reason"] == whole["finish_reason"] == "length"


def test_include_reasoning_false_leaves_the_reasoning_out(served):
    body = DEEPSEEK(served)
    full = chat(served, "deepseek_r1", **body)["choices"][0]["message"]
    message = chat(served, "deepseek_r1", include_reasoning=False, **body)["choices"][0]["message"]
    assert message["reasoning_content"] is None and message["content"] == full["content"]
    streamed = gathered(stream(served, "deepseek_r1", include_reasoning=False, **body))
    assert "reasoning_content" not in streamed["keys"], streamed["keys"]
    assert streamed["content"] == full["content"]


@pytest.mark.parametrize("streamed", [False, True])
def test_a_json_schema_constrains_only_what_follows_the_reasoning(served, streamed):
    body = dict(seed=1, max_tokens=300, logit_bias={str(served.end): 4},
                response_format=JSON_FORMAT)
    if streamed:
        got = gathered(stream(served, "deepseek_r1", **body))
        reasoning, content, reason = got["reasoning_content"], got["content"], \
            got["finish_reason"]
    else:
        choice = chat(served, "deepseek_r1", **body)["choices"][0]
        reasoning, content = choice["message"]["reasoning_content"], choice["message"]["content"]
        reason = choice["finish_reason"]
    assert reason == "stop", f"finished by {reason!r}, not by the grammar: {content!r}"
    jsonschema.validate(json.loads(content), SCHEMA)
    assert reasoning and set(reasoning) - JSON_CHARS, (
        f"the reasoning {reasoning!r} should be free text, which no JSON of the schema holds")


def test_enable_thinking_false_reaches_the_template(served):
    def prompt(kwargs):
        body = {"messages": HELLO, **({"chat_template_kwargs": kwargs} if kwargs else {})}
        return post(served, "qwen3", body, "/tokenize")["tokens"]

    thinking, off = prompt(None), prompt({"enable_thinking": False})
    assert thinking == prompt({"enable_thinking": True})
    closed = served.tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    assert off == thinking + closed, f"the template did not get enable_thinking: {off}"


def test_qwen3_with_thinking_off_puts_everything_in_content(served):
    body = QWEN(served)
    off = chat(served, "qwen3", chat_template_kwargs={"enable_thinking": False},
               **body)["choices"][0]
    text = chat(served, "plain_qwen3", chat_template_kwargs={"enable_thinking": False},
                **body)["choices"][0]["message"]["content"]
    assert "</think>" in text, f"the reply should hold tags to leave alone: {text!r}"
    assert off["message"] == {"role": "assistant", "content": text, "reasoning_content": None}
    streamed = gathered(stream(served, "qwen3", chat_template_kwargs={"enable_thinking": False},
                               **body))
    assert (streamed["content"], streamed["keys"]) == (text, {"role", "content"}), streamed


def test_qwen3_with_thinking_off_constrains_from_the_first_token(served):
    choice = chat(served, "qwen3", chat_template_kwargs={"enable_thinking": False}, seed=1,
                  max_tokens=300, logit_bias={str(served.end): 4},
                  response_format=JSON_FORMAT)["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert choice["message"]["reasoning_content"] is None, choice
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_without_a_reasoning_parser_replies_are_as_the_model_writes_them(served):
    body = DEEPSEEK(served)
    plain = chat(served, "plain", return_token_ids=True, **body)["choices"][0]
    parsed = chat(served, "deepseek_r1", return_token_ids=True, **body)["choices"][0]
    assert plain["token_ids"] == parsed["token_ids"], "a parser must not change the tokens"
    assert set(plain["message"]) == {"role", "content"}, plain["message"]
    assert "</think>" in plain["message"]["content"], plain["message"]
    streamed = gathered(stream(served, "plain", **body))
    assert streamed["keys"] == {"role", "content"}, streamed["keys"]
    assert streamed["content"] == plain["message"]["content"]
    # and a constraint applies from the first token, as before
    constrained = chat(served, "plain", seed=1, max_tokens=300, response_format=JSON_FORMAT,
                       logit_bias={str(served.end): 4})["choices"][0]
    jsonschema.validate(json.loads(constrained["message"]["content"]), SCHEMA)


@pytest.mark.parametrize("kwargs,named", [({"add_generation_prompt": False},
                                             "add_generation_prompt"),
                                            ({"self": 1}, "self")])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_a_chat_template_kwarg_the_server_cannot_take_is_a_400_naming_the_field(
        served, kwargs, named, path):
    r = httpx.post(served.urls["deepseek_r1"] + path, timeout=60,
                   json={"model": "tiny", "messages": HELLO, "chat_template_kwargs": kwargs})
    error = r.json()["error"]
    assert (r.status_code, error["param"]) == (400, "chat_template_kwargs"), r.text
    assert named in error["message"], r.text


def test_grpc_refuses_a_chat_template_kwarg_it_cannot_take(served):
    import grpc

    from jaxserve.entrypoints.grpc.client import JaxServeError

    with pytest.raises(JaxServeError) as error:
        served.client.generate_text(messages=HELLO, chat_template_kwargs={"messages": []})
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat_template_kwargs" in error.value.details


def test_grpc_chat_carries_the_reasoning_apart(served):
    from jaxserve import SamplingParams
    from jaxserve.structured.params import StructuredOutputs

    http = chat(served, "deepseek_r1", return_token_ids=True, **DEEPSEEK(served))["choices"][0]
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=40, logit_bias={served.end: 4})
    result = served.client.generate_text(messages=HELLO, params=params)
    assert result.token_ids == http["token_ids"]
    assert (result.reasoning_text, result.text) == (http["message"]["reasoning_content"],
                                                    http["message"]["content"])
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=300, logit_bias={served.end: 4},
                            structured_outputs=StructuredOutputs(json=SCHEMA))
    result = served.client.generate_text(messages=HELLO, params=params)
    assert result.finish_reason == "stop" and set(result.reasoning_text) - JSON_CHARS, result
    jsonschema.validate(json.loads(result.text), SCHEMA)
    off = served.client.generate_text(messages=HELLO, params=params,
                                      chat_template_kwargs={"enable_thinking": False})
    assert off.reasoning_text == "" and off.finish_reason == "stop", off
    jsonschema.validate(json.loads(off.text), SCHEMA)  # the prompt closed the reasoning
