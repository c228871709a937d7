"""Tool calling on /v1/chat/completions with the real default model (SmolLM2-135M-Instruct)
and a ChatML template with tools (tests/tool_chat_template.jinja), tool_choice none, required
and named (the server has no auto tool choice: test_tools_auto_grpc.py serves that, and gRPC):

* tool_choice named and "required", greedy and sampled, over six tool schemas
  (tool_fixtures.py): every call's arguments parse and validate against its tool's schema;
  a named choice finishes "stop", "required" finishes "tool_calls"; parallel_tool_calls=false
  makes exactly one call;
* the same greedy request streamed: its argument deltas concatenate to the non-streamed
  arguments;
* tool_choice "none" answers text; an assistant tool_calls + tool message round trip renders
  (tool calls' arguments reach the template as dicts) and answers; chat_template_kwargs reach
  the template;
* bad input is a 400 naming the field, and the server keeps serving with every KV page free
  afterwards;
* the official openai client drives tools, plain and streamed.

One engine serves the whole module (tool_fixtures.serve_tools).
"""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from tool_fixtures import (ASKS, CALL_TOKENS, ROUND_TRIP, SCHEMAS, TOOLS, chat,  # noqa: E402
                           all_pages_free, chat_ok, chat_stream, check_call, check_choice_calls,
                           named, serve_tools, streamed_calls, user)


@pytest.fixture(scope="module")
def served():
    yield from serve_tools()


# ---- enforced tool choices ---------------------------------------------------------------
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_a_named_choice_calls_that_function_with_valid_arguments_greedy_and_sampled(served,
                                                                                     name):
    for sampling in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 7, "n": 2}):
        body = {"messages": user(ASKS[name]), "tools": TOOLS, "tool_choice": named(name),
                "max_tokens": CALL_TOKENS, **sampling}
        for choice in chat_ok(served, body)["choices"]:
            where = f"{name} {sampling} choice {choice['index']}"
            calls = check_choice_calls(choice, where)
            assert [c["function"]["name"] for c in calls] == [name], where
            assert choice["finish_reason"] == "stop", where  # as OpenAI for a forced function


@pytest.mark.parametrize("ask", ["create_event", "set_flags", "quote", "ping"])
def test_required_makes_calls_that_each_validate_against_their_tool(served, ask):
    body = {"messages": user(ASKS[ask]), "tools": TOOLS, "tool_choice": "required",
            "max_tokens": CALL_TOKENS, "temperature": 0.0}
    choice = chat_ok(served, body)["choices"][0]
    check_choice_calls(choice, f"required, asked for {ask}")
    assert choice["finish_reason"] == "tool_calls", choice


