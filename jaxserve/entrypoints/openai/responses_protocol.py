"""Pydantic models of OpenAI's Responses API (POST /v1/responses) as jaxserve serves it: the
request, its input items and tools, and the response object with its output items.

The request takes OpenAI's types strictly, as protocol.py's chat request does (the same
OpenModel base: a key the server does not know is kept aside, reported in a warning and the
X-Jaxserve-Ignored-Fields header; the output constraint `text.format` derives from ClosedModel and
refuses unknown keys). `input` is a string or a list of items, each told apart by its `type`
(a message may leave it out); tool_choice and each message's content likewise by their JSON
type, so a bad value is a 400 naming exactly the field (input[2].content[0].type), never a list
of every union member's complaint. The union tags are not identifiers ("message item"), so the
HTTP front end leaves them out of the field path it names.

Only what the chat path can serve is modelled: function tools (OpenAI's flat shape), text parts,
function_call / function_call_output items, and reasoning items (accepted so a client can send
a response's output back; they are not shown to the model, as chat templates drop earlier
reasoning). The stateful fields (store=true, previous_response_id, conversation, background)
are modelled so responses.py can refuse them by name. RESPONSES_ACCEPTED_WITHOUT_EFFECT lists
the fields accepted and not acted on (docs/openai_api.md documents both lists).

The response side (ResponseObject and its items) is what a non-streamed request returns and
what the final stream event carries; its usage and ids follow OpenAI's names. Plain data: no
engine, no I/O.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, Discriminator, Field, Tag

from jaxserve.entrypoints.openai.protocol_base import ClosedModel as _Closed
from jaxserve.entrypoints.openai.protocol_base import NonEmptyText, Text
from jaxserve.entrypoints.openai.protocol_base import OpenModel as _Open

# Responses request fields accepted and not acted on (docs/openai_api.md lists them).
RESPONSES_ACCEPTED_WITHOUT_EFFECT = ("user", "metadata", "store", "reasoning", "text.verbosity",
                                     "tools.strict")
ItemStatus = Literal["in_progress", "completed", "incomplete"]


def _by_json_type(value: Any) -> str:
    """A union member's tag by the JSON type of the value: a string, or anything else."""
    return "str" if isinstance(value, str) else "list"


def _item_kind(value: Any) -> str | None:
    """An input item's tag by its `type` (a message may leave it out)."""
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type",
                                                                                 None)
    return f"{kind} item" if kind in _ITEM_TYPES else None


def _not_empty(text: str) -> str:
    if not text:
        raise ValueError("must not be empty: give the text to answer, or a list of input items")
    return text


def _choice_kind(value: Any) -> str:
    return "str" if isinstance(value, str) else "dict"


def _function_only(kind: str) -> str:
    if kind != "function":
        raise ValueError("only function tools are served (type \"function\"): this server runs "
                         "no built-in tools (web_search, file_search, code_interpreter, mcp, "
                         "...)")
    return kind


# ---- the request's input --------------------------------------------------------------------
class ContentPart(_Open):
    """A message's text part: input_text, or output_text (an assistant answer sent back)."""

    type: Literal["input_text", "output_text"]
    text: Text
    annotations: list | None = None  # an echoed output_text carries them; not read


Content = Annotated[Union[Annotated[Text, Tag("str")],
                          Annotated[Annotated[list[ContentPart], Field(min_length=1)],
                                    Tag("list")]],
                    Discriminator(_by_json_type)]


class MessageItem(_Open):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Content
    id: str | None = None  # an output message sent back carries its id and status
    status: ItemStatus | None = None


class FunctionCallItem(_Open):
    """A call the model made earlier, sent back with the conversation."""

    type: Literal["function_call"]
    call_id: NonEmptyText
    name: NonEmptyText
    arguments: Text  # JSON text, as the model wrote it
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(_Open):
    """The result of the call `call_id` names (a function_call earlier in input)."""

    type: Literal["function_call_output"]
    call_id: NonEmptyText
    output: Content
    id: str | None = None
    status: ItemStatus | None = None


class ReasoningItem(_Open):
    """An earlier response's reasoning sent back: accepted, not shown to the model."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list | None = None
    content: list | None = None
    encrypted_content: str | None = None
    status: ItemStatus | None = None


_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
InputItem = Annotated[
    Union[Annotated[MessageItem, Tag("message item")],
          Annotated[FunctionCallItem, Tag("function_call item")],
          Annotated[FunctionCallOutputItem, Tag("function_call_output item")],
          Annotated[ReasoningItem, Tag("reasoning item")]],
    Discriminator(_item_kind, custom_error_type="input_item_type",
                  custom_error_message="must be an input item whose type is message (the "
                                       "default), function_call, function_call_output or "
                                       "reasoning")]
Input = Annotated[Union[Annotated[Annotated[Text, AfterValidator(_not_empty)], Tag("str")],
                        Annotated[Annotated[list[InputItem], Field(min_length=1)],
                                  Tag("list")]],
                  Discriminator(_by_json_type)]


# ---- tools, tool_choice, text ---------------------------------------------------------------
class FunctionTool(_Open):
    """OpenAI's Responses function tool: flat, unlike chat's {type, function: {...}}."""

    type: Annotated[str, AfterValidator(_function_only)]
    name: NonEmptyText
    description: Text | None = None
    parameters: dict | None = None  # a JSON schema; absent: no parameters
    strict: bool | None = None      # accepted: a named or required choice always enforces


class FunctionToolChoice(_Closed):
    type: Literal["function"]
    name: NonEmptyText


ToolChoice = Annotated[Union[Annotated[Literal["none", "auto", "required"], Tag("str")],
                             Annotated[FunctionToolChoice, Tag("dict")]],
                       Discriminator(_choice_kind)]


class TextFormat(_Closed):
    """text.format: plain text, any JSON object, or JSON matching `schema`."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Open):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted without effect


class ReasoningConfig(_Open):
    """Accepted without effect: reasoning shows up when the server runs a reasoning parser."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


Metadata = Annotated[dict[Annotated[str, Field(max_length=64)],
                          Annotated[str, Field(max_length=512)]], Field(max_length=16)]


class ResponsesRequest(_Open):
    model: str
    input: Input
    instructions: Text | None = None  # a system message before the input
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1e6, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None  # unset: "auto" with tools
    parallel_tool_calls: bool | None = None  # unset or null: true
    text: TextConfig | None = None
    stream: bool = False
    # stateless: each of these is refused with a 400 naming it when it asks for state
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict | None = None
    background: bool | None = None
    # accepted without effect
    metadata: Metadata | None = None
    user: str | None = None
    reasoning: ReasoningConfig | None = None


# ---- the response ---------------------------------------------------------------------------
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = []


class OutputMessage(BaseModel):
    id: str  # msg_...
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    id: str  # fc_...
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str  # JSON text
    status: ItemStatus


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    id: str  # rs_...
    type: Literal["reasoning"] = "reasoning"
    summary: list = []
    content: list[ReasoningText]
    status: ItemStatus


OutputItem = Union[OutputMessage, OutputFunctionCall, OutputReasoning]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    id: str  # resp_...
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict]
    tool_choice: str | dict
    parallel_tool_calls: bool
    text: dict
    reasoning: dict | None = None
    metadata: dict
    user: str | None = None
    store: Literal[False] = False
    previous_response_id: None = None
    background: Literal[False] = False
