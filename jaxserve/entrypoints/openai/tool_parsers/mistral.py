"""The `mistral` tool-call format, both generations, after the [TOOL_CALLS] control token:

    [TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "f", "arguments": {}}]
        (Mistral 7B Instruct v0.3 and other tokenizers before v11: one JSON array)
    [TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]f[ARGS]{}
        (v11 and later: Mistral Small 3.x, Devstral, Magistral; [CALL_ID]<id> may sit between the
        name and [ARGS], and with [ARGS] skipped the arguments follow the name directly)

Text before [TOOL_CALLS] is content, and so is text after a call. [TOOL_CALLS], [ARGS] and
[CALL_ID] are special tokens: the front end must detokenize with skip_special_tokens=False
(`needs_special_tokens`); a [TOOL_CALLS] section that is not a call comes back without the tag.
Call ids are 9 letters and digits, because Mistral's chat templates and mistral_common refuse any
other id when the conversation comes back with the tool results.

The shared rules (base.py) decide the rest; this module must not touch a tokenizer.
"""

from __future__ import annotations

import secrets
import string

from jaxserve.entrypoints.openai.tool_parsers.base import ToolParser
from jaxserve.entrypoints.openai.tool_parsers.envelope import EnvelopeReader
from jaxserve.entrypoints.openai.tool_parsers.json_stream import JsonValueReader

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_-.")
_ID_CHARS = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    name = "mistral"
    markers = (TOOL_CALLS,)
    needs_special_tokens = True

    def _new_call_id(self) -> str:
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))

    def _on_marker(self, marker: str):
        return self._s_after_marker

    def _s_after_marker(self) -> bool:
        self._skip_whitespace()
        if not self._buf:
            return False
        c = self._buf[0]
        if c == "[":
            self._consume(1)
            self._state = self._s_array_item
        elif c in _NAME_CHARS:
            self._name = ""
            self._state = self._s_name
        else:
            self._fail()
        return True

    # -- [TOOL_CALLS][{...}, {...}] ---------------------------------------------------------

    def _s_array_item(self) -> bool:
        self._skip_whitespace()
        if not self._buf:
            return False
        if self._buf[0] == "{":
            self._envelope = EnvelopeReader(arguments_keys=("arguments",), other_keys=True)
            self._state = self._s_array_call
        elif self._buf[0] == "]" and self._section is None:
            self._buf = self._buf[1:]  # a trailing comma before the end of the array
            self._state = self._s_content
        else:
            self._fail()
        return True

    def _s_array_call(self) -> bool:
        if not self._buf:
            return False
        if self._read_envelope(self._envelope, arguments_required=False) == "done":
            self._state = self._s_array_next
        return True

    def _s_array_next(self) -> bool:
        self._buf = self._buf.lstrip()
        if not self._buf:
            return False
        c = self._buf[0]
        self._buf = self._buf[1:] if c in ",]" else self._buf
        self._state = {",": self._s_array_item, "]": self._s_content}.get(c, self._s_discard)
        return True

    # -- [TOOL_CALLS]name[ARGS]{...} --------------------------------------------------------

    def _s_name(self) -> bool:
        n = self._count(_NAME_CHARS)
        self._name += self._consume(n)
        return self._after_name(call_id_allowed=True) or n > 0

    def _s_call_id(self) -> bool:
        n = self._count(_ID_CHARS)
        self._consume(n)  # the model's own id is not used: ids are ours, like every parser's
        return self._after_name(call_id_allowed=False) or n > 0

    def _count(self, chars) -> int:
        n = 0
        while n < len(self._buf) and self._buf[n] in chars:
            n += 1
        return n

    def _after_name(self, call_id_allowed: bool) -> bool:
        """At the end of the name (or call id): [ARGS] or '{' starts the arguments, [CALL_ID]
        an id; anything else means the section is no call."""
        buf = self._buf
        if not buf:
            return False
        if buf.startswith(ARGS) or buf[0] == "{":
            self._consume(len(ARGS) if buf.startswith(ARGS) else 0)
            self._begin_arguments()
        elif call_id_allowed and buf.startswith(CALL_ID):
            self._consume(len(CALL_ID))
            self._state = self._s_call_id
        elif ARGS.startswith(buf) or (call_id_allowed and CALL_ID.startswith(buf)):
            return False  # a partial tag: wait
        else:
            self._fail()
        return True

    def _begin_arguments(self) -> None:
        if not self._name:
            self._fail()
            return
        self._announce(self._name)
        self._reader = JsonValueReader()
        self._state = self._s_arguments

    def _s_arguments(self) -> bool:
        if not self._buf:
            return False
        reader = self._reader
        self._consume(reader.feed(self._buf))
        self._arguments(reader.take())
        if reader.error is not None:
            self._fail()
        elif reader.done:
            self._close_call(complete=True)
            self._state = self._s_content
        return True
