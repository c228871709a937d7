"""Reads one JSON tool-call envelope, `{"name": "f", "arguments": {...}}`, from text fed in pieces:
the name once its string is complete, the arguments as canonical fragments while they arrive
(json_stream.py), other keys skipped when the format allows them.

It must not decide whether the envelope is a tool call (the parser does, from `name`,
`arguments_started` and `done`), nor hand out argument text the caller has not asked for:
arguments that arrive before the name wait inside until `take_arguments()`.
"""

from __future__ import annotations

import json

from jaxserve.entrypoints.openai.tool_parsers.json_stream import WHITESPACE, JsonValueReader


class EnvelopeReader:
    """One `{"name": ..., <arguments key>: ...}` object. `feed` returns the index of the first
    character not consumed (on an error: the character that broke the envelope)."""

    def __init__(self, arguments_keys: tuple[str, ...] = ("arguments",),
                 other_keys: bool = True):
        self.arguments_keys = arguments_keys
        self.other_keys = other_keys  # False: any key but the name and arguments is an error
        self.name: str | None = None
        self.arguments_started = False
        self.arguments_done = False
        self.done = False
        self.error: str | None = None
        self._state = "open"  # open | key_or_close | key | colon | value | comma_or_close
        self._value: JsonValueReader | None = None  # the key or value being read
        self._role = ""  # what _value reads: key | name | arguments | skip
        self._key = ""
        self._arguments: list[str] = []
        self._pending = ""  # canonical text of the key or name being read

    def take_arguments(self) -> str:
        text = "".join(self._arguments)
        self._arguments.clear()
        return text

    def feed(self, text: str, i: int = 0) -> int:
        n = len(text)
        while i < n and not self.done and self.error is None:
            if self._value is not None:
                i = self._feed_value(text, i)
                continue
            c = text[i]
            if c in WHITESPACE:
                i += 1
                continue
            state = self._state
            if state == "open":
                if c != "{":
                    self.error = f"a tool call starts with '{{', not {c!r}"
                    return i
                self._state = "key_or_close"
            elif state in ("key", "key_or_close"):
                if c == '"':
                    self._start_value("key")
                    continue  # the reader consumes the quote
                if c != "}" or state == "key":
                    self.error = f"expected a key, got {c!r}"
                    return i
                self.done = True
            elif state == "colon":
                if c != ":":
                    self.error = f"expected ':', got {c!r}"
                    return i
                self._state = "value"
            elif state == "value":
                self._start_value(self._role_of(self._key))
                if self._role == "name" and c != '"':
                    self.error = "the tool name is not a string"
                    return i
                continue
            else:  # comma_or_close
                if c == ",":
                    self._state = "key"
                elif c == "}":
                    self.done = True
                else:
                    self.error = f"expected ',' or '}}', got {c!r}"
                    return i
            i += 1
        return i

    def _role_of(self, key: str) -> str:
        if key == "name":
            return "name"
        if key in self.arguments_keys:
            self.arguments_started = True
            return "arguments"
        return "skip"

    def _start_value(self, role: str) -> None:
        self._value = JsonValueReader()
        self._role = role

    def _feed_value(self, text: str, i: int) -> int:
        reader = self._value
        i = reader.feed(text, i)
        out = reader.take()
        if self._role == "arguments":
            self._arguments.append(out)
        elif self._role in ("key", "name"):
            self._pending += out
        if reader.error is not None:
            self.error = reader.error
            return i
        if reader.done:
            self._value = None
            self._value_done()
        return i

    def _value_done(self) -> None:
        role = self._role
        text, self._pending = self._pending, ""
        if role == "key":
            key = json.loads(text)
            known = key == "name" or key in self.arguments_keys
            repeated = key == "name" and self.name is not None or (
                key in self.arguments_keys and self.arguments_started)
            if repeated:
                self.error = f"repeated key {key!r} in a tool call"
            elif not (known or self.other_keys):
                self.error = f"unexpected key {key!r} in a tool call"
            self._key = key
            self._state = "colon"
            return
        if role == "name":
            name = json.loads(text)
            if not name:
                self.error = "the tool name is empty"
            self.name = name
        elif role == "arguments":
            self.arguments_done = True
        self._state = "comma_or_close"
