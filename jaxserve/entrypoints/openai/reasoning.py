"""Reasoning output for chat (--reasoning-parser), as vLLM serves it: each choice's reasoning goes
in `reasoning_content` (stream: `delta.reasoning_content`), apart from its `content`, and an
output constraint applies only after the reasoning.

ReasoningFormat is the server's: its parser class and the tokenizer's ids of the <think> and
</think> tags. `for_request` makes a request's RequestReasoning from its prompt ids and
chat_template_kwargs. The reply starts in its content, with no reasoning to skip, when the
request turns thinking off (Qwen3's enable_thinking=false) or when the prompt's last think tag
is </think> (the template closed the section, as vLLM reads it); otherwise an output constraint
starts after </think> (SamplingParams.structured_outputs_after: the engine masks nothing before
it). `message` splits a whole reply; StepSplitter splits each step's text of a stream (both
front ends; the chat stream holds the tokens of steps whose text decided no delta yet). The tags are matched on text
here and on token ids by the engine: a model whose </think> is one token (every reasoning
model's tokenizer has it as an added token) agrees on both.

Used by both front ends (the gRPC server's chat too); it must not import a server framework or
jax, and it never talks to the engine.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from jaxserve.core.request import SamplingParams
from jaxserve.entrypoints.openai.reasoning_parsers import (ReasoningDelta, ThinkReasoningParser,
                                                           reasoning_parser_class)
from jaxserve.entrypoints.openai.reasoning_parsers.base import END, START

log = logging.getLogger(__name__)


def _ends_with(ids: list[int], i: int, tag: tuple[int, ...]) -> bool:
    """Whether tag ends at ids[i]."""
    return i + 1 >= len(tag) and tuple(ids[i + 1 - len(tag):i + 1]) == tag


def _closes_reasoning(ids: list[int], start: tuple[int, ...], end: tuple[int, ...]) -> bool:
    """Whether the last think tag in ids is the end tag (scanned from the end: a template that
    opens or closes the section does it in the generation prompt, so this stops early)."""
    for i in range(len(ids) - 1, -1, -1):
        token = ids[i]
        if token == end[-1] and _ends_with(ids, i, end):
            return True
        if token == start[-1] and _ends_with(ids, i, start):
            return False
    return False


@dataclass(frozen=True)
class ReasoningFormat:
    """The server's reasoning parser and this tokenizer's token ids of its tags."""

    parser_class: type[ThinkReasoningParser]
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]

    @classmethod
    def load(cls, name: str | None, tokenizer) -> "ReasoningFormat | None":
        """None without a parser; ValueError listing the parsers for an unknown name."""
        if name is None:
            return None
        parser_class = reasoning_parser_class(name)
        start, end = (tuple(tokenizer.encode(tag, add_special_tokens=False))
                      for tag in (START, END))
        if len(end) != 1:
            log.warning("--reasoning-parser %s: this tokenizer writes %s as %d tokens, not one "
                        "added token; an output constraint starts only after exactly those",
                        name, END, len(end))
        return cls(parser_class, start, end)

    def for_request(self, prompt_ids: list[int], chat_template_kwargs: dict | None,
                    include_reasoning: bool = True) -> "RequestReasoning":
        kwargs = dict(chat_template_kwargs or {})
        thinking = not self.parser_class(kwargs).reasoning_ended
        closed = _closes_reasoning(prompt_ids, self.start_ids, self.end_ids)
        return RequestReasoning(self, kwargs, not thinking or closed, include_reasoning)


@dataclass(frozen=True)
class RequestReasoning:
    """One chat request's reasoning: where its constraint starts, how its replies split."""

    format: ReasoningFormat
    chat_template_kwargs: dict
    starts_in_content: bool    # no reasoning section to skip: the reply is content from its start
    include_reasoning: bool    # false: reasoning_content left out (vLLM's include_reasoning)

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """params, with an output constraint starting after </think> unless the reply starts
        in its content (or the caller said where it starts)."""
        if (params.structured_outputs is None or self.starts_in_content
                or params.structured_outputs_after):
            return params
        return dataclasses.replace(params, structured_outputs_after=self.format.end_ids)

    def parser(self) -> ThinkReasoningParser:
        """A fresh parser for one choice."""
        parser = self.format.parser_class(self.chat_template_kwargs)
        if self.starts_in_content:
            parser.start_in_content()
        return parser

    def message(self, text: str) -> dict:
        """A whole reply -> AssistantMessage's content and reasoning_content (None: none)."""
        parsed = self.parser().extract(text)
        return {"content": parsed.content,
                "reasoning_content": parsed.reasoning_content if self.include_reasoning else None}


class StepSplitter:
    """Each step's text of a request's choices -> (reasoning, content): text only (a tag cut
    across steps is held until it is whole; which tokens go with which delta is the caller's)."""

    def __init__(self, reasoning: RequestReasoning, n: int):
        self.reasoning = reasoning
        self._parsers = [reasoning.parser() for _ in range(n)]

    def split(self, index: int, new_text: str, finishing: bool) -> tuple[str, str]:
        """(reasoning, content) this step decides for choice `index`; finishing: its last."""
        parser = self._parsers[index]
        split = parser.feed(new_text) if new_text else ReasoningDelta()
        if finishing:
            rest = parser.finish()
            split = ReasoningDelta(split.reasoning + rest.reasoning, split.content + rest.content)
        return split.reasoning if self.reasoning.include_reasoning else "", split.content
