"""The `pythonic` tool-call format (Llama 3.2/4 with the pythonic template, ToolACE and others): the
reply starts with a Python list of calls with keyword arguments.

    [get_weather(city="Paris", days=3), get_time(tz='CET', fmt=None)]

Each argument value must be a literal (str, int, float, bool, None, and lists, tuples and dicts
of them with string keys); Python's ast reads it, nothing is evaluated. Arguments stream one
keyword at a time, each once its value is complete: `{"city": "Paris"` then `, "days": 3` then
`}`. A list that does not start the reply (after optional whitespace) is text, as in vLLM; text
after the closing bracket is content. The shared rules (base.py) decide the rest.

This module must not evaluate model output or import anything beyond the standard library.
"""

from __future__ import annotations

import ast
import math

from jaxserve.entrypoints.openai.tool_parsers.base import ToolParser
from jaxserve.entrypoints.openai.tool_parsers.json_stream import dump_json

_OPEN = "([{"
_CLOSE = ")]}"


class NotALiteral(ValueError):
    pass


def literal_value(node: ast.expr):
    """The JSON-compatible value of a literal expression; NotALiteral for anything else."""
    if isinstance(node, ast.Constant):
        value = node.value
        if value is None or isinstance(value, (str, bool, int)):
            return value
        if isinstance(value, float) and math.isfinite(value):
            return value
    elif (isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd))
          and isinstance(node.operand, ast.Constant)
          and type(node.operand.value) in (int, float)):
        value = literal_value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    elif isinstance(node, (ast.List, ast.Tuple)):
        return [literal_value(e) for e in node.elts]
    elif isinstance(node, ast.Dict):
        keys = [k.value if isinstance(k, ast.Constant) and isinstance(k.value, str) else None
                for k in node.keys]
        if None in keys:
            raise NotALiteral("dict keys must be strings")
        return {k: literal_value(v) for k, v in zip(keys, node.values)}
    raise NotALiteral(f"not a literal: {type(node).__name__}")


def keyword_argument(text: str) -> tuple[str, object]:
    """`name=value` -> (name, value); NotALiteral if it is anything else."""
    try:
        call = ast.parse(f"f({text})", mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise NotALiteral(str(e)) from None
    if (not isinstance(call, ast.Call) or call.args or len(call.keywords) != 1
            or call.keywords[0].arg is None):
        raise NotALiteral("expected one keyword argument")
    keyword = call.keywords[0]
    return keyword.arg, literal_value(keyword.value)


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def _initial_state(self):
        return self._s_start

    def _s_start(self) -> bool:
        stripped = self._buf.lstrip()
        if len(stripped) < len(self._buf):
            self._emit_content(self._buf[:len(self._buf) - len(stripped)])
            self._buf = stripped
        if not stripped:
            if self._eof:
                self._state = self._s_content
            return False
        if stripped[0] == "[":
            self._open_section("")
            self._consume(1)
            self._state = self._s_item
        else:
            self._state = self._s_content
        return True

    def _s_item(self) -> bool:
        self._skip_whitespace()
        if not self._buf:
            return False
        c = self._buf[0]
        if c.isidentifier():
            self._name = ""
            self._state = self._s_name
        elif c == "]" and self._section is None:  # a trailing comma after the last call
            self._buf = self._buf[1:]
            self._state = self._s_content
        else:
            self._fail()
        return True

    def _s_name(self) -> bool:
        buf = self._buf
        n = 0
        while n < len(buf) and (buf[n].isalnum() or buf[n] == "_"):
            n += 1
        self._name += self._consume(n)
        if n == len(buf):
            return n > 0
        if buf[n] == "(":
            self._consume(1)
            self._segment, self._depth, self._quote, self._quote_run = "", 0, "", 0
            self._escaped = False
            self._keywords: set[str] = set()
            self._state = self._s_arguments
        else:
            self._fail()
        return True

    def _s_arguments(self) -> bool:
        """Inside a call's parentheses: splits keyword arguments at top-level commas."""
        buf = self._buf
        i = 0
        while i < len(buf):
            c = buf[i]
            if self._quote:
                self._in_string(c)
                i += 1
                continue
            if c in "'\"":
                if len(buf) - i < 3 and not self._eof:
                    break  # ' or ''' : the next two characters decide
                quote = c * 3 if buf.startswith(c * 3, i) else c
                self._segment += quote
                self._quote, self._quote_run = quote, 0
                i += len(quote)
                continue
            if c in _CLOSE and self._depth == 0:
                if c != ")":
                    self._consume(i)
                    self._fail()
                    return True
                self._consume(i + 1)
                return self._end_keyword(last=True)
            if c == "," and self._depth == 0:
                self._consume(i + 1)
                return self._end_keyword(last=False)
            self._depth += (c in _OPEN) - (c in _CLOSE)
            self._segment += c
            i += 1
        self._consume(i)
        return i > 0

    def _in_string(self, c: str) -> None:
        self._segment += c
        if self._escaped:
            self._escaped, self._quote_run = False, 0
        elif c == "\\":
            self._escaped, self._quote_run = True, 0
        elif c == self._quote[0]:
            self._quote_run += 1
            if self._quote_run == len(self._quote):
                self._quote = ""
        else:
            self._quote_run = 0

    def _end_keyword(self, last: bool) -> bool:
        text, self._segment = self._segment.strip(), ""
        if text:
            try:
                key, value = keyword_argument(text)
                if key in self._keywords:
                    raise NotALiteral(f"keyword argument {key!r} repeated")
                piece = f"{dump_json(key)}: {dump_json(value)}"
            except (NotALiteral, ValueError):  # ValueError: an int past Python's digit limit
                self._fail()
                return True
            if self._current is None:
                self._announce(self._name)
                self._arguments("{" + piece)
            else:
                self._arguments(", " + piece)
            self._keywords.add(key)
        elif not last:
            self._fail()  # f(,) or f(a=1,,b=2)
            return True
        if last:
            if self._current is None:
                self._announce(self._name)
                self._arguments("{}")
            else:
                self._arguments("}")
            self._close_call(complete=True)
            self._state = self._s_after_item
        return True

    def _s_after_item(self) -> bool:
        self._buf = self._buf.lstrip()
        if not self._buf:
            return False
        c = self._buf[0]
        self._buf = self._buf[1:] if c in ",]" else self._buf
        self._state = {",": self._s_item, "]": self._s_content}.get(c, self._s_discard)
        return True
