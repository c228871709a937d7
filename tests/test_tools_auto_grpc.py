"""tool_choice "auto" with the server's tool-call parser (--enable-auto-tool-choice
--tool-call-parser hermes), over HTTP and gRPC, and the gRPC Chat's tools, with the real default
model and the ChatML template with tools (tests/tool_chat_template.jinja).

A tiny model rarely chooses to call a tool, so the auto tests make it write one: a regex output
constraint (allowed with "auto", which adds none of its own) forces a hermes <tool_call> after a
sentence, and the parser must split the reply into that content and the call, streamed and
not. gRPC: named and "required" calls validate against their schemas on each sample's last
message, with FINISH_REASON_TOOL_CALLS for "required"; bad tools are INVALID_ARGUMENT naming
the field under chat.
"""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.slow
jsonschema = pytest.importorskip("jsonschema")

from tool_fixtures import (ASKS, CALL_TOKENS, ROUND_TRIP, TOOLS, chat_ok,  # noqa: E402
                           all_pages_free, chat_stream, check_call, named, serve_tools,
                           streamed_calls, user)

# a hermes-format reply: a sentence, then one get_weather call
HERMES_REPLY = (r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
                r'\{"city": "[A-Z][a-z]{2,8}", "unit": "(celsius|fahrenheit)"\}\}\n</tool_call>')


@pytest.fixture(scope="module")
def served():
    from jaxserve.config.tool_calls import ToolCallSettings

    yield from serve_tools(ToolCallSettings(enable_auto_tool_choice=True,
                                            tool_call_parser="hermes"))


# ---- tool_choice auto --------------------------------------------------------------------------
@pytest.mark.parametrize("tool_choice", [None, "auto"])
def test_auto_reads_a_hermes_call_out_of_the_reply_streamed_and_not(served, tool_choice):
    body = {"messages": user(ASKS["get_weather"]), "tools": TOOLS, "max_tokens": 80,
            "temperature": 0.0, "guided_regex": HERMES_REPLY}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    choice = chat_ok(served, body)["choices"][0]
    message = choice["message"]
    assert message["content"] == "Let me check." and choice["finish_reason"] == "tool_calls"
    [call] = message["tool_calls"]
    assert call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
    arguments = check_call("get_weather", call["function"]["arguments"], "auto")
    assert call["function"]["arguments"] == json.dumps(arguments)  # the parser's canonical JSON
    calls, content, reasons = streamed_calls(chat_stream(served, body))
    assert content[0] == message["content"] and reasons[0] == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls[0]] == \
        [("get_weather", call["function"]["arguments"])]


def test_auto_without_a_call_is_plain_content(served):
    body = {"messages": user("Say hello."), "tools": TOOLS, "tool_choice": "auto",
            "max_tokens": 12, "temperature": 0.0, "guided_regex": "Hello there[!.]"}
    choice = chat_ok(served, body)["choices"][0]
    assert choice["message"]["content"].startswith("Hello there"), choice
    assert not choice["message"].get("tool_calls") and choice["finish_reason"] == "stop"


def test_auto_answers_a_tool_round_trip_and_frees_every_page(served):
    body = {"messages": ROUND_TRIP, "tools": TOOLS, "max_tokens": 8, "temperature": 0.0}
    r = httpx.post(served.url + "/v1/chat/completions", timeout=600,
                   json={"model": served.model, **body})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"], r.text
    assert all_pages_free(served), "a KV page leaked"


def test_grpc_auto_reads_the_call_onto_the_last_message(served):
    from jaxserve.entrypoints.grpc.pb import jaxserve_pb2 as pb

    request = grpc_chat(user(ASKS["get_weather"]), "auto", max_tokens=80, temperature=0.0)
    request.sampling.structured_outputs.CopyFrom(pb.StructuredOutputs(regex=HERMES_REPLY))
    last = grpc_last(served, request)[0]
    assert last.content == "Let me check." and \
        last.finish_reason == pb.FINISH_REASON_TOOL_CALLS, last
    [call] = last.tool_calls
    check_call(call.function.name, call.function.arguments, "gRPC auto")


