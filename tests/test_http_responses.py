"""The Responses API (POST /v1/responses, stateless) over one `run_server` process
(tests/http_server_main.py --model fixtures, with the compact tool chat template
tests/responses_chat_template.jinja), driven by the official openai client and raw httpx.

A response is the chat path's reply translated: its text equals the chat completion's for the
same conversation (greedy), its usage the chat usage, and its input may be a string, a message
list with instructions, or a conversation with an earlier function_call and its
function_call_output. Streams send OpenAI's events in order with sequence numbers 0, 1, ..., and
their deltas join to the non-streamed text and arguments. text.format json_schema and a named or
required tool choice give output that validates (jsonschema). Every body parses as the openai
package's types. Bad input (store, previous_response_id, a tool that is not a function, a named
tool not in tools, empty input, ...) is a 400 naming the field; the server keeps serving and
every KV page is free afterwards.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from openai.types.responses import ResponseOutputItem, ResponseStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402
from test_http import free_pages, wait_for  # noqa: E402
from tool_fixtures import ADD, CALL_TOKENS, SCHEMAS, WEATHER  # noqa: E402

KEY = "sk-test"
MODEL = "tiny"  # model_fixtures.random_model's name
ALL_PAGES = 47  # SMALL_ENGINE's 48, less the reserved page 0
TEMPLATE = Path(__file__).resolve().parent / "responses_chat_template.jinja"
SCHEMA = {"type": "object", "properties": {"b": {"enum": ["x", "yy"]},
                                           "n": {"type": "integer", "minimum": 0,
                                                 "maximum": 99}},
          "required": ["b", "n"], "additionalProperties": False}
JSON_FORMAT = {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA,
                          "strict": True}}
JSON_TOKENS = 300  # a random model writes whitespace wherever JSON allows it
GREEDY = {"temperature": 0.0}
FLAT = [{"type": "function", **tool["function"]} for tool in (WEATHER, ADD)]  # Responses' shape
ITEM = TypeAdapter(ResponseOutputItem)
EVENT = TypeAdapter(ResponseStreamEvent)
FINAL_EVENTS = ("response.created", "response.in_progress", "response.completed",
                "response.incomplete", "response.failed")


@pytest.fixture(scope="module")
def server():
    from http_server_main import drained_server_url

    yield from drained_server_url("--api-key", KEY, "--model", "fixtures",
                                  "--chat-template", str(TEMPLATE))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=300,
                      headers={"Authorization": f"Bearer {KEY}"}) as http:
        yield http


def check_body(body: dict) -> dict:
    """A response object as OpenAI shapes it: every output item validates as the openai
    package's type, ids have their prefixes, usage adds up."""
    assert body["object"] == "response" and body["id"].startswith("resp_"), body
    for item in body["output"]:
        ITEM.validate_python(item)
        prefix = {"message": "msg_", "function_call": "fc_", "reasoning": "rs_"}[item["type"]]
        assert item["id"].startswith(prefix), item
    usage = body["usage"]
    if usage is not None:
        assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"], usage
        assert set(usage["input_tokens_details"]) == {"cached_tokens"}, usage
        assert set(usage["output_tokens_details"]) == {"reasoning_tokens"}, usage
    return body


def without_ids(output: list) -> list:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in output]


def stream_events(http, body: dict) -> list[dict]:
    """The raw SSE events of a streamed request: each `event:` line names its data's type."""
    events = []
    with http.stream("POST", "/v1/responses", json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == kind, (kind, data)
                events.append(data)
    assert [e["sequence_number"] for e in events] == list(range(len(events))), events
    for event in events:
        if event["type"] not in FINAL_EVENTS:
            EVENT.validate_python(event)
    return events


def chat_text(client, messages, max_tokens, **kwargs):
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                       **GREEDY, **kwargs)
    return r.choices[0], r.usage


# ---- text ----------------------------------------------------------------------------------
def test_a_text_input_is_answered_as_the_chat_path_answers_it(client, http):
    r = client.responses.create(model=MODEL, input="the cat sat", max_output_tokens=12,
                                **GREEDY)
    choice, chat_usage = chat_text(client, [{"role": "user", "content": "the cat sat"}], 12)
    assert r.output_text == choice.message.content
    assert r.status == ("incomplete" if choice.finish_reason == "length" else "completed"), r
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens" and \
            r.output[0].status == "incomplete", r
    assert (r.usage.input_tokens, r.usage.output_tokens) == \
        (chat_usage.prompt_tokens, chat_usage.completion_tokens)
    raw = check_body(http.post("/v1/responses", json={
        "model": MODEL, "input": "the cat sat", "max_output_tokens": 12, **GREEDY,
        "metadata": {"team": "a"}, "user": "u1", "store": False,
        "reasoning": {"effort": "low"}}).json())
    assert [item["type"] for item in raw["output"]] == ["message"], raw
    assert raw["output"][0]["content"][0]["text"] == r.output_text
    echoed = {k: raw[k] for k in ("max_output_tokens", "temperature", "top_p", "tools",
                                  "tool_choice", "parallel_tool_calls", "text", "metadata",
                                  "store", "error", "previous_response_id", "reasoning")}
    assert echoed == {"max_output_tokens": 12, "temperature": 0.0, "top_p": None, "tools": [],
                      "tool_choice": "none", "parallel_tool_calls": True,
                      "text": {"format": {"type": "text"}}, "metadata": {"team": "a"},
                      "store": False, "error": None, "previous_response_id": None,
                      "reasoning": {"effort": "low"}}, echoed


