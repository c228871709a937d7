"""Incremental JSON reading for tool-call arguments: text goes in a piece at a time, and the
canonical serialization of the value (what `dump_json` writes for it) comes out as soon as each
part of it is certain, so the argument fragments of a stream concatenate to the string the
non-streamed response carries.

Canonical form is `json.dumps(value, ensure_ascii=False)`: separators ", " and ": ", non-ASCII
kept as is, numbers as Python prints them (1.50 -> 1.5, 1E2 -> 100.0). Two departures, both so that
the output is always valid JSON that encodes to UTF-8: a lone surrogate is written as a \\uXXXX
escape, and a number too large for a float keeps its digits as written. Keys repeated inside an
object are kept as written (json.loads would keep only the last). Raw control characters inside
strings are accepted and escaped (models emit raw newlines in code arguments).

This module must not guess text the model has not written (no closing of open brackets), hold a
whole value back before writing it, or import anything beyond the standard library.
"""

from __future__ import annotations

import json
import math
import re

_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r",
                   "t": "\t"}
_ESCAPED = {chr(c): f"\\u{c:04x}" for c in range(0x20)}
_ESCAPED.update({'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b",
                 "\f": "\\f"})
_SURROGATE = re.compile("[\ud800-\udfff]")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?\Z")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_HEX = frozenset("0123456789abcdefABCDEF")
_LITERALS = ("true", "false", "null")
WHITESPACE = " \t\n\r"


def escape_json_char(ch: str) -> str:
    """One character as it appears inside a canonical JSON string."""
    escaped = _ESCAPED.get(ch)
    if escaped is not None:
        return escaped
    if "\ud800" <= ch <= "\udfff":
        return f"\\u{ord(ch):04x}"
    return ch


def dump_json(value) -> str:
    """The canonical serialization of a parsed value (see the module docstring)."""
    text = json.dumps(value, ensure_ascii=False)
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _canonical_number(token: str) -> str | None:
    if not _NUMBER.match(token):
        return None
    try:
        if any(c in token for c in ".eE"):
            value = float(token)
            return json.dumps(value) if math.isfinite(value) else token
        return str(int(token))
    except ValueError:  # an integer past Python's digit limit: its digits are already canonical
        return token


class JsonValueReader:
    """Reads one JSON value (any kind, any depth) from text fed in pieces.

    `feed(text, i)` reads from text[i:] and returns the index of the first character it did not
    consume: the end of the text, the character after the value, or the character that broke the
    value (`error` is then set). `take()` returns the canonical text written since the last take.
    A number can only be known to end at the character after it, so a number at the top level
    ends at `finish()`.
    """

    def __init__(self):
        self.done = False
        self.error: str | None = None
        self._out: list[str] = []
        self._stack: list[str] = []  # "{" or "[" per open container, innermost last
        # what comes next: value | value_or_close | key | key_or_close | colon | comma_or_close
        self._expect = "value"
        self._token_kind: str | None = None  # str | key | num | lit, while one is being read
        self._token = ""  # the number or literal read so far
        self._escape: str | None = None  # characters after a backslash inside a string
        self._high = ""  # a decoded high surrogate waiting for its low half

    def take(self) -> str:
        text = "".join(self._out)
        self._out.clear()
        return text

    def feed(self, text: str, i: int = 0) -> int:
        n = len(text)
        while i < n and not self.done and self.error is None:
            kind = self._token_kind
            c = text[i]
            if kind == "str" or kind == "key":
                i = self._string_char(c, i)
            elif kind == "num":
                if c in _NUMBER_CHARS:
                    self._token += c
                    i += 1
                else:
                    self._end_number()
            elif kind == "lit":
                self._token += c
                if not any(lit.startswith(self._token) for lit in _LITERALS):
                    self.error = f"bad literal {self._token!r}"
                    return i
                i += 1
                if self._token in _LITERALS:
                    self._out.append(self._token)
                    self._token_kind = None
                    self._after_value()
            elif c in WHITESPACE:
                i += 1
            elif self._structural(c):
                i += 1
            else:
                return i
        return i

    def finish(self) -> None:
        """The text has ended: a number at the top level is complete."""
        if self._token_kind == "num" and not self._stack and self.error is None:
            self._end_number()

    def _structural(self, c: str) -> bool:
        expect = self._expect
        if expect in ("value", "value_or_close"):
            if c == "{" or c == "[":
                self._out.append(c)
                self._stack.append(c)
                self._expect = "key_or_close" if c == "{" else "value_or_close"
            elif c == '"':
                self._out.append(c)
                self._token_kind = "str"
            elif c == "-" or "0" <= c <= "9":
                self._token_kind, self._token = "num", c
            elif c in "tfn":
                self._token_kind, self._token = "lit", c
            elif c == "]" and expect == "value_or_close":
                self._close(c)
            else:
                self.error = f"expected a value, got {c!r}"
        elif expect in ("key", "key_or_close"):
            if c == '"':
                self._out.append(c)
                self._token_kind = "key"
            elif c == "}" and expect == "key_or_close":
                self._close(c)
            else:
                self.error = f"expected a key, got {c!r}"
        elif expect == "colon":
            if c == ":":
                self._out.append(": ")
                self._expect = "value"
            else:
                self.error = f"expected ':', got {c!r}"
        else:  # comma_or_close
            top = self._stack[-1]
            if c == ",":
                self._out.append(", ")
                self._expect = "key" if top == "{" else "value"
            elif c == ("}" if top == "{" else "]"):
                self._close(c)
            else:
                self.error = f"expected ',' or a closing bracket, got {c!r}"
        return self.error is None

    def _close(self, c: str) -> None:
        self._out.append(c)
        self._stack.pop()
        self._after_value()

    def _after_value(self) -> None:
        if self._stack:
            self._expect = "comma_or_close"
        else:
            self.done = True

    def _end_number(self) -> None:
        canonical = _canonical_number(self._token)
        self._token_kind = None
        if canonical is None:
            self.error = f"bad number {self._token!r}"
            return
        self._out.append(canonical)
        self._after_value()

    def _string_char(self, c: str, i: int) -> int:
        """Reads one character inside a string; returns the next index (i itself on an error)."""
        if self._escape is not None:
            self._escape += c
            escape = self._escape
            if escape[0] != "u":
                self._escape = None
                decoded = _SIMPLE_ESCAPES.get(c)
                if decoded is None:
                    self.error = f"bad escape \\{c}"
                    return i
                self._char(decoded)
            elif len(escape) > 1 and c not in _HEX:
                self.error = f"bad escape \\{escape}"
                return i
            elif len(escape) == 5:
                self._escape = None
                self._code_point(int(escape[1:], 16))
            return i + 1
        if c == "\\":
            self._escape = ""
        elif c == '"':
            self._flush_high()
            self._out.append('"')
            if self._token_kind == "key":
                self._expect = "colon"
                self._token_kind = None
            else:
                self._token_kind = None
                self._after_value()
        else:
            self._char(c)
        return i + 1

    def _char(self, ch: str) -> None:
        self._flush_high()
        self._out.append(escape_json_char(ch))

    def _code_point(self, code: int) -> None:
        if 0xD800 <= code < 0xDC00:
            self._flush_high()
            self._high = chr(code)
        elif 0xDC00 <= code < 0xE000 and self._high:
            pair = 0x10000 + ((ord(self._high) - 0xD800) << 10) + (code - 0xDC00)
            self._high = ""
            self._out.append(chr(pair))
        else:
            self._char(chr(code))

    def _flush_high(self) -> None:
        if self._high:
            self._out.append(escape_json_char(self._high))
            self._high = ""
