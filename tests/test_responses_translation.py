"""The Responses API's translation, without a server: a Responses request as the chat request
that serves it (messages, tools, tool choice, text.format), chat field names as the Responses
ones, chat deltas as output items and stream events (OutputAssembler), and the streamed event
sequence over a chat stream (reasoning deltas, an error after the stream began).
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from jaxserve.entrypoints.openai.errors import OpenAIError
from jaxserve.entrypoints.openai.responses import _events
from jaxserve.entrypoints.openai.responses_output import OutputAssembler
from jaxserve.entrypoints.openai.responses_protocol import (RESPONSES_ACCEPTED_WITHOUT_EFFECT,
                                                          FunctionTool, ResponsesRequest,
                                                          TextConfig)
from jaxserve.entrypoints.openai.responses_request import FieldNames, chat_request

TOOL = {"type": "function", "name": "f", "description": "d",
        "parameters": {"type": "object", "properties": {}}}


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields})


# ---- the chat request ----------------------------------------------------------------------
def test_instructions_come_first_and_a_string_input_is_one_user_message():
    chat, names = chat_request(request(instructions="be brief", max_output_tokens=5,
                                       temperature=0.5, top_p=0.9))
    assert [(m.role, m.content) for m in chat.messages] == [("system", "be brief"),
                                                            ("user", "hi")]
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p) == (5, 0.5, 0.9)
    assert names.rename("messages[0]") == "instructions"
    assert names.rename("messages[1].content") == "input.content"


def test_function_calls_join_the_assistant_message_before_them_and_outputs_are_tool_messages():
    items = [{"role": "user", "content": "go"},
             {"role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{\"a\": 1}"},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "function_call_output", "call_id": "c2", "output": "two"},
             {"type": "function_call_output", "call_id": "c1",
              "output": [{"type": "input_text", "text": "one"}]},
             {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"}]
    chat, names = chat_request(request(input=items, tools=[TOOL]))
    shown = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert [m["role"] for m in shown] == ["user", "assistant", "tool", "tool", "assistant"]
    assert [c["id"] for c in shown[1]["tool_calls"]] == ["c1", "c2"]
    assert shown[1]["content"] == [{"type": "text", "text": "ok"}]
    assert (shown[2]["tool_call_id"], shown[2]["content"]) == ("c2", "two")
    assert shown[4].get("content") is None and shown[4]["tool_calls"][0]["id"] == "c3"
    assert names.rename("messages[1].tool_calls[1].function.arguments") == "input[3].arguments"
    assert names.rename("messages[3].tool_call_id") == "input[6].tool_call_id"
    assert names.rename("messages[4].tool_calls[0].function.name") == "input[7].name"


def test_tools_and_tool_choice_take_the_chat_shapes():
    chat, _ = chat_request(request(tools=[TOOL], tool_choice={"type": "function", "name": "f"},
                                   parallel_tool_calls=False))
    assert [t.model_dump(exclude_none=True) for t in chat.tools] == [
        {"type": "function", "function": {"name": "f", "description": "d",
                                          "parameters": TOOL["parameters"]}}]
    assert chat.tool_choice.model_dump() == {"type": "function", "function": {"name": "f"}}
    assert chat.parallel_tool_calls is False
    chat, _ = chat_request(request(tool_choice="auto"))  # no tools: nothing to choose from
    assert chat.tools is None and chat.tool_choice is None


def test_text_format_becomes_response_format():
    schema = {"type": "object"}
    chat, _ = chat_request(request(text={"format": {"type": "json_schema", "name": "n",
                                                    "schema": schema, "strict": True}}))
    assert chat.response_format.model_dump(by_alias=True, exclude_none=True) == {
        "type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}
    assert chat_request(request(text={"format": {"type": "json_object"}}))[0] \
        .response_format.type == "json_object"
    assert chat_request(request(text={"format": {"type": "text"}}))[0].response_format is None


def test_a_stream_asks_the_chat_path_for_its_usage():
    chat, _ = chat_request(request(stream=True))
    assert chat.stream and chat.stream_options.include_usage


@pytest.mark.parametrize("fields,param", [
    ({"input": [{"type": "function_call_output", "call_id": "x", "output": "o"}]},
     "input[0].call_id"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
    ({"input": [{"type": "reasoning"}]}, "input"),
])
def test_what_the_chat_request_cannot_say_is_a_400_naming_the_field(fields, param):
    with pytest.raises(OpenAIError) as caught:
        chat_request(request(**fields))
    assert (caught.value.status, caught.value.param) == (400, param), caught.value.message


def test_chat_field_names_in_an_error_become_the_responses_names():
    names = FieldNames()
    names.sources += [("instructions", []), ("input[0]", [])]
    error = names.renamed(OpenAIError(400, "max_completion_tokens=9 is too large: the prompt "
                                           "(messages) ...", "max_completion_tokens"))
    assert (error.param, error.message) == (
        "max_output_tokens", "max_output_tokens=9 is too large: the prompt (input) ...")
    assert names.rename("response_format.json_schema.schema") == "text.format.schema"
    assert names.rename("tools[2].function.parameters") == "tools[2].parameters"
    assert names.rename("messages_total") == "messages_total"


def test_every_field_accepted_without_effect_is_declared_and_documented():
    from pathlib import Path

    docs = (Path(__file__).resolve().parent.parent / "docs" / "openai_api.md").read_text()
    section = docs[docs.index("## Responses API"):]
    section = section[section.index("Accepted without effect"):]
    models = {"": ResponsesRequest, "text": TextConfig, "tools": FunctionTool}
    for path in RESPONSES_ACCEPTED_WITHOUT_EFFECT:
        parent, _, name = path.rpartition(".")
        assert name in models[parent].model_fields, path
        assert f"`{path}" in section or f"`{name}" in section, f"{path} is not in the docs"


# ---- output items --------------------------------------------------------------------------
def kinds(events) -> list[str]:
    return [e["type"].removeprefix("response.") for e in events]


def test_reasoning_then_text_then_calls_become_items_in_order_each_closed_by_the_next():
    out = OutputAssembler()
    events = out.feed({"role": "assistant", "reasoning_content": "think"})
    events += out.feed({"reasoning_content": "ing"})
    events += out.feed({"content": "Hi"})
    events += out.feed({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                        "function": {"name": "f", "arguments": ""}}]})
    events += out.feed({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]})
    events += out.finish("stop")
    assert kinds(events) == [
        "output_item.added", "content_part.added", "reasoning_text.delta",
        "reasoning_text.delta", "reasoning_text.done", "content_part.done", "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta", "output_text.done",
        "content_part.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.done",
        "output_item.done"]
    assert [(i["type"], i["status"]) for i in out.items] == [
        ("reasoning", "completed"), ("message", "completed"), ("function_call", "completed")]
    assert out.items[0]["content"] == [{"type": "reasoning_text", "text": "thinking"}]
    assert out.items[2]["call_id"] == "call_a" and out.items[2]["arguments"] == "{}"
    assert out.reasoning_text == "thinking"
    assert [e["output_index"] for e in events if "output_index" in e] == \
        [0] * 7 + [1] * 6 + [2] * 4


def test_whitespace_before_a_call_is_dropped_and_whitespace_alone_is_the_message():
    out = OutputAssembler()
    assert out.feed({"content": "\n\n"}) == []
    out.feed({"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f",
                                                                  "arguments": "{}"}}]})
    out.feed({"content": "\n"})
    out.finish("tool_calls")
    assert [i["type"] for i in out.items] == ["function_call"]
    alone = OutputAssembler()
    alone.feed({"content": " "})
    alone.feed({"content": "\n"})
    alone.finish("stop")
    assert [(i["type"], i["content"][0]["text"]) for i in alone.items] == [("message", " \n")]


def test_a_reply_cut_at_its_limit_leaves_its_last_item_incomplete_and_no_reply_is_an_empty_one():
    out = OutputAssembler()
    out.feed({"reasoning_content": "a"})
    out.feed({"content": "b"})
    out.finish("length")
    assert [i["status"] for i in out.items] == ["completed", "incomplete"]
    empty = OutputAssembler()
    assert kinds(empty.finish("stop")) == ["output_item.added", "content_part.added",
                                           "output_text.done", "content_part.done",
                                           "output_item.done"]
    assert empty.items[0]["content"][0]["text"] == ""


def test_arguments_for_a_call_that_is_no_longer_written_are_an_error():
    out = OutputAssembler()
    out.feed({"tool_calls": [{"index": 0, "id": "a", "function": {"name": "f"}}]})
    out.feed({"content": "text"})
    with pytest.raises(RuntimeError, match="tool call 0"):
        out.feed({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]})


def test_a_reply_fed_whole_gives_the_items_it_gives_in_pieces():
    pieces = [{"reasoning_content": "r1"}, {"reasoning_content": "r2"}, {"content": " "},
              {"content": "t1"}, {"content": "t2"}]
    streamed, whole = OutputAssembler(), OutputAssembler()
    for delta in pieces:
        streamed.feed(delta)
    streamed.finish("stop")
    whole.feed({"reasoning_content": "r1r2", "content": " t1t2"})
    whole.finish("stop")
    strip = [{k: v for k, v in i.items() if k != "id"} for i in streamed.items]
    assert strip == [{k: v for k, v in i.items() if k != "id"} for i in whole.items]


# ---- the stream ----------------------------------------------------------------------------
class FakeChatStream:
    """A chat EventStream's SSE strings."""

    def __init__(self, chunks):
        self.chunks, self.closed = chunks, False

    async def _events(self):
        for chunk in self.chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    def __aiter__(self):
        return self._events()

    async def aclose(self):
        self.closed = True


