"""Tool calling without a model: tool_choice plans and their refusals (openai/tools.py), the
schema of tool_choice "required" (a tool's $refs still resolve inside it), a chat choice's text
shaped into tool calls whole and streamed in any pieces (openai/tool_calls.py), the
conversation rules, tools and tool calls reaching a chat template (a conversation with tools,
calls and their results renders as transformers' apply_chat_template renders it, through Llama
4's template as the installed transformers ships it and the tests' ChatML one), and the
tool-calling flags.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.core.errors import RequestError
from jaxserve.entrypoints.openai.chat_prompt import render_chat
from jaxserve.entrypoints.openai.tool_calls import (CallArrayScanner, NamedCallOutput,
                                                    ParsedOutput, RequiredCallsOutput,
                                                    tool_parser_class)
from jaxserve.entrypoints.openai.chat_prompt import check_template_kwargs
from jaxserve.entrypoints.openai.tools import check_messages, plan_tools, required_schema
from tool_fixtures import FLAGS, SCHEMAS, TOOLS, named


def refusal(fn, *args, **kwargs) -> RequestError:
    with pytest.raises(RequestError) as caught:
        fn(*args, **kwargs)
    return caught.value


# ---- plans -------------------------------------------------------------------------------------
def test_tool_choice_plans_follow_openai_and_vllm():
    assert plan_tools(None, None).mode == "none"
    assert plan_tools(TOOLS, "none").template_tools == TOOLS  # tools still reach the template
    assert plan_tools(TOOLS, None, auto_tool_choice=True).mode == "auto"  # the default
    plan = plan_tools(TOOLS, named("add"))
    assert (plan.mode, plan.function_name, plan.enforced) == ("named", "add", True)
    assert plan.structured_outputs.json == SCHEMAS["add"]
    assert plan.constraint_field == "tools[1].function.parameters"
    plan = plan_tools(TOOLS, named("ping"))  # no parameters: an empty object
    assert plan.structured_outputs.json == SCHEMAS["ping"]
    plan = plan_tools(TOOLS, "required", parallel_tool_calls=False)
    assert plan.structured_outputs.json["maxItems"] == 1 and plan.constraint_field == "tools"
    assert "maxItems" not in plan_tools(TOOLS, "required").structured_outputs.json


@pytest.mark.parametrize("tools, choice, kwargs, field", [
    (TOOLS, named("fly"), {}, "tool_choice"),
    (None, "none", {}, "tool_choice"),
    ([], named("add"), {}, "tool_choice"),
    (TOOLS, "sometimes", {}, "tool_choice"),
    (TOOLS, None, {}, "tool_choice"),  # auto without the server's flags
    (TOOLS, "required", {"other_constraint": "response_format"}, "tool_choice"),
    ([{"type": "retrieval", "function": {"name": "r"}}], "none", {}, "tools[0].type"),
    ([{"type": "function", "function": {"name": ""}}], "none", {}, "tools[0].function.name"),
    ([TOOLS[0], TOOLS[0]], "none", {}, "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "strnig"}}}],
     "none", {}, "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/no"}}}],
     "none", {}, "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "none", {},
     "tools[0].function.parameters"),
])
def test_bad_tools_and_choices_are_refused_naming_the_field(tools, choice, kwargs, field):
    error = refusal(plan_tools, tools, choice, **kwargs)
    assert error.field == field and field.split("[")[0] in str(error), str(error)
    assert refusal(plan_tools, tools, choice, prefix="chat.", **kwargs).field == "chat." + field


def test_auto_is_refused_naming_the_flags_it_needs():
    message = str(refusal(plan_tools, TOOLS, "auto"))
    assert "--enable-auto-tool-choice" in message and "--tool-call-parser" in message


def test_the_required_schema_keeps_each_tools_refs_resolvable():
    schema = required_schema(TOOLS, parallel=True)
    good = [{"name": "set_flags", "parameters": {"flags": [{"name": "beta", "on": True}]}},
            {"name": "ping", "parameters": {}}]
    jsonschema.validate(good, schema)  # $ref "#/$defs/flag" was moved with its tool
    for bad in ([], [{"name": "set_flags", "parameters": {"flags": [{"name": "x", "on": 1}]}}],
                [{"name": "fly", "parameters": {}}], [{"parameters": {}, "name": "ping", "x": 1}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    from jaxserve.structured.compiler import check_json_schema
    check_json_schema(schema)  # and the grammar compiler resolves them too
    assert FLAGS["function"]["parameters"]["properties"]["flags"]["items"] == \
        {"$ref": "#/$defs/flag"}, "the request's own schema is left as it was"


# ---- replies -----------------------------------------------------------------------------------
def split(text: str, cuts: list[int]) -> list[str]:
    cuts = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def streamed(output, pieces: list[str]) -> list[tuple[str, str]]:
    """(name, arguments) per call from the first delta and those of feeding pieces one by
    one, then finishing."""
    calls: list[list[str]] = []
    deltas = [output.start()]
    for piece in pieces:
        deltas += output.feed(piece)
    for delta in deltas + output.finish():
        for call in delta.get("tool_calls", ()):
            if "id" in call:
                assert call["index"] == len(calls) and call["function"]["arguments"] == ""
                calls.append([call["function"]["name"], ""])
            calls[call["index"]][1] += call["function"]["arguments"]
    return [tuple(c) for c in calls]


ws = st.sampled_from(["", " ", "\n", "\n  "])
call_values = st.fixed_dictionaries({"name": st.sampled_from(list(SCHEMAS)),
                                     "parameters": st.recursive(
                                         st.none() | st.booleans() | st.integers() |
                                         st.text(max_size=6),
                                         lambda inner: st.lists(inner, max_size=3) |
                                         st.dictionaries(st.text(max_size=4), inner,
                                                         max_size=3), max_leaves=6)})


@settings(max_examples=200, deadline=None)
@given(calls=st.lists(call_values, min_size=1, max_size=3), gap=ws, swap=st.booleans(),
       cuts=st.lists(st.integers(0, 10_000), max_size=8))
def test_a_calls_array_in_any_pieces_gives_each_parameters_text_exactly(calls, gap, swap,
                                                                        cuts):
    def call_text(call):
        name = gap + json.dumps(call["name"]) + gap
        params = json.dumps(call["parameters"], indent=1 if gap else None)
        keys = [f'"name":{name}', f'"parameters":{gap}{params}']
        return "{" + gap + ("," + gap).join(reversed(keys) if swap else keys) + gap + "}"

    text = "[" + gap + ("," + gap).join(call_text(c) for c in calls) + gap + "]"
    want = [(c["name"], json.dumps(c["parameters"], indent=1 if gap else None)) for c in calls]
    whole = RequiredCallsOutput()
    whole.feed(text)
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in whole.message()[1]] == want
    assert streamed(RequiredCallsOutput(), split(text, cuts)) == want
    assert whole.finish_reason("stop") == "tool_calls" and whole.finish_reason("length") == \
        "length"


def test_a_scanner_cut_midway_keeps_the_calls_read_so_far():
    scanner = CallArrayScanner()
    scanner.feed('[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "pi')
    assert scanner.calls == [["add", '{"a": 1, "b": 2}'], [None, ""]]


def test_a_named_call_is_the_text_without_its_leading_whitespace():
    output = NamedCallOutput("add")
    assert output.start()["tool_calls"][0]["function"] == {"name": "add", "arguments": ""}
    pieces = ["\n ", " ", '{"a"', ': 1}']
    assert streamed(output, pieces) == [("add", '{"a": 1}')]
    assert output.message()[1][0]["function"]["arguments"] == '{"a": 1}'
    assert output.message()[0] is None and output.finish_reason("stop") == "stop"


def test_auto_replies_go_through_the_servers_parser_streamed_and_whole():
    parser = tool_parser_class("hermes")
    text = 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    whole = ParsedOutput(parser())
    whole.feed(text)
    content, calls = whole.message()
    assert content == "Sure." and [(c["function"]["name"], c["function"]["arguments"])
                                   for c in calls] == [("add", '{"a": 1, "b": 2}')]
    assert whole.finish_reason("stop") == "tool_calls"
    for cut in range(1, len(text)):
        assert streamed(ParsedOutput(parser()), [text[:cut], text[cut:]]) == \
            [("add", '{"a": 1, "b": 2}')]
    with pytest.raises(ValueError, match="tool_call_parser"):
        tool_parser_class("no-such-format")


def test_auto_without_parallel_calls_keeps_only_the_first_call():
    parser = tool_parser_class("hermes")
    text = "".join(f'<tool_call>\n{{"name": "{n}", "arguments": {{}}}}\n</tool_call>\n'
                   for n in ("ping", "add"))
    whole = ParsedOutput(parser(), single=True)
    whole.feed(text)
    assert [c["function"]["name"] for c in whole.message()[1]] == ["ping"]
    assert streamed(ParsedOutput(parser(), single=True), [text[:30], text[30:]]) == \
        [("ping", "{}")]
    assert streamed(ParsedOutput(parser()), [text]) == [("ping", "{}"), ("add", "{}")]


# ---- the conversation and the template ---------------------------------------------------------
CALL = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}


@pytest.mark.parametrize("messages, field", [
    ([{"role": "tool", "content": "1"}], "messages[0].tool_call_id"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "assistant"}], "messages[0].content"),
    ([{"role": "user", "content": "x", "tool_calls": [CALL]}], "messages[0].tool_calls"),
    ([{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "add",
                                                                 "arguments": "{"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
])
def test_conversation_tool_rules_name_the_field(messages, field):
    assert refusal(check_messages, messages).field == field
    check_messages([{"role": "assistant", "tool_calls": [CALL]},
                    {"role": "tool", "tool_call_id": "c1", "content": "2"}])


def test_template_kwargs_may_not_replace_the_servers_variables():
    assert check_template_kwargs({"enable_thinking": False}) == {"enable_thinking": False}
    assert refusal(check_template_kwargs, {"tools": []}).field == "chat_template_kwargs"


def test_tools_and_tool_calls_reach_the_template_as_dicts_and_no_tools_as_none():
    from model_fixtures import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = (
        "{{ tools is none }}|{% for m in messages %}{{ m.role }}:"
        "{% for c in m.tool_calls or [] %}{{ c.function.arguments.a }}{{ c.id }}{% endfor %}"
        "{{ m.tool_call_id or '' }}{{ m.content }};{% endfor %}{{ tools | tojson }}{{ x }}")
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "c1", "content": "2"}]
    text, _ = render_chat(tokenizer, messages, False, tools=TOOLS[:1],
                          chat_template_kwargs={"x": "!"})
    assert text == (f"False|user:hi;assistant:1c1;tool:c12;{json.dumps(TOOLS[:1])}!"), text
    text, _ = render_chat(tokenizer, messages[:1], False)
    assert text.startswith("True|"), text  # no tools: None, as transformers passes it


# An OpenAI conversation with tools: two calls (arguments as JSON text), their results, a reply.
TOOL_CONVERSATION = [
    {"role": "system", "content": "You call tools when they help."},
    {"role": "user", "content": "Add one and two, then tell me the weather in Oslo."},
    {"role": "assistant", "content": None, "tool_calls": [
        CALL, {"id": "c2", "type": "function",
               "function": {"name": "get_weather",
                            "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "3"},
    {"role": "tool", "tool_call_id": "c2", "content": "sunny, 4 degrees"},
    {"role": "assistant", "content": "It is 3; Oslo is sunny."},
    {"role": "user", "content": "Thanks!"}]


def as_transformers_documents_it(messages: list[dict]) -> list[dict]:
    """The same conversation in transformers' chat format: tool-call arguments as dicts, an
    assistant's absent content as an empty string."""
    out = []
    for m in messages:
        m = dict(m, content=m["content"] or "")
        if "tool_calls" in m:
            m["tool_calls"] = [dict(c, function=dict(c["function"], arguments=json.loads(
                c["function"]["arguments"]))) for c in m["tool_calls"]]
        out.append(m)
    return out


