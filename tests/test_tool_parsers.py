"""Tool-call parsers on their model families' exact output formats: several calls per message,
arguments with braces, quotes, escapes and unicode, text before and after calls, calls cut off
by the length limit, malformed calls and replies without calls. Every case is checked
non-streamed, and streamed cut at every character boundary and in token-like random pieces:
the stream's deltas must rebuild the non-streamed message exactly."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from parser_streams import every_boundary, message_summary, stream_tool_parser, token_like

from jaxserve.entrypoints.openai.tool_parsers import (TOOL_PARSERS, ContentDelta, ToolCallDelta,
                                                      make_tool_parser, tool_parser_class)
from jaxserve.entrypoints.openai.tool_parsers.json_stream import dump_json

# Arguments with JSON's hard parts: braces and brackets inside strings, escaped quotes and
# backslashes, a closing tag inside a string, raw and escaped unicode (an escaped surrogate pair),
# nested containers, numbers written non-canonically.
TRICKY_JSON = (r'{"code": "if x: {\"a\": [1]}\n</tool_call> [TOOL_CALLS]", "path": "C:\\dir\\", '
               r'"city": "Zürich 東京", "emoji": "\ud83d\ude00 \u00e9", '
               r'"n": [1, -2.50, 1E2, true, false, null, {}, []], "nested": {"a": {"b": "}"}}}')
TRICKY = json.loads(TRICKY_JSON)
PY_TRICKY = (r'''code='if x:\n    print("}]")', s="quote \" and \\ backslash", u="Zürich 😀", '''
             r"""t='''tri'ple''', d={"k": [1, (2, 3)], "e": {}}, neg=-1.5, none=None""")
PY_TRICKY_ARGS = {"code": 'if x:\n    print("}]")', "s": 'quote " and \\ backslash',
                  "u": "Zürich 😀", "t": "tri'ple", "d": {"k": [1, [2, 3]], "e": {}},
                  "neg": -1.5, "none": None}
WEATHER = {"city": "Paris", "unit": "celsius"}


def case(parser, text, content, calls, id):
    return pytest.param(parser, text, content, calls, id=f"{parser}-{id}")


CASES = [
    # hermes: Qwen2.5 / Qwen3 / Hermes write a newline inside the tags
    case("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
         '"unit": "celsius"}}\n</tool_call>', None, [("get_weather", WEATHER, True)], "single"),
    case("hermes", "I'll check both.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
         '{"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
         '"arguments": {"tz": "CET"}}\n</tool_call>', "I'll check both.",
         [("get_weather", WEATHER, True), ("get_time", {"tz": "CET"}, True)], "text_then_two"),
    case("hermes", f'<tool_call>\n{{"name": "run", "arguments": {TRICKY_JSON}}}\n</tool_call>',
         None, [("run", TRICKY, True)], "tricky_arguments"),
    case("hermes", '<tool_call>{"name":"f","arguments":{"x":1,"y":[2,3]}}</tool_call>', None,
         [("f", {"x": 1, "y": [2, 3]}, True)], "compact"),
    case("hermes", '<tool_call>\n{"arguments": {"a": 1}, "id": 7, "name": "f"}\n</tool_call>',
         None, [("f", {"a": 1}, True)], "arguments_before_name"),
    case("hermes", '<tool_call>\n{"name": "ping"}\n</tool_call>', None, [("ping", {}, True)],
         "no_arguments"),
    case("hermes", '<tool_call>\n{"name": "a", "arguments": {}}\n<tool_call>\n{"name": "b", '
         '"arguments": {}}\n</tool_call>\nDone.', "Done.", [("a", {}, True), ("b", {}, True)],
         "missing_end_tag_then_text"),
    case("hermes", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
         "Sure.", [("get_weather", '{"city": "Par', False)], "truncated_in_arguments"),
    case("hermes", 'Sure.\n<tool_call>\n{"name": "get_we',
         'Sure.\n<tool_call>\n{"name": "get_we', [], "truncated_in_name"),
    case("hermes", 'A\n<tool_call>\n{"name": "f", "arguments": {"a": 1 2}}\n</tool_call>\nB',
         "AB", [("f", '{"a": 1', False)], "broken_after_name"),
    case("hermes", "x <tool_call>\nnot json\n</tool_call>\n", "x <tool_call>\nnot json\n"
         "</tool_call>\n", [], "block_that_is_not_json"),
    case("hermes", "The weather is nice.\n\nBye {not json} <tool <b>\n",
         "The weather is nice.\n\nBye {not json} <tool <b>\n", [], "no_call"),
    # llama3_json: Llama 3.x JSON tool calls, "parameters", ';' between calls
    case("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
         '"celsius"}}', None, [("get_weather", WEATHER, True)], "single"),
    case("llama3_json", '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": '
         '{"y": "z"}};{"name": "c", "arguments": {}}', None,
         [("a", {"x": 1}, True), ("b", {"y": "z"}, True), ("c", {}, True)], "three_calls"),
    case("llama3_json", f'<|python_tag|>{{"name": "run", "parameters": {TRICKY_JSON}}}', None,
         [("run", TRICKY, True)], "python_tag_tricky_arguments"),
    case("llama3_json", 'Let me search.<|python_tag|>{"name": "search", "parameters": '
         '{"q": "jax"}}', "Let me search.", [("search", {"q": "jax"}, True)], "text_then_tag"),
    case("llama3_json", '\n\n{"name": "f", "parameters": {"a": 1}}\nHope that helps.',
         "Hope that helps.", [("f", {"a": 1}, True)], "whitespace_then_call_then_text"),
    case("llama3_json", '{"name": "get_weather", "parameters": {"city": "Pa', None,
         [("get_weather", '{"city": "Pa', False)], "truncated_in_arguments"),
    case("llama3_json", '{"name": "get_weather", "param', '{"name": "get_weather", "param', [],
         "truncated_before_arguments"),
    case("llama3_json", '{"answer": 42, "name": "x"}', '{"answer": 42, "name": "x"}', [],
         "json_that_is_not_a_call"),
    case("llama3_json", 'Call: {"name": "f", "parameters": {}}', 'Call: {"name": "f", '
         '"parameters": {}}', [], "untagged_call_after_text_is_text"),
    case("llama3_json", "It is 12 degrees.", "It is 12 degrees.", [], "no_call"),
    # mistral: the array after [TOOL_CALLS] (tokenizers before v11) and name[ARGS]{...} (v11+)
    case("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3.5, "b": 4}}, {"name": '
         '"get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]', None,
         [("add", {"a": 3.5, "b": 4}, True), ("get_weather", WEATHER, True)], "v1_two_calls"),
    case("mistral", 'Hello[TOOL_CALLS] [{"name": "add", "arguments":{"a": 1, "b": 2}}]\nextra',
         "Helloextra", [("add", {"a": 1, "b": 2}, True)], "v1_text_around"),
    case("mistral", f'[TOOL_CALLS][{{"arguments": {TRICKY_JSON}, "name": "run"}}]', None,
         [("run", TRICKY, True)], "v1_tricky_arguments_before_name"),
    case("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3', None,
         [("add", '{"a": ', False)], "v1_truncated"),
    case("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}', None,
         [("get_weather", WEATHER, True)], "v11_single"),
    case("mistral", 'Let me compute.[TOOL_CALLS]add[ARGS]{"a": 3.5, "b": 4}[TOOL_CALLS]'
         'multiply[CALL_ID]a1b2C3d4e[ARGS]{"a": 3, "b": 6}[TOOL_CALLS]noop{}',
         "Let me compute.", [("add", {"a": 3.5, "b": 4}, True),
                             ("multiply", {"a": 3, "b": 6}, True), ("noop", {}, True)],
         "v11_three_calls"),
    case("mistral", f"[TOOL_CALLS]run[ARGS]{TRICKY_JSON}", None, [("run", TRICKY, True)],
         "v11_tricky_arguments"),
    case("mistral", 'hi{hi[TOOL_CALLS]bash[ARGS]{"command": "print(\\"hello\\")\\nre.comp',
         "hi{hi", [("bash", '{"command": "print(\\"hello\\")\\nre.comp', False)],
         "v11_truncated"),
    case("mistral", "[TOOL_CALLS]get_wea", "get_wea", [], "v11_truncated_in_name"),
    case("mistral", "[TOOL_CALLS] not json at all", " not json at all", [], "not_a_call"),
    case("mistral", "This is a test [TOOLS] [x]", "This is a test [TOOLS] [x]", [], "no_call"),
    # pythonic: a Python list of calls with literal keyword arguments
    case("pythonic", '[get_weather(city="Paris", unit="celsius")]', None,
         [("get_weather", WEATHER, True)], "single"),
    case("pythonic", '[register(name="John Doe", age=37, address={"city": "SF"}, role=None, '
         'ok=True, tags=["a", "b"]), get_time(), ping(n=1,)]', None,
         [("register", {"name": "John Doe", "age": 37, "address": {"city": "SF"}, "role": None,
                        "ok": True, "tags": ["a", "b"]}, True),
          ("get_time", {}, True), ("ping", {"n": 1}, True)], "three_calls"),
    case("pythonic", f"[run({PY_TRICKY})]", None, [("run", PY_TRICKY_ARGS, True)],
         "tricky_arguments"),
    case("pythonic", "[f(a=2.50, b=1e3, c=-0, d=0x10)]\nDone.", "Done.",
         [("f", {"a": 2.5, "b": 1000.0, "c": 0, "d": 16}, True)], "numbers_then_text"),
    case("pythonic", '[get_weather(city="Paris", unit="cel', None,
         [("get_weather", '{"city": "Paris"', False)], "truncated"),
    case("pythonic", '[get_weather(cit', '[get_weather(cit', [], "truncated_before_a_value"),
    case("pythonic", "[f(x=y)]", "[f(x=y)]", [], "not_a_literal"),
    case("pythonic", "[f(a=1, a=2)] x", None, [("f", '{"a": 1', False)],
         "repeated_keyword_breaks_the_call"),
    case("pythonic", 'Sure: [get_weather(city="Paris")]', 'Sure: [get_weather(city="Paris")]',
         [], "text_before_is_text"),
    case("pythonic", "[1, 2] are numbers.", "[1, 2] are numbers.", [], "no_call"),
]


def _expected(content, calls):
    return content, [(name, args if isinstance(args, str) else dump_json(args), complete)
                     for name, args, complete in calls]


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_extract(parser, text, content, calls):
    message = make_tool_parser(parser).extract(text)
    assert message_summary(message) == _expected(content, calls)
    for call, (_, args, complete) in zip(message.tool_calls, calls):
        assert call.type == "function"
        if complete:
            parsed = json.loads(call.arguments)
            assert parsed == args and call.arguments == json.dumps(parsed, ensure_ascii=False), (
                f"arguments are not json.dumps of the parsed object: {call.arguments!r}")


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_stream_cut_at_every_boundary_matches_extract(parser, text, content, calls):
    expected = _expected(content, calls)
    for how, pieces in every_boundary(text):
        tool_parser = make_tool_parser(parser)
        streamed_content, streamed_calls = stream_tool_parser(tool_parser, pieces)
        result = tool_parser.result()
        assert message_summary(result) == expected, f"{how}: result() differs"
        assert streamed_content == expected[0], f"{how}: streamed content differs"
        assert [[c.id, c.name, c.arguments] for c in result.tool_calls] == streamed_calls, (
            f"{how}: the deltas do not rebuild the calls")


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_stream_token_like_pieces_matches_extract(parser, text, content, calls):
    expected = _expected(content, calls)
    for seed in range(25):
        tool_parser = make_tool_parser(parser)
        streamed_content, streamed_calls = stream_tool_parser(tool_parser, token_like(text, seed))
        assert (streamed_content, [(n, a) for _, n, a in streamed_calls]) == (
            expected[0], [(n, a) for n, a, _ in expected[1]]), f"seed {seed}"


# Pieces of every format, glued at random: markers, tags, JSON and Python tokens, escapes, text.
FRAGMENTS = ["<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "{", "}",
             "[", "]", "(", ")", '"name"', '"arguments"', '"parameters"', ":", ",", ";", " ",
             "\n", '"f"', r'"x\"y"', "1", "2.5", "true", "null", "f", "=", "'s'", '"', "'", "\\",
             r"\u00e9", r"\ud83d", "é", "😀", "hello", "<",
             '{"name": "f", "arguments": {"a": 1}}', '{"name": "g", "parameters": {}}', "f(a=1)",
             "g(b='x')", "'" * 3]


@settings(max_examples=150, deadline=None)
@given(parts=st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=14),
       seed=st.integers(0, 2**16))
def test_any_mix_of_format_pieces_streams_as_it_extracts(parts, seed):
    text = "".join(parts)
    for name, cls in TOOL_PARSERS.items():
        expected = make_tool_parser(name).extract(text)
        parser = make_tool_parser(name)
        content, calls = stream_tool_parser(parser, token_like(text, seed))
        assert message_summary(parser.result()) == message_summary(expected), name
        assert (content, [(n, a) for _, n, a in calls]) == (
            expected.content, [(c.name, c.arguments) for c in expected.tool_calls]), name
        if not expected.tool_calls and not cls.needs_special_tokens:
            assert expected.content == (text or None), f"{name}: a reply without calls changed"


def test_arguments_stream_before_the_call_ends():
    parser = make_tool_parser("hermes")
    deltas = parser.feed('Hi <tool_call>\n{"name": "write", "arguments": {"text": "once upon')
    assert deltas == [ContentDelta("Hi"), ToolCallDelta(
        index=0, id=deltas[1].id, type="function", name="write",
        arguments='{"text": "once upon')]
    assert parser.feed(' a time"}}') == [ToolCallDelta(index=0, arguments=' a time"}')]
    assert parser.feed("\n</tool_call>") == [] and parser.finish() == []


def test_content_is_held_only_while_it_may_be_a_marker():
    parser = make_tool_parser("hermes")
    assert parser.feed("a <b> <tool") == [ContentDelta("a <b>")]
    assert parser.feed("kit>") == [ContentDelta(" <toolkit>")]
    parser = make_tool_parser("mistral")
    assert parser.feed("x [TOOL") == [ContentDelta("x")]
    assert parser.finish() == [ContentDelta(" [TOOL")]


def test_call_ids_are_openai_style_except_mistral():
    for name in TOOL_PARSERS:
        text = {"hermes": '<tool_call>{"name": "f", "arguments": {}}</tool_call>' * 2,
                "mistral": "[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS]f[ARGS]{}",
                "pythonic": "[f(), f()]"}.get(name, '{"name": "f", "parameters": {}}; ' * 2)
        ids = [c.id for c in make_tool_parser(name).extract(text).tool_calls]
        assert len(ids) == 2 and ids[0] != ids[1], f"{name}: {ids}"
        # Mistral's templates refuse any id but 9 letters and digits
        pattern = r"[A-Za-z0-9]{9}" if name == "mistral" else r"call_[0-9a-f]{24}"
        assert all(re.fullmatch(pattern, i) for i in ids), f"{name}: {ids}"


def test_parsers_that_read_control_tokens_say_so():
    needs = {name for name, cls in TOOL_PARSERS.items() if cls.needs_special_tokens}
    assert needs == {"mistral", "llama3_json", "llama4_json"}


def test_unknown_parser_name_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"tool_call_parser: unknown parser 'hermes2'.*"
                                         r"hermes, llama3_json, llama4_json, mistral, pythonic"):
        tool_parser_class("hermes2")


def test_a_parser_serves_one_response():
    parser = make_tool_parser("hermes")
    parser.feed("hello")
    with pytest.raises(RuntimeError, match="fresh parser"):
        parser.extract("again")
    parser.finish()
    with pytest.raises(RuntimeError, match="one response"):
        parser.feed("more")
    assert parser.finish() == [], "a second finish() emits nothing"


def test_has_tool_calls_follows_the_stream():
    parser = make_tool_parser("llama3_json")
    parser.feed('{"name": "f", "par')
    assert not parser.has_tool_calls
    parser.feed('ameters": {')
    assert parser.has_tool_calls


def test_importing_the_parsers_loads_no_server_framework_or_jax():
    code = ("import sys; import jaxserve.entrypoints.openai.tool_parsers, "
            "jaxserve.entrypoints.openai.reasoning_parsers; "
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('jax', 'jaxlib', 'fastapi', 'starlette', 'pydantic', 'grpc', 'numpy')); "
            "assert not heavy, heavy")
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
