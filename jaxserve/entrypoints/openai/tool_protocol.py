"""Pydantic models of chat tool calling's request side: tools, tool_choice, and the tool calls an
assistant message carries back in a conversation (their meaning is openai/tools.py's).

Split from protocol.py, which imports them (so `api.ChatTool` and the rest still name them).
Plain data: no engine, no I/O.
"""

from __future__ import annotations

from typing import Literal, Union

from jaxserve.entrypoints.openai.protocol_base import NonEmptyText, OpenModel, Text


class ToolCallFunction(OpenModel):
    name: NonEmptyText
    arguments: Text  # JSON text of the arguments, as the model wrote them


class MessageToolCall(OpenModel):
    """An assistant message's earlier tool call, sent back in the conversation."""

    id: Text
    type: Literal["function"] = "function"
    function: ToolCallFunction


class FunctionDefinition(OpenModel):
    name: NonEmptyText
    description: Text | None = None
    parameters: dict | None = None  # a JSON schema; absent: no parameters ({})
    strict: bool | None = None  # accepted: tool_choice required / named always enforce


class ChatTool(OpenModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenModel):
    name: NonEmptyText


class NamedToolChoice(OpenModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]
