"""What the reasoning parsers share: the result types and the <think>...</think> splitter that
separates a reply, whole or streamed in pieces, into reasoning_content and content.

One parser object serves one response. `feed(delta_text)` returns a ReasoningDelta (the
reasoning and the content that text decides; reasoning always comes first); `finish()` flushes
what was held back; `extract(text)` is feed + finish on the whole text, so the streamed and the
non-streamed split are the same by construction. `reasoning_ended` says whether the reply is past
its reasoning section (the structured-output stage starts its grammar there); `content_offset`
is then the offset in the raw reply just past </think> (0 when the reply is all content), and
None before.

The rules:
* A reply whose prompt closed the reasoning (`start_in_content()`) is all content, as one
  whose request turned thinking off.
* An opening <think> at the very start of the reply (after optional whitespace) is dropped and
  opens the reasoning. What a reply without it does is the family's choice
  (`reasoning_without_start_tag`): DeepSeek R1's template opens <think> in the prompt, so its
  reply starts inside the reasoning; Qwen3's reply is all content unless it opens <think>.
* The reasoning ends at the first </think>; a reply that never closes it (cut off by the length
  limit) is all reasoning.
* Whitespace around the reasoning and right after </think> is dropped; reasoning_content and
  content are None when empty. A reply that is all content comes back exactly as written.
* A <think> or </think> anywhere else is ordinary text.

This module must not import a server framework, jax, or anything beyond the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from jaxserve.entrypoints.openai.text_edges import EdgeWhitespace

START = "<think>"
END = "</think>"


@dataclass(frozen=True)
class ParsedReasoning:
    reasoning_content: str | None
    content: str | None


@dataclass(frozen=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


def _held_suffix(text: str, tag: str) -> int:
    """Length of the longest end of text that is the start of tag (and not all of it)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ThinkReasoningParser(EdgeWhitespace):
    """Splits <think>reasoning</think>content. Subclasses set the family's registry name and
    whether a reply without the opening tag starts inside the reasoning."""

    name: ClassVar[str] = ""
    reasoning_without_start_tag: ClassVar[bool] = False

    def __init__(self, chat_template_kwargs: dict | None = None):
        self._buf = ""
        self._consumed = 0  # characters of the reply consumed before _buf
        self._eof = False
        self._fed = False
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._delta_reasoning: list[str] = []
        self._delta_content: list[str] = []
        self._held_ws = ""  # trailing whitespace of the reasoning, dropped if </think> follows
        self._skip_ws = True  # the reasoning's or the content's leading whitespace is dropped
        self.content_offset: int | None = None
        self._mode = "start"  # start | reasoning | content
        if not self.thinking_enabled(chat_template_kwargs or {}):
            self._enter_content(0, strip=False)

    def thinking_enabled(self, chat_template_kwargs: dict) -> bool:
        """Whether the request lets the model think (a family may read its template switch)."""
        return True

    def start_in_content(self) -> None:
        """The prompt already closed the reasoning: the whole reply is content (call before
        the first feed)."""
        if self._fed or self._eof:
            raise RuntimeError("start_in_content() needs a fresh parser")
        self._enter_content(0, strip=False)

    @property
    def reasoning_ended(self) -> bool:
        return self._mode == "content"

    def feed(self, text: str) -> ReasoningDelta:
        if self._eof:
            raise RuntimeError("feed() after finish(): a reasoning parser serves one response")
        self._fed = True
        self._buf += text
        self._run()
        return self._take_delta()

    def finish(self) -> ReasoningDelta:
        if not self._eof:
            self._eof = True
            self._run()
        return self._take_delta()

    def extract(self, text: str) -> ParsedReasoning:
        if self._fed or self._eof:
            raise RuntimeError("extract() needs a fresh parser")
        self.feed(text)
        self.finish()
        return self.result()

    def result(self) -> ParsedReasoning:
        return ParsedReasoning(reasoning_content="".join(self._reasoning) or None,
                               content="".join(self._content) or None)

    def _run(self) -> None:
        if self._mode == "start":
            self._start()
        if self._mode == "reasoning":
            self._in_reasoning()
        if self._mode == "content":
            self._in_content()

    def _take(self, n: int) -> str:
        text, self._buf = self._buf[:n], self._buf[n:]
        self._consumed += n
        return text

    def _start(self) -> None:
        stripped = self._buf.lstrip()
        if stripped.startswith(START):
            self._take(len(self._buf) - len(stripped) + len(START))
            self._mode = "reasoning"
        elif START.startswith(stripped) and not self._eof:
            return  # may still become <think>: wait
        elif self.reasoning_without_start_tag:
            self._mode = "reasoning"
        else:
            self._enter_content(0, strip=False)

    def _in_reasoning(self) -> None:
        buf = self._buf
        end = buf.find(END)
        if end >= 0:
            self._add_reasoning(self._take(end))
            self._take(len(END))
            self._held_ws = ""
            self._enter_content(self._consumed, strip=True)
            return
        keep = 0 if self._eof else _held_suffix(buf, END)
        self._add_reasoning(self._take(len(buf) - keep))

    def _enter_content(self, offset: int, strip: bool) -> None:
        self._mode = "content"
        self.content_offset = offset
        self._skip_ws = strip

    def _in_content(self) -> None:
        text = self._take(len(self._buf))
        if self._skip_ws:
            text = text.lstrip()
            if not text:
                return
            self._skip_ws = False
        self._content.append(text)
        self._delta_content.append(text)

    def _add_reasoning(self, text: str) -> None:
        kept = self._trimmed(text)
        if kept:
            self._reasoning.append(kept)
            self._delta_reasoning.append(kept)

    def _take_delta(self) -> ReasoningDelta:
        delta = ReasoningDelta("".join(self._delta_reasoning), "".join(self._delta_content))
        self._delta_reasoning.clear()
        self._delta_content.clear()
        return delta
