"""Pydantic models of the OpenAI HTTP API as jaxserve serves it: requests and responses.

Requests validate OpenAI's types strictly (a boolean is a JSON boolean, an integer a JSON
integer, a number an integer or a float: never a string) and ranges (the limits are in the
schema, so /openapi.json documents them and a bad value is a 400 naming the field and its
limit). A field the server does not know is kept aside rather than refused, as vLLM does: a
request and the objects in it that a client may send with extra keys (messages, their text
parts, stream_options) derive from `_Open` (protocol_base.OpenModel), whose unknown keys
`ignored.py` reports (a warning and a response header); the output constraints (response_format,
structured_outputs) derive from `_Closed`, whose unknown keys are a 400, since a constraint read
in part would let through output the client meant to forbid. Knowing a field is declaring it
here. ACCEPTED_WITHOUT_EFFECT lists OpenAI's fields accepted and not acted on (no warning);
parameters known but not honoured yet are modelled here and refused in openai/errors.py. Besides
OpenAI's parameters, vLLM's extra ones (top_k, min_p, min_tokens, repetition_penalty,
allowed_token_ids, bad_words, include_stop_str_in_output, skip_special_tokens, ignore_eos,
stop_token_ids, return_token_ids, prompt_logprobs, chat_template_kwargs, include_reasoning, and
the output constraints structured_outputs and guided_json / guided_regex / guided_choice /
guided_grammar) are accepted, as a vLLM client sends them in `extra_body`. `constraint_fields`
lists the output constraints a request sets and `structured_outputs` makes one a
StructuredOutputs. Chat requests take OpenAI's tools, tool_choice and parallel_tool_calls,
vLLM's chat_template_kwargs, assistant messages with tool_calls and `tool` messages (their
models: tool_protocol.py; what they mean: openai/tools.py). Plain data: no engine, no I/O.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, Field, model_serializer

from jaxserve.core.request import MAX_LOGPROBS, MAX_N
from jaxserve.entrypoints.openai.protocol_base import ClosedModel as _Closed
from jaxserve.entrypoints.openai.protocol_base import OpenModel as _Open
from jaxserve.entrypoints.openai.protocol_base import (NonEmptyText, NonNegativeInt,
                                                      StopStrings, Text, TokenIds)
from jaxserve.entrypoints.openai.tool_protocol import ChatTool, MessageToolCall, ToolChoice
from jaxserve.structured.params import StructuredOutputs


# OpenAI's fields that are accepted and have no effect here (docs/openai_api.md lists them):
# field -> the endpoints whose request has it. store=true is refused (errors.check_supported).
ACCEPTED_WITHOUT_EFFECT = {
    "user": ("completions", "chat"),
    "metadata": ("chat",),
    "store": ("chat",),
    "service_tier": ("chat",),
}


class StreamOptions(_Open):
    include_usage: bool = False


class JsonSchemaFormat(_Closed):
    """response_format.json_schema: the schema (OpenAI's name and strict are accepted; every
    schema is enforced strictly)."""

    name: str | None = None
    description: str | None = None
    json_schema: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Closed):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Closed):
    """vLLM's structured_outputs extra: exactly one of these."""

    json_schema: dict | bool | str | None = Field(None, alias="json")
    regex: NonEmptyText | None = None
    choice: Annotated[list[NonEmptyText], Field(min_length=1)] | None = None
    grammar: NonEmptyText | None = None
    json_object: bool | None = None


class _SamplingFields(_Open):
    """What completions and chat share: the model, sampling, stopping and streaming."""

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1e6, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=1 << 31)] | None = None  # 0 or -1: off
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=0, lt=1 << 32)] | None = None
    stop: StopStrings | None = None
    stop_token_ids: list[NonNegativeInt] | None = None
    ignore_eos: bool = False
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0  # 1: off
    # token id (as a string, as OpenAI's JSON has it) -> bias added to its logit
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    min_tokens: NonNegativeInt = 0  # EOS and stop_token_ids masked until this many tokens
    allowed_token_ids: Annotated[list[NonNegativeInt], Field(min_length=1)] | None = None
    bad_words: list[NonEmptyText] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: str | None = None  # accepted without effect
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False  # vLLM's extension: token ids in each choice
    # vLLM's extension: per prompt token its logprob and this many alternatives
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # Output constraints (at most one of these fields; constraint_fields lists the set ones)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict | bool | str | None = None
    guided_regex: NonEmptyText | None = None
    guided_choice: Annotated[list[NonEmptyText], Field(min_length=1)] | None = None
    guided_grammar: NonEmptyText | None = None
    # jaxserve's extension: seconds from arrival; still queued when it passes -> dropped, 408
    timeout: Annotated[float, Field(gt=0.0, le=86400.0)] | None = None


