"""What every tool-call parser shares: the result types, the streaming deltas, and the machinery
that turns a model's text, fed in pieces, into content and tool calls.

One parser object serves one response. `feed(delta_text)` returns the deltas that text decides
(content, or a tool-call delta: index; id, type "function" and name on a call's first delta;
then argument fragments); `finish()` flushes what was held back at the end of the stream;
`extract(text)` is feed + finish on the whole text, so the streamed and the non-streamed result
are the same by construction, and `result()` gives that result after a stream.

The rules every format follows:
* Text is held back only while it may still be part of a tool call (a partial marker such as
  "<tool_c", or a call whose name is not complete yet). It comes back unchanged as content when
  it turns out not to be one.
* A call is reported (its first delta: id, type, name) as soon as the text proves it is one: in
  most formats once its name is complete; where a plain JSON reply could look like a call
  (llama3_json), once its arguments begin; in pythonic, once its first argument is read. From
  then on it stays a call; its arguments stream as the canonical JSON (json_stream.py) of what
  the model wrote, `json.dumps(arguments, ensure_ascii=False)`.
* Malformed text inside a tool-call section: if no call of that section was reported yet, the
  section's text comes back as content; otherwise the broken call keeps the arguments read up to
  the fault (marked complete=False) and the rest of the section is dropped.
* A call cut off by the end of the stream (finish_reason "length") stays a call, marked
  complete=False, whose arguments are the canonical prefix read so far: not valid JSON, so no
  client can mistake it for a finished call (OpenAI's API, too, returns a cut call's arguments
  as they stand). A section cut off before any call was reported comes back as content.
* Whitespace that touches a tool call is dropped from the content; content is None when empty.
  A message without tool calls comes back exactly as written.

A parser must not import a server framework, jax, or anything beyond the standard library; the
HTTP and gRPC front ends both use it. It must not be reused across responses.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Union

from jaxserve.entrypoints.openai.text_edges import EdgeWhitespace
from jaxserve.entrypoints.openai.tool_parsers.envelope import EnvelopeReader


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # canonical JSON text of the arguments (a prefix when complete is False)
    type: str = "function"
    complete: bool = True  # False: cut off by the end of the stream or broken by a fault


@dataclass(frozen=True)
class ParsedMessage:
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    index: int  # position of the call in the message, from 0
    id: str | None = None  # the first delta of a call only, like type and name
    type: str | None = None
    name: str | None = None
    arguments: str = ""  # the next fragment of the call's arguments


Delta = Union[ContentDelta, ToolCallDelta]


@dataclass
class _Call:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)
    complete: bool = False


def _held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of text that is the start of a marker (and not a whole one)."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


class ToolParser(EdgeWhitespace):
    """Base of the tool-call parsers: the content path and the call bookkeeping. A format
    subclass sets `markers` and supplies the states of its tool-call sections (methods that
    consume from `_buf` and return whether they made progress)."""

    name: ClassVar[str] = ""
    # Text that opens a tool-call section anywhere in the content.
    markers: ClassVar[tuple[str, ...]] = ()
    # The markers are control tokens: detokenize with skip_special_tokens=False so they reach the
    # parser, and drop them (as skipping would have) when a section turns out to be text.
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self):
        self._buf = ""  # text received and not yet decided
        self._eof = False
        self._fed = False
        self._state: Callable[[], bool] = self._initial_state()
        self._deltas: list[Delta] = []
        self._content: list[str] = []
        self._calls: list[_Call] = []
        self._current: _Call | None = None  # the call whose arguments are being read
        self._section: list[str] | None = None  # raw text of a section with no call reported yet
        self._section_marker = ""
        self._section_ws = ""  # whitespace before the open section, content again if it is text
        self._held_ws = ""  # trailing whitespace of the content, kept until what follows is known
        self._skip_ws = False  # a call just ended: whitespace right after it is dropped

    # -- the public interface --------------------------------------------------------------

    def feed(self, text: str) -> list[Delta]:
        if self._eof:
            raise RuntimeError("feed() after finish(): a tool parser serves one response")
        self._fed = True
        self._buf += text
        return self._run()

    def finish(self) -> list[Delta]:
        if self._eof:
            return []
        self._eof = True
        deltas = self._run()
        if self._section is not None:
            self._release_section()  # never became a call: its text is content
            self._emit_content(self._buf)
        elif self._current is not None:
            self._close_call(complete=False)
        self._buf = ""
        if self._held_ws:
            self._push_content(self._held_ws)
            self._held_ws = ""
        return deltas + self._take_deltas()

    def extract(self, text: str) -> ParsedMessage:
        if self._fed or self._eof:
            raise RuntimeError("extract() needs a fresh parser")
        self.feed(text)
        self.finish()
        return self.result()

    def result(self) -> ParsedMessage:
        content = "".join(self._content)
        calls = [ToolCall(id=c.id, name=c.name, arguments="".join(c.arguments),
                          complete=c.complete) for c in self._calls]
        return ParsedMessage(content=content or None, tool_calls=calls)

    @property
    def has_tool_calls(self) -> bool:
        return bool(self._calls)

    # -- for the format subclasses ---------------------------------------------------------

    def _initial_state(self) -> Callable[[], bool]:
        return self._s_content

    def _on_marker(self, marker: str) -> Callable[[], bool]:
        """The state that reads a section opened by marker."""
        raise NotImplementedError

    def _new_call_id(self) -> str:
        return "call_" + secrets.token_hex(12)

    def _run(self) -> list[Delta]:
        while self._state():
            pass
        return self._take_deltas()

    def _take_deltas(self) -> list[Delta]:
        deltas, self._deltas = self._deltas, []
        return deltas

    def _consume(self, n: int) -> str:
        """Takes n characters off the buffer; a section not yet reported keeps its raw text."""
        text, self._buf = self._buf[:n], self._buf[n:]
        if self._section is not None:
            self._section.append(text)
        return text

    def _skip_whitespace(self) -> bool:
        n = len(self._buf) - len(self._buf.lstrip())
        if n:
            self._consume(n)
        return n > 0

    def _s_content(self) -> bool:
        """Plain text: everything up to the earliest marker is content."""
        buf = self._buf
        if not buf:
            return False
        found = min(((buf.find(m), m) for m in self.markers if m in buf), default=None)
        if found is not None:
            start, marker = found
            self._emit_content(buf[:start])
            self._buf = buf[start + len(marker):]
            self._open_section(marker)
            self._state = self._on_marker(marker)
            return True
        keep = 0 if self._eof else _held_suffix(buf, self.markers)
        if keep == len(buf):
            return False
        self._emit_content(buf[:len(buf) - keep])
        self._buf = buf[len(buf) - keep:]
        return True

    def _s_discard(self) -> bool:
        """After a broken call: drop text up to the next marker (or `resync` end tag)."""
        buf = self._buf
        if not buf:
            return False
        ends = [(buf.find(t), t, True) for t in self._resync_tags() if t in buf]
        ends += [(buf.find(m), m, False) for m in self.markers if m in buf]
        if ends:
            start, tag, is_end_tag = min(ends)
            self._buf = buf[start + len(tag):] if is_end_tag else buf[start:]
            self._state = self._s_content
            return True
        keep = 0 if self._eof else _held_suffix(buf, self.markers + self._resync_tags())
        self._buf = buf[len(buf) - keep:] if keep else ""
        return keep < len(buf)

    def _resync_tags(self) -> tuple[str, ...]:
        """Tags that end a tool-call section (consumed); markers also end one (not consumed)."""
        return ()

    def _reply_opens_with(self, opener: str) -> bool | None:
        """At the start of a reply whose calls come first (no marker): leading whitespace goes
        out as content; True when the rest opens with `opener` (a section is then open), False
        when it is text (the content state next), None until there is a character to tell."""
        stripped = self._buf.lstrip()
        if len(stripped) < len(self._buf):
            self._emit_content(self._buf[:len(self._buf) - len(stripped)])
            self._buf = stripped
        if not stripped:
            if self._eof:
                self._state = self._s_content
            return None
        if stripped[0] != opener:
            self._state = self._s_content
            return False
        self._open_section("")
        return True

    def _open_section(self, marker: str) -> None:
        self._section_ws, self._held_ws = self._held_ws, ""
        self._section = []
        self._section_marker = marker

    def _release_section(self) -> None:
        """The open section is not a tool call: its raw text so far becomes content."""
        marker = "" if self.needs_special_tokens else self._section_marker
        text = marker + "".join(self._section)
        self._section = None
        self._held_ws = self._section_ws
        self._emit_content(text)

    def _fail(self) -> None:
        """The text at the head of the buffer breaks the current call or section."""
        if self._section is not None:
            self._release_section()
            self._state = self._s_content
            return
        if self._current is not None:
            self._close_call(complete=False)
        self._state = self._s_discard

    def _read_envelope(self, envelope: EnvelopeReader, arguments_required: bool) -> str | None:
        """Feeds the buffer to a JSON envelope: "done" once it closed as a complete call, "failed"
        once it broke (handled), None while it needs more text."""
        self._consume(envelope.feed(self._buf))
        if (self._current is None and envelope.name is not None
                and (envelope.arguments_started or not arguments_required)):
            self._announce(envelope.name)
        if self._current is not None:
            self._arguments(envelope.take_arguments())
        if envelope.error is not None:
            if self._current is not None and envelope.arguments_done:
                self._close_call(complete=True)
            self._fail()
            return "failed"
        if not envelope.done:
            return None
        if self._current is None:  # closed without a name, or without required arguments
            self._fail()
            return "failed"
        if not envelope.arguments_started:
            self._arguments("{}")
        self._close_call(complete=True)
        return "done"

    def _announce(self, name: str) -> None:
        call = _Call(id=self._new_call_id(), name=name)
        self._calls.append(call)
        self._current = call
        self._section = None
        self._deltas.append(ToolCallDelta(index=len(self._calls) - 1, id=call.id,
                                          type="function", name=name))

    def _arguments(self, fragment: str) -> None:
        if not fragment:
            return
        call = self._current
        call.arguments.append(fragment)
        last = self._deltas[-1] if self._deltas else None
        index = len(self._calls) - 1
        if isinstance(last, ToolCallDelta) and last.index == index:
            self._deltas[-1] = ToolCallDelta(index=index, id=last.id, type=last.type,
                                             name=last.name, arguments=last.arguments + fragment)
        else:
            self._deltas.append(ToolCallDelta(index=index, arguments=fragment))

    def _close_call(self, complete: bool) -> None:
        self._current.complete = complete
        self._current = None
        self._skip_ws = True

    def _emit_content(self, text: str) -> None:
        kept = self._trimmed(text)
        if kept:
            self._push_content(kept)

    def _push_content(self, text: str) -> None:
        self._content.append(text)
        last = self._deltas[-1] if self._deltas else None
        if isinstance(last, ContentDelta):
            self._deltas[-1] = ContentDelta(last.text + text)
        else:
            self._deltas.append(ContentDelta(text))
