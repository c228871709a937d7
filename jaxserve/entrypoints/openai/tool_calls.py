"""A chat choice's text -> its content and tool calls, whole or streamed, by the request's
ToolPlan (openai/tools.py).

One ChoiceOutput per choice (`choice_output`):
* PlainOutput: the text is the content (no tools, or tool_choice "none").
* NamedCallOutput: tool_choice names a function, whose parameters schema constrained the
  output: one call of it, whose arguments are the generated text (leading whitespace dropped).
* RequiredCallsOutput: tool_choice "required" constrained the output to a JSON array of
  {"name", "parameters"} objects; CallArrayScanner reads it as it grows, and each call's
  arguments are the text of its parameters value exactly as generated.
* ParsedOutput: tool_choice "auto": the server's tool-call parser (openai/tool_parsers/).
`start()` is what the first streamed delta adds to the role, `feed(text)` the deltas a piece
of text decides, `finish()` the rest, `message()` the whole (content, tool calls) and
`finish_reason(reason)` OpenAI's reason for the engine's. Deltas are OpenAI's dicts: a call's
first one carries its index, id, type and name (arguments ""), the next ones argument
fragments. A non-streamed reply is fed whole to a fresh ChoiceOutput, so the streamed and
non-streamed arguments agree by construction. No engine, no HTTP.
"""

from __future__ import annotations

import json
import secrets

_WHITESPACE = " \t\r\n"


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def announce(index: int, call_id: str, name: str) -> dict:
    return {"index": index, "id": call_id, "type": "function",
            "function": {"name": name, "arguments": ""}}


def arguments_delta(index: int, fragment: str) -> dict:
    return {"index": index, "function": {"arguments": fragment}}


def tool_call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


class PlainOutput:
    """The text is the content."""

    def __init__(self):
        self.text: list[str] = []

    def start(self) -> dict:
        return {"content": ""}

    def feed(self, text: str) -> list[dict]:
        self.text.append(text)
        return [{"content": text}] if text else []

    def finish(self) -> list[dict]:
        return []

    def message(self) -> tuple[str | None, list[dict] | None]:
        return "".join(self.text), None

    def finish_reason(self, reason: str) -> str:
        return reason


class NamedCallOutput:
    """One call of the named function; the text is its arguments. The finish reason stays the
    engine's ("stop" when the arguments are complete, as OpenAI answers a forced function)."""

    def __init__(self, name: str):
        self.name, self.call_id = name, new_call_id()
        self.arguments: list[str] = []

    def start(self) -> dict:
        return {"content": None, "tool_calls": [announce(0, self.call_id, self.name)]}

    def feed(self, text: str) -> list[dict]:
        if not self.arguments:
            text = text.lstrip(_WHITESPACE)
        if not text:
            return []
        self.arguments.append(text)
        return [{"tool_calls": [arguments_delta(0, text)]}]

    def finish(self) -> list[dict]:
        return []

    def message(self) -> tuple[str | None, list[dict] | None]:
        return None, [tool_call(self.call_id, self.name, "".join(self.arguments))]

    def finish_reason(self, reason: str) -> str:
        return reason


class CallArrayScanner:
    """Reads a JSON array of call objects [{"name": ..., "parameters": {...}}, ...] as it
    arrives (the structured-output engine guarantees its shape, whitespace aside); `calls` is
    [name or None, arguments text so far] per call, the arguments being the parameters
    value's text exactly as written. Keys may come in any order; other keys are skipped."""

    def __init__(self):
        self.calls: list[list] = []
        self._depth = 0               # open arrays / objects
        self._in_string = self._escape = False
        self._key_chars: list[str] | None = None  # a call object's key being read (quoted)
        self._key: str | None = None  # the key whose value comes next
        self._after_colon = False
        self._value: str | None = None  # the key whose value is being read
        self._value_kind = ""         # "container", "string" or "scalar"
        self._name_chars: list[str] = []

    def feed(self, text: str) -> None:
        for ch in text:
            self._char(ch)

    def _char(self, ch: str) -> None:
        if self._value is not None and self._value_kind == "scalar" and not self._in_string:
            if ch not in ",}]" and ch not in _WHITESPACE:
                self._take(ch)
                return
            self._end_value()
        if self._in_string:
            self._string_char(ch)
            return
        if (self._value is None and self._depth == 2 and self._after_colon
                and ch not in _WHITESPACE):
            self._value, self._key, self._after_colon = self._key, None, False
            self._value_kind = ("container" if ch in "{[" else "string" if ch == '"'
                                else "scalar")
        if self._value is not None:
            self._take(ch)
        if ch == '"':
            self._in_string = True
            if self._value is None and self._depth == 2:
                self._key_chars = [ch]
        elif ch in "{[":
            self._depth += 1
            if self._depth == 2 and ch == "{":
                self.calls.append([None, ""])
        elif ch in "}]":
            self._depth -= 1
            if self._value is not None and self._depth == 2:
                self._end_value()
        elif ch == ":" and self._depth == 2 and self._value is None:
            self._after_colon = True

    def _string_char(self, ch: str) -> None:
        if self._value is not None:
            self._take(ch)
        elif self._key_chars is not None:
            self._key_chars.append(ch)
        if self._escape:
            self._escape = False
        elif ch == "\\":
            self._escape = True
        elif ch == '"':
            self._in_string = False
            if self._key_chars is not None:
                self._key = _decoded("".join(self._key_chars))
                self._key_chars = None
            elif self._value is not None and self._depth == 2:
                self._end_value()

    def _take(self, ch: str) -> None:
        if self._value == "parameters":
            self.calls[-1][1] += ch
        elif self._value == "name":
            self._name_chars.append(ch)

    def _end_value(self) -> None:
        if self._value == "name":
            self.calls[-1][0] = _decoded("".join(self._name_chars))
            self._name_chars = []
        self._value = None