class CompletionRequest(_SamplingFields):
    prompt: Union[NonEmptyText,
                  Annotated[list[NonEmptyText], Field(min_length=1)],
                  TokenIds,
                  Annotated[list[TokenIds], Field(min_length=1)]]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: Annotated[int, Field(ge=1, le=128)] | None = None
    suffix: str | None = None


class TextPart(_Open):
    type: Literal["text"]
    text: Text


class ChatMessage(_Open):
    """content is required but for an assistant message with tool_calls (null or absent
    there); a `tool` message answers the call tool_call_id names (openai/tools.py checks
    both, naming the field)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[Text, Annotated[list[TextPart], Field(min_length=1)], None] = None
    name: Text | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant messages
    tool_call_id: Text | None = None  # tool messages


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # unset: "auto" with tools, "none" without
    parallel_tool_calls: bool | None = True  # null: true
    chat_template_kwargs: dict | None = None  # more chat template variables (and the parser's)
    include_reasoning: bool = True  # --reasoning-parser: false drops reasoning_content
    # Accepted without effect (ACCEPTED_WITHOUT_EFFECT); store=true is refused
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)],
                             Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None


_GUIDED_KINDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def constraint_fields(request: _SamplingFields) -> list[str]:
    """The output-constraint fields the request sets (a response_format of type text is none)."""
    found = []
    if request.response_format is not None and request.response_format.type != "text":
        found.append("response_format")
    if request.structured_outputs is not None:
        found.append("structured_outputs")
    return found + [name for name in _GUIDED_KINDS if getattr(request, name) is not None]


def structured_outputs(request: _SamplingFields, field: str) -> StructuredOutputs:
    """The constraint that `field` (one of constraint_fields) sets; StructuredOutputsError if it
    is malformed (its message names StructuredOutputs' field, e.g. structured_outputs.json)."""
    if field == "response_format":
        return StructuredOutputs.from_response_format(
            request.response_format.model_dump(by_alias=True, exclude_none=True))
    if field == "structured_outputs":
        kwargs = request.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        if kwargs.get("json_object") is False:
            del kwargs["json_object"]
        return StructuredOutputs(**kwargs)
    return StructuredOutputs(**{_GUIDED_KINDS[field]: getattr(request, field)})


class TokenizeCompletionRequest(_Open):
    model: str | None = None
    prompt: Text
    add_special_tokens: bool = True


class TokenizeChatRequest(_Open):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ChatTool] | None = None
    chat_template_kwargs: dict | None = None


class DetokenizeRequest(_Open):
    model: str | None = None
    tokens: list[NonNegativeInt]


# ---- responses -----------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """Per token: its text, logprob, top alternatives {text: logprob} (logprobs=k > 0; None for
    0) and where its text starts. An echoed prompt's first token has no logprob (None)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """vLLM's Logprob: rank is 1 for the likeliest token; None for a prompt token outside the
    requested alternatives (the engine ranks only those)."""

    logprob: float
    rank: int | None = None
    decoded_token: str


# vLLM's prompt_logprobs: per prompt position None (the first), then {token id (as a string):
# PromptLogprob}, the prompt token's entry first
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extension, per choice as in vLLM


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    """content is None only where a reasoning parser found nothing after the reasoning;
    reasoning_content is sent only when set (a server with --reasoning-parser always sets it,
    null when there was none), so a server without one answers as before."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _optional_parts_when_set(self, handler):
        """reasoning_content only from a reasoning parser, tool_calls only when made."""
        data = handler(self)
        if "reasoning_content" not in self.model_fields_set:
            data.pop("reasoning_content", None)
        if self.tool_calls is None:
            data.pop("tool_calls", None)
        return data


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    token_ids: list[int] | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extension, top-level as in vLLM


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "jaxserve"
    root: str
    parent: str | None = None  # a LoRA adapter's base model (None: a base model)
    max_model_len: int
    vocab_size: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorBody
