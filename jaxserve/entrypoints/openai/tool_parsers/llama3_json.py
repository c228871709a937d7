"""The `llama3_json` tool-call format (Llama 3.1/3.2/3.3 and Llama 4 with JSON tool calling): the
reply is one or more JSON objects, separated by ';', either from the start of the reply or after
the <|python_tag|> control token.

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}
    Let me look that up.<|python_tag|>{"name": "search", "parameters": {"q": "jax"}}

Only "name" and "parameters" (or "arguments") are allowed keys, and the arguments are required,
so a reply that merely starts with some other JSON object is recognised as text as soon as its
first foreign key is read. Text before a call is recognised only with <|python_tag|>, which is a
special token: the front end must detokenize with skip_special_tokens=False
(`needs_special_tokens`), and the tag never reaches the content. Text after the calls is
content. The shared rules (base.py) decide the rest; this module must not touch a tokenizer.
"""

from __future__ import annotations

from jaxserve.entrypoints.openai.tool_parsers.base import ToolParser
from jaxserve.entrypoints.openai.tool_parsers.envelope import EnvelopeReader

PYTHON_TAG = "<|python_tag|>"
_ARGUMENT_KEYS = ("parameters", "arguments")


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    markers = (PYTHON_TAG,)
    needs_special_tokens = True

    def _initial_state(self):
        return self._s_start

    def _on_marker(self, marker: str):
        return self._s_after_tag

    def _resync_tags(self) -> tuple[str, ...]:
        return ()

    def _s_start(self) -> bool:
        """The start of the reply: a '{' after optional whitespace opens the tool calls."""
        stripped = self._buf.lstrip()
        if len(stripped) < len(self._buf):
            self._emit_content(self._buf[:len(self._buf) - len(stripped)])
            self._buf = stripped
        if not stripped:
            if self._eof:
                self._state = self._s_content
            return False
        if stripped[0] == "{":
            self._open_section("")
            self._begin_call()
        else:
            self._state = self._s_content
        return True

    def _s_after_tag(self) -> bool:
        self._skip_whitespace()
        if not self._buf:
            return False
        if self._buf[0] == "{":
            self._begin_call()
        else:
            self._fail()  # e.g. a built-in tool's `brave_search.call(...)`: text
        return True

    def _begin_call(self) -> None:
        self._envelope = EnvelopeReader(arguments_keys=_ARGUMENT_KEYS, other_keys=False)
        self._state = self._s_call

    def _s_call(self) -> bool:
        if not self._buf:
            return False
        if self._read_envelope(self._envelope, arguments_required=True) == "done":
            self._state = self._s_between
        return True

    def _s_between(self) -> bool:
        """After a call: ';' or '{' continues the calls, anything else is content."""
        self._buf = self._buf.lstrip()
        if not self._buf:
            return False
        if self._buf[0] == ";":
            self._buf = self._buf[1:]
        elif self._buf[0] == "{":
            self._begin_call()
        else:
            self._state = self._s_content
        return True
