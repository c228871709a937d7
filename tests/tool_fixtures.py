"""Tool-calling test data and helpers: six function tools whose schemas cover nested objects,
enums, arrays, integers and bounded numbers, strings that must carry quotes, a $ref into $defs
and no parameters at all; the ChatML template with tools (tool_chat_template.jinja); the server
a test module shares (serve_tools: the real default model over gRPC and HTTP); and the checks a
reply's calls must pass (every arguments string is JSON that validates against its tool's
schema, with `jsonschema`).

Every string and array is bounded, so a constrained call always ends within CALL_TOKENS (the
test asserts the calls finished, never that a random model chose to stop).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import jsonschema

from model_fixtures import real_default_model

TEMPLATE = (Path(__file__).resolve().parent / "tool_chat_template.jinja").read_text()
CALL_TOKENS = 320  # max_tokens of a constrained reply: every schema below ends well before


def _tool(name: str, description: str, parameters: dict | None) -> dict:
    function = {"name": name, "description": description}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


WEATHER = _tool("get_weather", "The current weather in a city", {
    "type": "object",
    "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 24},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False})
ADD = _tool("add", "Add two numbers", {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                   "b": {"type": "number", "minimum": 0, "maximum": 10}},
    "required": ["a", "b"], "additionalProperties": False})
EVENT = _tool("create_event", "Put an event in the calendar", {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 24},
        "when": {"type": "object",
                 "properties": {"day": {"type": "integer", "minimum": 1, "maximum": 31},
                                "month": {"enum": ["jan", "feb", "mar", "apr"]}},
                 "required": ["day", "month"], "additionalProperties": False},
        "attendees": {"type": "array", "items": {"type": "string", "maxLength": 12},
                      "maxItems": 3}},
    "required": ["title", "when", "attendees"], "additionalProperties": False})
QUOTE = _tool("quote", 'Quote what someone said, "in quotes"', {
    "type": "object",
    "properties": {"who": {"type": "string", "maxLength": 16},
                   "said": {"type": "string", "pattern": '^"[A-Za-z ,!]{1,24}"$'}},
    "required": ["who", "said"], "additionalProperties": False})
FLAGS = _tool("set_flags", "Turn feature flags on or off", {
    "type": "object",
    "properties": {"flags": {"type": "array", "items": {"$ref": "#/$defs/flag"},
                             "minItems": 1, "maxItems": 2}},
    "required": ["flags"], "additionalProperties": False,
    "$defs": {"flag": {"type": "object",
                       "properties": {"name": {"enum": ["dark_mode", "beta"]},
                                      "on": {"type": "boolean"}},
                       "required": ["name", "on"], "additionalProperties": False}}})
PING = _tool("ping", "Check that the service is up", None)
TOOLS = [WEATHER, ADD, EVENT, QUOTE, FLAGS, PING]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters",
                                                    {"type": "object", "properties": {},
                                                     "additionalProperties": False})
           for t in TOOLS}
ASKS = {
    "get_weather": "What is the weather like in Paris right now?",
    "add": "What is 12 plus 7.5?",
    "create_event": "Book lunch with Ana and Bo on the third of March.",
    "quote": 'Quote Ada saying "hello world".',
    "set_flags": "Turn dark mode on and the beta off.",
    "ping": "Is the service up?",
}


ROUND_TRIP = [
    {"role": "user", "content": ASKS["get_weather"]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather",
                      "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
]


def serve_tools(tool_calls=None):
    """A module fixture's body: the real default model served over gRPC and HTTP (with the
    tool template) on one event loop thread; tool_calls: both fronts' ToolCallSettings."""
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.entrypoints.grpc.background import ServerThread
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.entrypoints.openai.http_server import HttpServer, HttpSettings

    llm = LLM(loaded=real_default_model(), progress=False, max_num_seqs=4,
              max_num_batched_tokens=128, token_buckets=(8, 128), seq_buckets=(4,),
              layer_loop="scan", max_model_len=1536)
    async_engine = AsyncEngine(llm.engine)
    async_engine.start()
    grpc_server = ServerThread(async_engine, tool_calls=tool_calls)
    settings = HttpSettings(port=0, chat_template=TEMPLATE,
                            **({"tool_calls": tool_calls} if tool_calls else {}))
    http = grpc_server.call(HttpServer.start("127.0.0.1", settings), 60)
    http.attach(async_engine)
    yield SimpleNamespace(url=http.url, grpc=grpc_server, http=http, engine=llm.engine,
                          model=http.state.serving.model_name)
    grpc_server.call(http.shutdown(timeout=1), 60)
    grpc_server.stop(timeout=1.0)
    async_engine.stop(timeout=10.0)
    llm.close()


