"""Reasoning parsers on DeepSeek R1's and Qwen3's exact output: with and without the opening
<think>, cut off inside the reasoning, thinking turned off, tags split across stream pieces.
Every case is checked non-streamed and streamed cut at every character boundary and in
token-like pieces; `reasoning_ended` turns true exactly when the content section starts."""

from __future__ import annotations

import pytest
from parser_streams import every_boundary, message_summary, stream_tool_parser, token_like

from jaxserve.entrypoints.openai.reasoning_parsers import (REASONING_PARSERS, ParsedReasoning,
                                                           ReasoningDelta, make_reasoning_parser,
                                                           reasoning_parser_class)
from jaxserve.entrypoints.openai.tool_parsers import make_tool_parser

OFF = {"enable_thinking": False}


def case(parser, text, reasoning, content, id, kwargs=None):
    return pytest.param(parser, kwargs, text, reasoning, content, id=f"{parser}-{id}")


CASES = [
    case("deepseek_r1", "Okay, 2 + 2.\nThat is 4.\n</think>\n\nThe answer is **4**.",
         "Okay, 2 + 2.\nThat is 4.", "The answer is **4**.", "template_opened_think"),
    case("deepseek_r1", "<think>\nOkay.\n</think>\n\nFour.", "Okay.", "Four.", "opening_tag"),
    case("deepseek_r1", "\n<think>x</think>y", "x", "y", "whitespace_before_opening_tag"),
    case("deepseek_r1", "Let me think about <think> tags and 3 < 4 </thin", "Let me think about "
         "<think> tags and 3 < 4 </thin", None, "cut_off_inside_reasoning"),
    case("deepseek_r1", "Hmm.</think>", "Hmm.", None, "no_content"),
    case("deepseek_r1", "</think>Just the answer, 東京 😀 </think> again.", None,
         "Just the answer, 東京 😀 </think> again.", "empty_reasoning"),
    case("deepseek_r1", "plain", "plain", None, "no_tags_is_reasoning"),
    case("deepseek_r1", "Answer.", "Answer.", None, "chat_template_kwargs_ignored", OFF),
    case("qwen3", "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?",
         "The user greets me.", "Hello! How can I help?", "thinking"),
    case("qwen3", "<think>\n\n</think>\n\nHello!", None, "Hello!", "empty_think_block"),
    case("qwen3", "Hello! </think> <think>\n", None, "Hello! </think> <think>\n",
         "no_opening_tag_is_content"),
    case("qwen3", "  \n<thin", None, "  \n<thin", "partial_tag_at_the_end_is_content"),
    case("qwen3", "<think>\nStep 1: {\"a\": 1}\nStep 2", "Step 1: {\"a\": 1}\nStep 2", None,
         "cut_off_inside_reasoning"),
    case("qwen3", "<think>x</think>y", None, "<think>x</think>y", "thinking_off", OFF),
    case("qwen3", "<think>x</think>y", "x", "y", "thinking_on_explicitly",
         {"enable_thinking": True}),
]


def stream(parser, pieces):
    reasoning, content = [], []
    for piece in pieces:
        delta = parser.feed(piece)
        reasoning.append(delta.reasoning)
        content.append(delta.content)
    delta = parser.finish()
    reasoning.append(delta.reasoning)
    content.append(delta.content)
    return "".join(reasoning) or None, "".join(content) or None


@pytest.mark.parametrize("name,kwargs,text,reasoning,content", CASES)
def test_extract(name, kwargs, text, reasoning, content):
    parsed = make_reasoning_parser(name, kwargs).extract(text)
    assert parsed == ParsedReasoning(reasoning_content=reasoning, content=content)


@pytest.mark.parametrize("name,kwargs,text,reasoning,content", CASES)
def test_stream_cut_at_every_boundary_matches_extract(name, kwargs, text, reasoning, content):
    for how, pieces in every_boundary(text):
        parser = make_reasoning_parser(name, kwargs)
        assert stream(parser, pieces) == (reasoning, content), how
        assert parser.result() == ParsedReasoning(reasoning, content), how


@pytest.mark.parametrize("name,kwargs,text,reasoning,content", CASES)
def test_stream_token_like_pieces_matches_extract(name, kwargs, text, reasoning, content):
    for seed in range(25):
        parser = make_reasoning_parser(name, kwargs)
        assert stream(parser, token_like(text, seed)) == (reasoning, content), f"seed {seed}"


@pytest.mark.parametrize("name,kwargs,text,reasoning,content", CASES)
def test_reasoning_ends_exactly_where_the_content_section_starts(name, kwargs, text, reasoning,
                                                                 content):
    """Fed one character at a time, reasoning_ended flips once, at the character that decides
    the content section has begun, and content_offset points just past that point's tag."""
    end = text.find("</think>")
    enabled = REASONING_PARSERS[name]().thinking_enabled(kwargs or {})
    if not enabled:
        expect_flip, expect_offset = 0, 0
    elif (text.lstrip().startswith("<think>")
          or REASONING_PARSERS[name].reasoning_without_start_tag):
        expect_flip = expect_offset = None if end < 0 else end + len("</think>")
    else:  # qwen3 without <think>: content from the first character that rules the tag out
        expect_flip = next((k + 1 for k in range(len(text))
                            if not "<think>".startswith(text[:k + 1].lstrip())), "finish")
        expect_offset = 0
    parser = make_reasoning_parser(name, kwargs)
    flips = [] if not parser.reasoning_ended else [0]
    for k, ch in enumerate(text):
        before = parser.reasoning_ended
        parser.feed(ch)
        if parser.reasoning_ended and not before:
            flips.append(k + 1)
    parser.finish()
    if parser.reasoning_ended and not flips:
        flips.append("finish")
    assert flips == ([] if expect_flip is None else [expect_flip])
    assert parser.content_offset == expect_offset


def test_a_closing_tag_split_across_pieces_is_held_not_leaked():
    parser = make_reasoning_parser("deepseek_r1")
    assert parser.feed("I think </th") == ReasoningDelta(reasoning="I think")
    assert parser.feed("ink>\n\nDone") == ReasoningDelta(content="Done")
    assert parser.reasoning_ended


def test_reasoning_then_tool_call_through_both_parsers():
    text = ('<think>\nThe user wants the weather; call the tool.\n</think>\n\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    expected = (None, [("get_weather", '{"city": "Paris"}', True)])
    for _, pieces in every_boundary(text):
        reasoning_parser, tool_parser = make_reasoning_parser("qwen3"), make_tool_parser("hermes")
        reasoning, content = [], []
        for piece in pieces + [None]:
            delta = reasoning_parser.feed(piece) if piece else reasoning_parser.finish()
            reasoning.append(delta.reasoning)
            content.append(delta.content)
        assert "".join(reasoning) == "The user wants the weather; call the tool."
        stream_tool_parser(tool_parser, content)
        assert message_summary(tool_parser.result()) == expected


def test_unknown_parser_name_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="reasoning_parser: unknown parser 'r1'.*deepseek_r1, "
                                         "qwen3"):
        reasoning_parser_class("r1")


def test_a_parser_serves_one_response():
    parser = make_reasoning_parser("qwen3")
    parser.feed("<think>")
    with pytest.raises(RuntimeError, match="fresh parser"):
        parser.extract("x")
    parser.finish()
    with pytest.raises(RuntimeError, match="one response"):
        parser.feed("x")
