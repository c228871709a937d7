"""The `hermes` tool-call format (Hermes 2 Pro/3, Qwen2.5, Qwen3, QwQ): each call is a JSON object
between tags, any number of them, with text around them.

    Let me check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"tz": "CET"}}
    </tool_call>

The arguments key may come before the name; other keys are ignored; a call without arguments gets
"{}". A missing closing tag is tolerated (the next <tool_call> or the end of the text ends the
call). The shared rules (base.py) decide the rest. This module must not touch a tokenizer: the
tags are ordinary text in these models' vocabularies.
"""

from __future__ import annotations

from jaxserve.entrypoints.openai.tool_parsers.base import ToolParser
from jaxserve.entrypoints.openai.tool_parsers.envelope import EnvelopeReader

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    markers = (START,)

    def _on_marker(self, marker: str):
        self._envelope = EnvelopeReader(arguments_keys=("arguments",), other_keys=True)
        return self._s_call

    def _resync_tags(self) -> tuple[str, ...]:
        return (END,)

    def _s_call(self) -> bool:
        if not self._buf:
            return False
        if self._read_envelope(self._envelope, arguments_required=False) == "done":
            self._state = self._s_after_call
        return True

    def _s_after_call(self) -> bool:
        """Between a call's closing brace and its closing tag."""
        self._buf = self._buf.lstrip()
        buf = self._buf
        if not buf:
            return False
        if buf.startswith(END):
            self._buf = buf[len(END):]
            self._state = self._s_content
            return True
        if buf.startswith(START):
            self._state = self._s_content
            return True
        if END.startswith(buf) or START.startswith(buf):
            return False  # a partial tag: wait (at the end of the text it is dropped)
        self._state = self._s_discard
        return True
