"""Helpers for the tool and reasoning parser tests: the ways a reply is cut into stream pieces
(at every character boundary, one character at a time, token-like random cuts), and the
reassembly of a stream's deltas into a message, checking the delta contract on the way."""

from __future__ import annotations

import random

from jaxserve.entrypoints.openai.tool_parsers import ContentDelta, ToolCallDelta


def every_boundary(text: str):
    """Each split of text into two pieces, then the whole text one character at a time."""
    for k in range(1, len(text)):
        yield f"cut at {k}", [text[:k], text[k:]]
    yield "char by char", list(text)


def token_like(text: str, seed: int) -> list[str]:
    """Pieces of 1 to 8 characters, mostly short, as a BPE tokenizer's deltas tend to be."""
    rng = random.Random(seed)
    pieces, i = [], 0
    while i < len(text):
        n = rng.choice((1, 1, 2, 2, 3, 3, 4, 5, 6, 8))
        pieces.append(text[i:i + n])
        i += n
    return pieces


def stream_tool_parser(parser, pieces: list[str]):
    """Feeds pieces then finishes; returns (content, calls) rebuilt from the deltas alone, calls
    as [id, name, arguments], after checking that each call's first delta alone carries its id,
    type and name and that calls open in index order."""
    deltas = []
    for piece in pieces:
        deltas += parser.feed(piece)
    deltas += parser.finish()
    content, calls = [], []
    for delta in deltas:
        if isinstance(delta, ContentDelta):
            assert delta.text, "an empty content delta was emitted"
            content.append(delta.text)
            continue
        assert isinstance(delta, ToolCallDelta), f"unexpected delta {delta!r}"
        if delta.index == len(calls):
            assert delta.id and delta.type == "function" and delta.name, (
                f"the first delta of call {delta.index} lacks id/type/name: {delta!r}")
            calls.append([delta.id, delta.name, delta.arguments])
        else:
            assert delta.index == len(calls) - 1, (
                f"delta for call {delta.index} while call {len(calls) - 1} is open")
            assert delta.id is None and delta.type is None and delta.name is None, (
                f"a later delta of call {delta.index} repeats its header: {delta!r}")
            assert delta.arguments, "an empty arguments delta was emitted"
            calls[-1][2] += delta.arguments
    return "".join(content) or None, calls


def message_summary(message):
    """A ParsedMessage without its random ids, for comparisons."""
    return message.content, [(c.name, c.arguments, c.complete) for c in message.tool_calls]