def test_a_stream_sends_the_events_in_order_and_its_deltas_join_to_the_text(client, http):
    body = {"input": "on the mat", "max_output_tokens": 10, **GREEDY}
    whole = check_body(http.post("/v1/responses", json={"model": MODEL, **body}).json())
    text = whole["output"][0]["content"][0]["text"]
    events = stream_events(http, body)
    kinds = [e["type"] for e in events]
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert kinds == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"]
                     + ["response.output_text.delta"] * len(deltas)
                     + ["response.output_text.done", "response.content_part.done",
                        "response.output_item.done", f"response.{whole['status']}"]), kinds
    assert "".join(deltas) == text
    assert events[0]["response"]["status"] == "in_progress" and \
        events[0]["response"]["output"] == []
    final = check_body(events[-1]["response"])
    assert final["id"] == events[0]["response"]["id"]
    assert without_ids(final["output"]) == without_ids(whole["output"])
    assert [final["usage"][k] for k in ("input_tokens", "output_tokens")] == \
        [whole["usage"][k] for k in ("input_tokens", "output_tokens")]
    typed = list(client.responses.create(model=MODEL, stream=True, **body))
    assert [e.type for e in typed] == kinds  # the openai client reads every event


def test_messages_and_instructions_are_the_chat_conversation_with_a_system_message_first(
        client):
    given = [{"role": "user", "content": "hi"},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "hello", "annotations": []}]},
             {"role": "developer", "content": [{"type": "input_text", "text": "be kind"}]},
             {"role": "user", "content": [{"type": "input_text", "text": "and "},
                                          {"type": "input_text", "text": "again"}]}]
    r = client.responses.create(model=MODEL, input=given, instructions="be brief",
                                max_output_tokens=8, **GREEDY)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "developer", "content": "be kind"},
                {"role": "user", "content": "and \nagain"}]
    choice, chat_usage = chat_text(client, messages, 8)
    assert r.output_text == choice.message.content
    assert r.usage.input_tokens == chat_usage.prompt_tokens
    assert r.instructions == "be brief"


# ---- structured output ---------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_format_gives_text_that_validates(client, stream):
    kwargs = dict(model=MODEL, input="answer in JSON", max_output_tokens=JSON_TOKENS,
                  text=JSON_FORMAT, **GREEDY)
    if stream:
        with client.responses.stream(**kwargs) as events:
            deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
            r = events.get_final_response()
        assert "".join(deltas) == r.output_text
    else:
        r = client.responses.create(**kwargs)
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema"


def test_a_json_object_format_gives_a_json_object(client):
    r = client.responses.create(model=MODEL, input="an object", max_output_tokens=JSON_TOKENS,
                                text={"format": {"type": "json_object"}}, **GREEDY)
    assert r.status == "completed" and isinstance(json.loads(r.output_text), dict), r


# ---- function calls ------------------------------------------------------------------------
def check_call(item, where: str) -> dict:
    assert item.type == "function_call" and item.status == "completed", (where, item)
    assert item.call_id.startswith("call_") and item.id.startswith("fc_"), (where, item)
    arguments = json.loads(item.arguments)
    jsonschema.validate(arguments, SCHEMAS[item.name])
    return arguments


def test_a_named_function_is_called_with_valid_arguments_streamed_or_not(client, http):
    body = {"input": "What is the weather like in Paris?", "tools": FLAT,
            "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": CALL_TOKENS, **GREEDY}
    r = client.responses.create(model=MODEL, **body)
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"], r
    check_call(r.output[0], "named")
    assert r.output[0].name == "get_weather" and r.output_text == ""
    assert r.tool_choice.name == "get_weather" and [t.name for t in r.tools] == \
        ["get_weather", "add"]
    events = stream_events(http, body)
    kinds = [e["type"] for e in events]
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert kinds == (["response.created", "response.in_progress", "response.output_item.added"]
                     + ["response.function_call_arguments.delta"] * len(deltas)
                     + ["response.function_call_arguments.done", "response.output_item.done",
                        "response.completed"]), kinds
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert "".join(deltas) == done["arguments"] == r.output[0].arguments
    assert events[2]["item"]["name"] == "get_weather" and events[2]["item"]["arguments"] == ""


