"""StructuredOutputs: what a request's output must match (a JSON schema, any JSON object, a regex,
one of a list of strings, or a grammar), validated, with a canonical cache key.

Mirrors vLLM's `StructuredOutputsParams`: exactly one of `json`, `regex`, `choice`, `grammar`,
`json_object` is set. `from_response_format` maps the OpenAI `response_format` field onto it.
Validation here is only of shape (types, exactly one kind, JSON that parses); whether a schema or
regex is one the grammar library can compile is the compiler's to say. Plain data: this module
must not import jax or a grammar library.
"""

from __future__ import annotations

import dataclasses
import json as jsonlib
from typing import Any

from jaxserve.core.errors import RequestError

KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputsError(RequestError):
    """A malformed structured-output request (INVALID_ARGUMENT / HTTP 400): a RequestError
    whose field is structured_outputs (or response_format)."""

    def __init__(self, message: str, field: str = "structured_outputs"):
        super().__init__(field, message)


@dataclasses.dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one constraint. `json` is a schema (dict, or its JSON text); `choice` a list of
    strings (kept as a tuple); `grammar` Lark text (llguidance's syntax; GBNF is converted)."""

    json: dict | bool | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    _key: str = dataclasses.field(init=False, repr=False, compare=False, default="")

    def __post_init__(self):
        chosen = [k for k in KINDS if (getattr(self, k) is not False if k == "json_object"
                                       else getattr(self, k) is not None)]
        if len(chosen) != 1:
            raise StructuredOutputsError(
                f"structured_outputs: set exactly one of {', '.join(KINDS)} "
                f"(got {', '.join(chosen) if chosen else 'none'})")
        if not isinstance(self.json_object, bool):
            raise StructuredOutputsError("structured_outputs.json_object must be a boolean, "
                                         f"not {type(self.json_object).__name__}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema(self.json))
        for field in ("regex", "grammar"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, str) or not value):
                raise StructuredOutputsError(f"structured_outputs.{field} must be a non-empty "
                                             f"string")
        if self.choice is not None:
            object.__setattr__(self, "choice", _choice(self.choice))
        object.__setattr__(self, "_key", self._canonical_key())

    @property
    def kind(self) -> str:
        """Which constraint: one of KINDS."""
        for k in KINDS[:-1]:
            if getattr(self, k) is not None:
                return k
        return "json_object"

    @property
    def key(self) -> str:
        """Canonical text of the constraint: equal constraints (a schema as a dict or as text,
        keys in any order) share one key, so they share one compiled grammar."""
        return self._key

    def _canonical_key(self) -> str:
        if self.json is not None:
            return "json:" + jsonlib.dumps(self.json, sort_keys=True, separators=(",", ":"),
                                           ensure_ascii=False)
        if self.choice is not None:
            return "choice:" + jsonlib.dumps(list(self.choice), ensure_ascii=False)
        if self.json_object:
            return "json_object:"
        return f"{self.kind}:{getattr(self, self.kind)}"

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, StructuredOutputs) and self.key == other.key

    @classmethod
    def from_response_format(cls, response_format: dict | None) -> "StructuredOutputs | None":
        """OpenAI's `response_format`: {"type": "text"} (or None) -> no constraint;
        {"type": "json_object"}; {"type": "json_schema", "json_schema": {"name": ...,
        "schema": {...}, "strict": ...}}."""
        if response_format is None:
            return None
        if not isinstance(response_format, dict):
            raise StructuredOutputsError("response_format must be an object", "response_format")
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls(json_object=True)
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict):
                raise StructuredOutputsError("response_format.json_schema must be an object "
                                             "with a 'schema'", "response_format.json_schema")
            schema = spec.get("schema", spec.get("json_schema"))
            if schema is None:
                # OpenAI allows omitting the schema: any JSON object
                return cls(json_object=True)
            return cls(json=schema)
        raise StructuredOutputsError(f"response_format.type must be one of text, json_object, "
                                     f"json_schema (got {kind!r})", "response_format.type")


def _schema(value: Any) -> dict | bool:
    if isinstance(value, str):
        try:
            value = jsonlib.loads(value)
        except jsonlib.JSONDecodeError as e:
            raise StructuredOutputsError(f"structured_outputs.json is not valid JSON: {e}") from e
    if isinstance(value, bool):
        return value
    if isinstance(value, dict):
        try:  # a private copy: the caller mutating its dict must not change the key
            return jsonlib.loads(jsonlib.dumps(value))
        except (TypeError, ValueError) as e:
            raise StructuredOutputsError(f"structured_outputs.json is not JSON-serializable: "
                                         f"{e}") from e
    raise StructuredOutputsError(f"structured_outputs.json must be a JSON schema (an object), "
                                 f"not {type(value).__name__}")


def _choice(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise StructuredOutputsError("structured_outputs.choice must be a list of strings")
    if not value:
        raise StructuredOutputsError("structured_outputs.choice must not be empty")
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item:
            raise StructuredOutputsError(f"structured_outputs.choice[{i}] must be a non-empty "
                                         f"string, not {item!r}")
    return tuple(value)
