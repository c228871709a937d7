"""Tool-call parsers, chosen by name as vLLM's `--tool-call-parser` chooses them: each turns a
model's reply (whole, or streamed in pieces) into content and OpenAI tool calls. One small file
per format; base.py holds the shared rules and types.

    parser = make_tool_parser("hermes")      # one per response
    deltas = parser.feed(delta_text)         # ContentDelta / ToolCallDelta, in order
    deltas += parser.finish()                # at the end of the stream
    message = parser.result()                # == make_tool_parser("hermes").extract(full_text)

This package must not import a server framework or jax: both front ends use it.
"""

from __future__ import annotations

from jaxserve.entrypoints.openai.tool_parsers.base import (ContentDelta, Delta, ParsedMessage,
                                                          ToolCall, ToolCallDelta, ToolParser)
from jaxserve.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from jaxserve.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from jaxserve.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from jaxserve.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama4_json": Llama3JsonToolParser,  # vLLM's alias: Llama 4 writes the same JSON calls
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
}


def tool_parser_class(name: str) -> type[ToolParser]:
    """The parser registered under name (check a flag at start-up with this)."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"tool_call_parser: unknown parser {name!r}; "
                         f"choose one of {', '.join(sorted(TOOL_PARSERS))}") from None


def make_tool_parser(name: str) -> ToolParser:
    """A fresh parser for one response."""
    return tool_parser_class(name)()


__all__ = ["TOOL_PARSERS", "ContentDelta", "Delta", "ParsedMessage", "ToolCall", "ToolCallDelta",
           "ToolParser", "make_tool_parser", "tool_parser_class"]
