"""Reasoning parsers, chosen by name as vLLM's `--reasoning-parser` chooses them: each splits a
model's reply (whole, or streamed in pieces) into reasoning_content and content, and says when
the reasoning has ended. One small file per family; base.py holds the shared splitter.

    parser = make_reasoning_parser("qwen3", chat_template_kwargs)   # one per response
    delta = parser.feed(delta_text)      # ReasoningDelta(reasoning, content)
    delta = parser.finish()              # at the end of the stream
    parser.reasoning_ended               # the grammar of structured output applies from here

A tool parser, when both are on, reads the content this produces. This package must not import
a server framework or jax: both front ends use it.
"""

from __future__ import annotations

from jaxserve.entrypoints.openai.reasoning_parsers.base import (ParsedReasoning, ReasoningDelta,
                                                               ThinkReasoningParser)
from jaxserve.entrypoints.openai.reasoning_parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from jaxserve.entrypoints.openai.reasoning_parsers.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ThinkReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def reasoning_parser_class(name: str) -> type[ThinkReasoningParser]:
    """The parser registered under name (check a flag at start-up with this)."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"reasoning_parser: unknown parser {name!r}; "
                         f"choose one of {', '.join(sorted(REASONING_PARSERS))}") from None


def make_reasoning_parser(name: str,
                          chat_template_kwargs: dict | None = None) -> ThinkReasoningParser:
    """A fresh parser for one response; chat_template_kwargs are the request's."""
    return reasoning_parser_class(name)(chat_template_kwargs)


__all__ = ["REASONING_PARSERS", "ParsedReasoning", "ReasoningDelta", "ThinkReasoningParser",
           "make_reasoning_parser", "reasoning_parser_class"]