def test_required_makes_calls_that_each_validate(client):
    r = client.responses.create(model=MODEL, input="add 2 and 3", tools=FLAT,
                                tool_choice="required", parallel_tool_calls=False,
                                max_output_tokens=CALL_TOKENS, **GREEDY)
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"], r
    check_call(r.output[0], "required")


def test_a_follow_up_turn_sends_the_call_and_its_output_back(client, http):
    ask = {"role": "user", "content": "What is the weather like in Paris?"}
    first = client.responses.create(model=MODEL, input=[ask], tools=FLAT,
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    max_output_tokens=CALL_TOKENS, **GREEDY)
    call = first.output[0]
    check_call(call, "first turn")
    output = {"type": "function_call_output", "call_id": call.call_id,
              "output": '{"temperature": 21}'}
    raw = client.responses.with_raw_response.create(  # the output items sent back as they are
        model=MODEL, input=[ask, *first.output, output], tools=FLAT, tool_choice="none",
        max_output_tokens=8, **GREEDY)
    assert "X-Jaxserve-Ignored-Fields" not in raw.headers, raw.headers
    r = raw.parse()
    assert [o.type for o in r.output] == ["message"], r
    messages = [ask, {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call.call_id, "type": "function",
                     "function": {"name": call.name, "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": output["output"]}]
    chat_tools = [WEATHER, ADD]
    tokens = http.post("/tokenize", json={"messages": messages, "tools": chat_tools}).json()
    assert r.usage.input_tokens == tokens["count"], "the call and its output reach the template"
    choice, _ = chat_text(client, messages, 8, tools=chat_tools, tool_choice="none")
    assert r.output_text == choice.message.content


# ---- refusals --------------------------------------------------------------------------------
BAD = [
    ({"store": True}, "store", "stores no responses"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
    ({"conversation": "conv_1"}, "conversation", "stores no responses"),
    ({"background": True}, "background", "stores no responses"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "function"),
    ({"tools": FLAT, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
     "'nope'"),
    ({"tool_choice": {"type": "function", "name": "get_weather"}}, "tool_choice", "tools"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice.type", "function"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "nonsense"}}],
      "tool_choice": "required"}, "tools[0].parameters", "parameters"),
    ({"input": ""}, "input", "empty"),
    ({"input": []}, "input", "at least 1"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "nothing to answer"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]", "input item"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type", "input_text"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "user"),
    ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]},
     "input[0].call_id", "'c1'"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f"}]},
     "input[0].arguments", "required"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema",
     "required"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
     "text.format", "schema"),
    ({"text": {"format": {"type": "json_object", "strict": "yes", "extra": 1}}},
     "text.format.strict", "strict"),
    ({"max_output_tokens": 100000}, "max_output_tokens", "at most"),
    ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal"),
    ({"temperature": "hot"}, "temperature", "temperature"),
]


@pytest.mark.parametrize("extra,field,words", BAD, ids=[f for _, f, _ in BAD])
def test_bad_input_is_a_400_naming_the_field(http, extra, field, words):
    r = http.post("/v1/responses", json={"model": MODEL, "input": "hi", **extra})
    assert r.status_code == 400, (extra, r.text)
    error = r.json()["error"]
    assert error["param"] == field and words in error["message"], (extra, error)
    assert error["type"] == "invalid_request_error" and error["code"] == 400, error


def test_an_unknown_model_is_a_404_and_a_body_not_sent_as_json_a_415(http):
    r = http.post("/v1/responses", json={"model": "nope", "input": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
    r = http.post("/v1/responses", content=json.dumps({"model": MODEL, "input": "hi"}),
                  headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["param"] == "content-type", r.text


def test_unknown_fields_are_ignored_and_named_in_the_header(http):
    r = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 2,
                                         "prompt_cache_key": "k", "include": ["x"]})
    assert r.status_code == 200, r.text
    assert set(r.headers["X-Jaxserve-Ignored-Fields"].split(", ")) == \
        {"prompt_cache_key", "include"}, r.headers


def test_a_client_leaving_a_stream_frees_its_request_and_the_server_keeps_serving(server,
                                                                                    http):
    body = {"model": MODEL, "input": "answer in JSON", "max_output_tokens": JSON_TOKENS,
            "text": JSON_FORMAT, "stream": True}
    with http.stream("POST", "/v1/responses", json=body) as r:
        lines = r.iter_lines()
        assert [next(lines) for _ in range(3)][0] == "event: response.created"
    r = http.post("/v1/responses", json={"model": MODEL, "input": "still here",
                                         "max_output_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] <= 3, r.text
    assert wait_for(lambda: free_pages(server) == ALL_PAGES), "every KV page is free"