def run_events(chunks, tokenizer=None) -> list[dict]:
    from model_fixtures import tiny_tokenizer

    serving = SimpleNamespace(tokenizer=tokenizer or tiny_tokenizer())
    header = {"id": "resp_1", "object": "response", "created_at": 0, "model": "m"}

    async def collect():
        return [event async for event in _events(serving, header, FakeChatStream(chunks),
                                                 FieldNames())]

    texts = asyncio.run(collect())
    events = []
    for text in texts:
        kind_line, data_line = text.rstrip("\n").split("\n")
        event = json.loads(data_line.removeprefix("data: "))
        assert kind_line == f"event: {event['type']}"
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def delta(**fields) -> dict:
    return {"choices": [{"index": 0, "delta": fields, "finish_reason": None}]}


def test_a_streamed_reasoning_reply_counts_its_reasoning_tokens():
    from model_fixtures import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    usage = {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12,
             "prompt_tokens_details": {"cached_tokens": 2}}
    events = run_events([delta(role="assistant", content=""), delta(reasoning_content="the "),
                         delta(reasoning_content="cat"), delta(content="ok"),
                         {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                         {"choices": [], "usage": usage}], tokenizer)
    assert kinds(events)[:3] == ["created", "in_progress", "output_item.added"]
    assert [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"] == \
        ["the ", "cat"]
    final = events[-1]
    assert final["type"] == "response.completed"
    assert [i["type"] for i in final["response"]["output"]] == ["reasoning", "message"]
    assert final["response"]["usage"] == {
        "input_tokens": 3, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 9,
        "output_tokens_details": {"reasoning_tokens": len(tokenizer.encode(
            "the cat", add_special_tokens=False))}, "total_tokens": 12}


def test_an_error_after_the_stream_began_is_an_error_event_then_response_failed():
    error = {"error": {"message": "the request failed in the engine", "type": "internal_error",
                       "param": None, "code": 500}}
    events = run_events([delta(role="assistant", content=""), delta(content="par"), error])
    assert kinds(events)[-2:] == ["error", "failed"]
    assert events[-2]["code"] == "internal_error" and "failed" in events[-2]["message"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert failed["output"][0]["content"][0]["text"] == "par"