def tool_templates() -> dict[str, str]:
    """Chat templates that render tools, tool calls and tool results: Llama 4's, as the
    installed transformers ships it, and the tests' ChatML one (tool_chat_template.jinja)."""
    from tool_fixtures import TEMPLATE

    templates = {"chatml_tools": TEMPLATE}
    try:
        from transformers.models.llama4 import processing_llama4
    except ImportError:
        return templates
    return {"llama4": processing_llama4.chat_template, **templates}


@pytest.mark.parametrize("name", sorted(tool_templates()))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_a_conversation_with_tools_renders_as_transformers_apply_chat_template_renders_it(
        name, add_generation_prompt):
    transformers = pytest.importorskip("transformers")
    from model_fixtures import tiny_tokenizer

    ours = tiny_tokenizer()
    ours.chat_template = tool_templates()[name]
    theirs = transformers.PreTrainedTokenizerFast(
        tokenizer_object=ours.backend, bos_token=ours.backend.id_to_token(ours.bos_token_id),
        eos_token=ours.backend.id_to_token(ours.eos_token_ids[0]))
    tools = TOOLS[:3]
    text, _ = render_chat(ours, TOOL_CONVERSATION, add_generation_prompt, tools=tools)
    want = theirs.apply_chat_template(as_transformers_documents_it(TOOL_CONVERSATION),
                                      tools=tools, chat_template=ours.chat_template,
                                      add_generation_prompt=add_generation_prompt,
                                      tokenize=False)
    assert text == want, f"{name}: ours and transformers' prompts differ:\n{text}\n---\n{want}"
    for call in ("add", "get_weather", "sunny, 4 degrees", "Oslo"):
        assert call in text, f"{name}: {call!r} is missing from the prompt"


def test_a_template_failing_on_a_conversation_is_a_value_error_not_a_crash():
    from model_fixtures import tiny_tokenizer

    from jaxserve.model.text.tokenizer import ChatTemplateError

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = "{{ messages[0].content + 1 }}"
    with pytest.raises(ChatTemplateError, match="TypeError"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


# ---- settings ----------------------------------------------------------------------------------
def test_tool_call_flags_are_vllms_and_auto_needs_a_parser():
    from jaxserve.entrypoints.cli import build_parser
    from jaxserve.entrypoints.cli_flags import tool_call_settings_from_args

    parse = lambda *flags: tool_call_settings_from_args(build_parser().parse_args(
        ["serve", *flags]))
    settings = parse("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    assert settings.auto_parser == "hermes"
    assert parse().auto_parser is None and parse("--tool-call-parser", "hermes").auto_parser \
        is None
    with pytest.raises(ValueError, match="enable_auto_tool_choice"):
        parse("--enable-auto-tool-choice")
    assert "--tool-call-parser" in build_parser()._subparsers._group_actions[0].choices[
        "serve"].format_help()
