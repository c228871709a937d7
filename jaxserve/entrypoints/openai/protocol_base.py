"""The building blocks of the OpenAI request models (protocol.py, tool_protocol.py,
responses_protocol.py): strict text types and the two model bases.

Text is every string that reaches the tokenizer (a lone surrogate, which JSON can escape and
no tokenizer can encode, is refused). OpenModel: strict types, unknown keys kept in model_extra
(ignored.py reports them); ClosedModel: strict types, an unknown key is a 400 naming it (output
constraints). Plain data: no engine, no I/O.
"""

from __future__ import annotations

from typing import Annotated, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field


def _unicode(value: str) -> str:
    """JSON may escape a lone surrogate ("\\ud800"); no tokenizer can encode one."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"must be valid Unicode text: a lone surrogate "
                         f"{value[exc.start]!r} at position {exc.start}") from None
    return value


Text = Annotated[str, AfterValidator(_unicode)]  # every string that reaches the tokenizer
NonEmptyText = Annotated[Text, Field(min_length=1)]
NonNegativeInt = Annotated[int, Field(ge=0)]
TokenIds = Annotated[list[NonNegativeInt], Field(min_length=1)]
StopStrings = Union[NonEmptyText, list[NonEmptyText]]


class OpenModel(BaseModel):
    """Strict types; unknown keys kept in model_extra, reported and otherwise ignored."""

    model_config = ConfigDict(extra="allow", strict=True)


class ClosedModel(BaseModel):
    """Strict types; an unknown key is a 400 naming it."""

    model_config = ConfigDict(extra="forbid", strict=True)