def test_required_calls_cut_by_max_tokens_keep_their_complete_calls_valid(served):
    """Greedy, this model repeats the same call until max_tokens (any number of calls is
    allowed with parallel_tool_calls): the finish says length and every call before the
    last (which the cut may leave unfinished) validates."""
    body = {"messages": user(ASKS["get_weather"]), "tools": TOOLS, "tool_choice": "required",
            "max_tokens": 60, "temperature": 0.0}
    choice = chat_ok(served, body)["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "length" and len(calls) >= 2, choice
    for call in calls[:-1]:
        check_call(call["function"]["name"], call["function"]["arguments"], "a complete call")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_without_parallel_calls_makes_exactly_one_valid_call_when_sampled(served,
                                                                                   seed):
    body = {"messages": user(ASKS["add"] + " " + ASKS["get_weather"]), "tools": TOOLS,
            "tool_choice": "required", "parallel_tool_calls": False,
            "max_tokens": CALL_TOKENS, "temperature": 1.0, "seed": seed}
    choice = chat_ok(served, body)["choices"][0]
    calls = check_choice_calls(choice, f"required, seed {seed}")
    assert len(calls) == 1 and choice["finish_reason"] == "tool_calls", choice


@pytest.mark.parametrize("tool_choice", [named("create_event"), "required"])
def test_streamed_argument_deltas_concatenate_to_the_non_streamed_arguments(served,
                                                                           tool_choice):
    body = {"messages": user(ASKS["create_event"]), "tools": TOOLS,
            "tool_choice": tool_choice, "max_tokens": CALL_TOKENS, "temperature": 0.0}
    whole = chat_ok(served, body)["choices"][0]
    chunks = chat_stream(served, body)
    calls, content, reasons = streamed_calls(chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [(c["name"], c["arguments"]) for c in calls[0]] == \
        [(c["function"]["name"], c["function"]["arguments"])
         for c in whole["message"]["tool_calls"]]
    assert content.get(0) is None and reasons[0] == whole["finish_reason"]
    assert len({c["id"] for c in calls[0]}) == len(calls[0])


# ---- none, round trips, template variables --------------------------------------------------
def test_tool_choice_none_answers_text_without_calls(served):
    body = {"messages": user(ASKS["get_weather"]), "tools": TOOLS, "tool_choice": "none",
            "max_tokens": 16, "temperature": 0.0}
    choice = chat_ok(served, body)["choices"][0]
    assert choice["message"]["content"] and choice["message"].get("tool_calls") is None, choice
    assert choice["finish_reason"] in ("stop", "length")


def rendered(served, body: dict) -> str:
    r = httpx.post(served.url + "/tokenize", json={"model": served.model, **body}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(served.url + "/detokenize", json={"model": served.model,
                                                      "tokens": r.json()["tokens"]})
    return r.json()["prompt"]


def test_a_tool_call_and_its_answer_render_through_the_template_and_get_a_reply(served):
    text = rendered(served, {"messages": ROUND_TRIP, "tools": TOOLS})
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
            '"celsius"}}\n</tool_call>') in text, text
    assert '<tool_response id="call_1">\n{"temperature": 21}\n</tool_response>' in text, text
    assert json.dumps(TOOLS[0]["function"]["parameters"]) in text  # the tools reach it too
    for tool_choice in ("none", named("get_weather")):
        body = {"messages": ROUND_TRIP, "tools": TOOLS, "tool_choice": tool_choice,
                "max_tokens": CALL_TOKENS, "temperature": 0.0}
        choice = chat_ok(served, body)["choices"][0]
        if tool_choice == "none":
            assert choice["message"]["content"], choice
        else:
            check_choice_calls(choice, "named after a round trip")


def test_chat_template_kwargs_reach_the_template(served):
    body = {"messages": user("Hi"), "chat_template_kwargs": {"enable_thinking": False}}
    # (/detokenize drops the special tokens: "<|im_start|>assistant" reads "assistant")
    assert rendered(served, body).endswith("\nassistant\n<think>\n\n</think>\n\n")
    assert rendered(served, {"messages": user("Hi")}).endswith("\nHi\nassistant\n")
    r = chat(served, {"messages": user("Hi"), "max_tokens": 2,
                      "chat_template_kwargs": {"messages": []}})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "chat_template_kwargs"), r.text


# ---- bad input -------------------------------------------------------------------------------
BAD_TOOL = {"type": "function", "function": {"name": "bad", "parameters": {
    "type": "object", "properties": {"x": {"type": "strnig"}}}}}
BAD = [
    ({"tools": TOOLS, "tool_choice": named("fly")}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": named("add")}, "tool_choice"),
    ({"tools": [TOOLS[0], {"type": "retrieval", "function": {"name": "r"}}]}, "tools[1].type"),
    ({"tools": [BAD_TOOL], "tool_choice": "none"}, "tools[0].function.parameters"),
    ({"tools": [TOOLS[1], TOOLS[1]], "tool_choice": "required"}, "tools[1].function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": named("add"), "guided_regex": "a+"}, "tool_choice"),
    ({"tools": TOOLS}, "tool_choice"),  # auto (the default) without the server's flags
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    ({"messages": [ROUND_TRIP[0], ROUND_TRIP[1], {"role": "tool", "content": "21"}]},
     "messages[2].tool_call_id"),
    ({"messages": [ROUND_TRIP[0], {**ROUND_TRIP[1], "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{1"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": ROUND_TRIP[1]["tool_calls"]}]},
     "messages[0].tool_calls"),
]


def test_bad_tool_input_is_a_400_naming_the_field_and_the_server_keeps_serving(served):
    for extra, param in BAD:
        body = {"messages": user("Hi"), "max_tokens": 4, **extra}
        for stream in (False, True):
            r = chat(served, {**body, "stream": stream})
            assert r.status_code == 400, (extra, r.text)
            assert r.json()["error"]["param"] == param, (extra, r.text)
    ok = chat_ok(served, {"messages": user("Hi"), "max_tokens": CALL_TOKENS, "tools": TOOLS,
                          "tool_choice": named("ping"), "temperature": 0.0})
    check_choice_calls(ok["choices"][0], "after the bad requests")
    assert all_pages_free(served), "a KV page leaked"


# ---- the official openai client --------------------------------------------------------------
def test_the_openai_client_drives_tools_plain_and_streamed(served):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)
    kwargs = dict(model=served.model, messages=user(ASKS["quote"]), tools=TOOLS,
                  max_tokens=CALL_TOKENS, temperature=0.0)
    for tool_choice in (named("quote"), "required"):
        r = client.chat.completions.create(tool_choice=tool_choice, **kwargs)
        message = r.choices[0].message
        assert message.content is None and message.tool_calls, message
        for call in message.tool_calls:
            check_call(call.function.name, call.function.arguments, f"openai {tool_choice}")
        streamed: dict[int, list[str]] = {}
        reason = None
        for chunk in client.chat.completions.create(tool_choice=tool_choice, stream=True,
                                                    **kwargs):
            for delta_call in chunk.choices[0].delta.tool_calls or ():
                parts = streamed.setdefault(delta_call.index, [])
                if delta_call.id is not None:
                    parts.append(delta_call.function.name)
                    parts.append("")
                parts[1] += delta_call.function.arguments or ""
            reason = chunk.choices[0].finish_reason or reason
        assert [tuple(streamed[i]) for i in sorted(streamed)] == \
            [(c.function.name, c.function.arguments) for c in message.tool_calls]
        assert reason == r.choices[0].finish_reason == \
            ("stop" if tool_choice != "required" else "tool_calls")
    r = client.chat.completions.create(tool_choice="none", **{**kwargs, "max_tokens": 8})
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(tool_choice=named("nope"), **kwargs)
    assert caught.value.body["param"] == "tool_choice"