def chat(served, body: dict) -> httpx.Response:
    return httpx.post(served.url + "/v1/chat/completions", timeout=600,
                      json={"model": served.model, **body})


def chat_ok(served, body: dict) -> dict:
    r = chat(served, body)
    assert r.status_code == 200, r.text
    return r.json()


def chat_stream(served, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", served.url + "/v1/chat/completions", timeout=600,
                      json={"model": served.model, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    assert all("error" not in c for c in chunks), chunks
    return chunks


def check_choice_calls(choice: dict, where: str) -> list[dict]:
    message = choice["message"]
    assert message["content"] is None, f"{where}: content {message['content']!r} with calls"
    calls = message["tool_calls"]
    assert calls, f"{where}: no tool calls"
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function", call
        check_call(call["function"]["name"], call["function"]["arguments"], where)
    return calls


def free_pages(served) -> float:
    text = httpx.get(served.url + "/metrics").text
    return float(re.search(r"^jaxserve_kv_cache_free_pages (\S+)$", text, re.M).group(1))


def all_pages_free(served, timeout: float = 30.0) -> bool:
    """Whether every KV page (page 0 is reserved) is free, waiting up to timeout seconds for
    the engine to release the last request's."""
    all_pages = served.engine.info.num_pages - 1
    deadline = time.monotonic() + timeout
    while free_pages(served) != all_pages and time.monotonic() < deadline:
        time.sleep(0.05)
    return free_pages(served) == all_pages


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def user(text: str) -> list[dict]:
    return [{"role": "system", "content": "You are a helpful assistant with tools."},
            {"role": "user", "content": text}]


def check_call(name: str, arguments: str, where: str) -> dict:
    """The call's arguments, parsed; fails the test naming `where` unless they are JSON that
    validates against the named tool's schema."""
    assert name in SCHEMAS, f"{where}: {name!r} is not one of the tools"
    try:
        value = json.loads(arguments)
        jsonschema.validate(value, SCHEMAS[name])
    except (ValueError, jsonschema.ValidationError) as exc:
        raise AssertionError(f"{where}: {name}({arguments!r}) does not fit its schema: "
                             f"{exc}") from None
    return value


def streamed_calls(chunks: list[dict]) -> tuple[dict[int, list[dict]], dict, dict]:
    """SSE chunk bodies -> per choice its calls as {id, name, arguments} (argument fragments
    joined in order), per choice its content (None if never any) and finish reason. Each
    call's first delta must carry its id, type and name, with arguments ""."""
    calls: dict[int, list[dict]] = {}
    content: dict[int, str | None] = {}
    reasons: dict[int, str | None] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            i, delta = choice["index"], choice["delta"]
            if delta.get("content"):
                content[i] = (content.get(i) or "") + delta["content"]
            for call in delta.get("tool_calls") or ():
                mine = calls.setdefault(i, [])
                if call["index"] == len(mine):
                    assert call.get("id", "").startswith("call_") and call["type"] == \
                        "function" and call["function"]["name"] and \
                        call["function"]["arguments"] == "", f"first delta {call}"
                    mine.append({"id": call["id"], "name": call["function"]["name"],
                                 "arguments": ""})
                else:
                    assert "id" not in call and "name" not in call["function"], call
                mine[call["index"]]["arguments"] += call["function"]["arguments"]
            reasons[i] = choice["finish_reason"] or reasons.get(i)
    return calls, content, reasons