# ---- gRPC --------------------------------------------------------------------------------------
def grpc_chat(messages: list[dict], tool_choice=None, parallel: bool | None = None,
              tools: list[dict] = TOOLS, **sampling):
    from jaxserve.entrypoints.grpc.pb import jaxserve_pb2 as pb

    chat = pb.Chat(messages=[pb.ChatMessage(role=m["role"], content=m.get("content") or "",
                                            tool_call_id=m.get("tool_call_id", ""))
                             for m in messages])
    for tool in tools:
        f = tool["function"]
        chat.tools.add(type=tool["type"], function=pb.FunctionDefinition(
            name=f["name"], description=f.get("description", ""),
            parameters=json.dumps(f["parameters"]) if "parameters" in f else ""))
    if isinstance(tool_choice, str):
        chat.tool_choice.mode = tool_choice
    elif tool_choice is not None:
        chat.tool_choice.function_name = tool_choice["function"]["name"]
    if parallel is not None:
        chat.parallel_tool_calls = parallel
    return pb.GenerateRequest(chat=chat, sampling=pb.SamplingParams(**sampling))


def grpc_last(served, request) -> dict:
    """Per sample: its last GenerateResponse (the one with its finish reason)."""
    from jaxserve.entrypoints.grpc.client import JaxServeClient

    with JaxServeClient(served.grpc.address) as client:
        return {r.index: r for r in client.stub.Generate(request, timeout=600)
                if r.finish_reason}


def grpc_replies(served, request) -> dict[int, tuple[list, str]]:
    """Per sample: its calls [(name, arguments)] from its last message, and finish reason."""
    from jaxserve.entrypoints.grpc.convert import FINISH_REASON_NAMES

    return {i: ([(c.function.name, c.function.arguments) for c in r.tool_calls],
                FINISH_REASON_NAMES[r.finish_reason])
            for i, r in grpc_last(served, request).items()}


def test_grpc_chat_with_tools_makes_valid_named_and_required_calls(served):
    for choice, reason in ((named("create_event"), "stop"), ("required", "tool_calls")):
        request = grpc_chat(user(ASKS["create_event"]), choice, max_tokens=CALL_TOKENS,
                            temperature=1.0, seed=5, n=2)
        replies = grpc_replies(served, request)
        assert sorted(replies) == [0, 1], replies
        for index, (calls, finish) in replies.items():
            assert calls and finish == reason, (choice, replies)
            for name, arguments in calls:
                check_call(name, arguments, f"gRPC {choice} sample {index}")
    one = grpc_replies(served, grpc_chat(user(ASKS["add"]), "required", parallel=False,
                                         max_tokens=CALL_TOKENS, temperature=0.0))
    assert len(one[0][0]) == 1 and one[0][1] == "tool_calls", one


def test_grpc_bad_tool_input_is_invalid_argument_naming_the_field(served):
    import grpc

    from jaxserve.entrypoints.grpc.client import JaxServeClient

    bad_schema = {"type": "function", "function": {"name": "b", "parameters": {"type": "x"}}}
    cases = [
        (grpc_chat(user("Hi"), named("fly")), "chat.tool_choice"),
        (grpc_chat(user("Hi"), "required", tools=[]), "chat.tool_choice"),
        (grpc_chat(user("Hi"), "none", tools=[bad_schema]), "chat.tools[0].function.parameters"),
        (grpc_chat([ROUND_TRIP[0], {"role": "tool", "content": "1"}], "none"),
         "chat.messages[1].tool_call_id"),
    ]
    with JaxServeClient(served.grpc.address) as client:
        for request, field in cases:
            request.sampling.max_tokens = 4
            with pytest.raises(grpc.RpcError) as caught:
                list(client.stub.Generate(request, timeout=60))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
            assert field in caught.value.details(), (field, caught.value.details())
