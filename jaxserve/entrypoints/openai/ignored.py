"""The request fields the server does not know and ignored: where they are, and how to name them.

A request model and the objects in it that derive from protocol._Open keep unknown keys aside
(pydantic's model_extra) instead of refusing them, as vLLM does. `ignored_fields` walks a
validated request and lists each such key by its path ("tools", "messages[*].refusal": list
indices are collapsed, so a long conversation whose messages all carry the same extra key names
it once). `describe` makes that list safe and short enough for a log line and a response header
(IGNORED_FIELDS_HEADER): names are shown as JSON strings when they hold anything but plain
identifier characters (a key may hold a newline, which a header cannot), each is cut to a length
and at most MAX_NAMES are listed. Pure functions over validated models: no I/O, no logging, no
HTTP.
"""

from __future__ import annotations

import json
import re

from pydantic import BaseModel

IGNORED_FIELDS_HEADER = "X-Jaxserve-Ignored-Fields"
MAX_NAMES = 32
MAX_NAME_CHARS = 64
_PLAIN = re.compile(r"[A-Za-z0-9_\-]{1,64}")


def _shown(key: str) -> str:
    if _PLAIN.fullmatch(key):
        return key
    quoted = json.dumps(key)  # ASCII only, control characters escaped
    return quoted if len(quoted) <= MAX_NAME_CHARS else quoted[:MAX_NAME_CHARS - 4] + '..."'


def _walk(value, path: str, found: dict[str, None]) -> None:
    if isinstance(value, BaseModel):
        for key in value.model_extra or ():
            found[f"{path}.{_shown(key)}" if path else _shown(key)] = None
        for name in type(value).model_fields:
            _walk(getattr(value, name), f"{path}.{name}" if path else name, found)
    elif isinstance(value, list) and value and isinstance(value[0], BaseModel):
        for item in value:
            _walk(item, f"{path}[*]", found)


def ignored_fields(request: BaseModel) -> list[str]:
    """The paths of the unknown keys in a validated request, in order of first appearance."""
    found: dict[str, None] = {}
    _walk(request, "", found)
    return list(found)


def describe(fields: list[str]) -> str:
    """'a, b, c' (at most MAX_NAMES names, then 'and N more'): printable ASCII, header-safe."""
    shown = ", ".join(fields[:MAX_NAMES])
    if len(fields) > MAX_NAMES:
        shown += f", and {len(fields) - MAX_NAMES} more"
    return shown