def _decoded(quoted: str) -> str | None:
    try:
        value = json.loads(quoted)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


class RequiredCallsOutput:
    """The calls of a constrained JSON array; finish reason "tool_calls" once any was made."""

    def __init__(self):
        self.scanner = CallArrayScanner()
        self.ids: list[str] = []      # per call announced
        self.sent: list[int] = []     # per call announced: argument characters sent

    def start(self) -> dict:
        return {"content": None}

    def feed(self, text: str) -> list[dict]:
        self.scanner.feed(text)
        deltas = []
        for index, (name, arguments) in enumerate(self.scanner.calls):
            if name is None:
                break  # calls are announced in order, each once its name is known
            if index == len(self.ids):
                self.ids.append(new_call_id())
                self.sent.append(0)
                deltas.append(announce(index, self.ids[index], name))
            if len(arguments) > self.sent[index]:
                deltas.append(arguments_delta(index, arguments[self.sent[index]:]))
                self.sent[index] = len(arguments)
        return [{"tool_calls": deltas}] if deltas else []

    def finish(self) -> list[dict]:
        return []

    def message(self) -> tuple[str | None, list[dict] | None]:
        calls = [tool_call(call_id, name, arguments) for call_id, (name, arguments)
                 in zip(self.ids, self.scanner.calls)]
        return None, calls

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if reason == "stop" and self.ids else reason


class ParsedOutput:
    """tool_choice "auto": the server's tool-call parser splits the text into content and
    calls; finish reason "tool_calls" once it found any. single (parallel_tool_calls false):
    calls after the first are dropped, as vLLM drops them."""

    def __init__(self, parser, single: bool = False):
        self.parser, self.max_calls = parser, 1 if single else None

    def start(self) -> dict:
        return {"content": ""}

    def feed(self, text: str) -> list[dict]:
        return self._deltas(self.parser.feed(text)) if text else []

    def finish(self) -> list[dict]:
        return self._deltas(self.parser.finish())

    def message(self) -> tuple[str | None, list[dict] | None]:
        self.parser.finish()
        parsed = self.parser.result()
        calls = [tool_call(c.id, c.name, c.arguments)
                 for c in parsed.tool_calls[:self.max_calls]]
        return parsed.content, calls or None

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if reason == "stop" and self.parser.has_tool_calls else reason

    def _deltas(self, deltas) -> list[dict]:
        out = []
        for d in deltas:
            if hasattr(d, "text"):
                out.append({"content": d.text})
                continue
            if self.max_calls is not None and d.index >= self.max_calls:
                continue
            if d.id is not None:
                out.append({"tool_calls": [announce(d.index, d.id, d.name)]})
            if d.arguments:
                out.append({"tool_calls": [arguments_delta(d.index, d.arguments)]})
        return out


def tool_parser_class(name: str | None):
    """The tool-call parser class registered under name (None: None); ValueError naming the
    known ones when there is none (checked when a front end starts)."""
    if name is None:
        return None
    from jaxserve.entrypoints.openai.tool_parsers import tool_parser_class as registered
    return registered(name)


def choice_output(plan, make_parser=None):
    """A fresh ChoiceOutput for one choice of a request with this ToolPlan; make_parser: the
    server's tool-call parser class (tool_choice "auto")."""
    if plan.mode == "named":
        return NamedCallOutput(plan.function_name)
    if plan.mode == "required":
        return RequiredCallsOutput()
    if plan.mode == "auto":
        return ParsedOutput(make_parser(), single=not plan.parallel)
    return PlainOutput()
