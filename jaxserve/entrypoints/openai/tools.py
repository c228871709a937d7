"""Tool calling on chat requests: the checks on tools, tool_choice and a conversation's tool
messages, and what a request's tool_choice makes of its output (a ToolPlan).

tool_choice, as OpenAI documents it and vLLM serves it:
* "none": the tools still reach the chat template; the reply is plain text, never parsed.
* "auto" (the default when tools are given): the server's tool-call parser reads calls out of
  the reply; it needs the server started with --enable-auto-tool-choice and --tool-call-parser
  (without them a 400 naming both, as vLLM); with parallel_tool_calls false only the first
  call is kept (as vLLM).
* "required": the output is constrained to a JSON array of 1..N calls (exactly 1 when
  parallel_tool_calls is false), each {"name": <one of the tools>, "parameters": <that tool's
  parameters schema>}.
* {"type": "function", "function": {"name": N}}: the output is constrained to N's parameters
  schema; the generated text is the arguments.
The two enforced paths run on the structured-output engine, so their arguments always parse and
match the schema whatever the model; neither combines with another output constraint.

Input is plain data: both front ends hand over OpenAI-shaped dicts, and every refusal is a
RequestError naming the field (the front end's prefix, then OpenAI's path: tools[1].type,
messages[3].tool_call_id). No engine, no HTTP, no gRPC.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from jaxserve.core.errors import RequestError
from jaxserve.structured.compiler import InvalidGrammarError, check_json_schema
from jaxserve.structured.params import StructuredOutputs

TOOL_CHOICES = ("none", "auto", "required")
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
AUTO_FLAGS = "--enable-auto-tool-choice and --tool-call-parser NAME"
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})  # their values are data


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools and tool_choice make of its output."""

    mode: str                                 # "none", "auto", "required" or "named"
    template_tools: list[dict] | None = None  # the tools as the chat template gets them
    function_name: str | None = None          # mode "named": the function the output calls
    structured_outputs: StructuredOutputs | None = None  # the enforced modes' constraint
    constraint_field: str | None = None       # the field a failed compile of it names
    parallel: bool = True                     # parallel_tool_calls: false allows one call

    @property
    def enforced(self) -> bool:
        return self.mode in ("required", "named")


def plan_tools(tools: list[dict] | None, tool_choice, parallel_tool_calls: bool = True, *,
               auto_tool_choice: bool = False, other_constraint: str | None = None,
               prefix: str = "") -> ToolPlan:
    """Check a request's tools and tool_choice and plan its output. tools: OpenAI's
    [{"type": "function", "function": {name, description?, parameters?, strict?}}] (None or
    empty: none); tool_choice: "none" / "auto" / "required" / {"type": "function", "function":
    {"name": N}} / None (unset); auto_tool_choice: the server can parse calls (its flags are
    set); other_constraint: the request's other output-constraint field, if any."""
    tools = list(tools or [])
    choice_field = prefix + "tool_choice"
    for i, tool in enumerate(tools):
        _check_tool(tool, i, prefix)
    names = [tool["function"]["name"] for tool in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise RequestError(f"{prefix}tools[{i}].function.name",
                               f"{prefix}tools[{i}].function.name={name!r} is invalid: "
                               f"tools[{names.index(name)}] has the same name; tool names "
                               f"must be unique")
    if not tools:
        if tool_choice is not None:
            raise RequestError(choice_field, f"{choice_field} is set but tools is not: a "
                                             f"tool_choice needs the tools to choose from")
        return ToolPlan("none")
    template_tools = [_template_tool(tool) for tool in tools]
    mode, name = _mode(tool_choice, names, choice_field)
    if mode == "auto" and not auto_tool_choice:
        raise RequestError(choice_field, f'{choice_field} "auto" (the default when tools are '
                                         f'given) needs the server started with {AUTO_FLAGS}, '
                                         f'which this one was not: send tool_choice "none", '
                                         f'"required" or a named function instead')
    if mode in ("none", "auto"):
        return ToolPlan(mode, template_tools, parallel=bool(parallel_tool_calls))
    if other_constraint is not None:
        shown = f'"{mode}"' if mode == "required" else "a named function"
        raise RequestError(choice_field, f"{choice_field} {shown} constrains the output to "
                                         f"tool calls, so it cannot be combined with "
                                         f"{other_constraint}: send one of the two")
    if mode == "named":
        i = names.index(name)
        schema = _parameters(tools[i])
        field = f"{prefix}tools[{i}].function.parameters"
    else:
        schema = required_schema(tools, bool(parallel_tool_calls))
        field = f"{prefix}tools"
    return ToolPlan(mode, template_tools, name, StructuredOutputs(json=schema), field,
                    bool(parallel_tool_calls))


def _check_tool(tool, i: int, prefix: str) -> None:
    where = f"{prefix}tools[{i}]"
    if not isinstance(tool, dict):
        raise RequestError(where, f"{where} must be an object {{type, function}}")
    if tool.get("type") != "function":
        raise RequestError(f"{where}.type", f"{where}.type={tool.get('type')!r} is invalid: "
                                            f"the only tool type is \"function\"")
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
            or not function["name"]:
        raise RequestError(f"{where}.function.name",
                           f"{where}.function.name is required: a non-empty string")
    parameters = function.get("parameters")
    if parameters is None:
        return
    field = f"{where}.function.parameters"
    if not isinstance(parameters, dict):
        raise RequestError(field, f"{field} must be a JSON schema object, not "
                                  f"{type(parameters).__name__}")
    try:
        check_json_schema(parameters)
    except InvalidGrammarError as exc:
        raise RequestError(field, f"{field} is invalid: {exc}") from None


def _template_tool(tool: dict) -> dict:
    function = {k: v for k, v in tool["function"].items() if v is not None}
    return {"type": "function", "function": function}


def _mode(tool_choice, names: list[str], field: str) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise RequestError(field, f"{field}={tool_choice!r} is invalid: must be one of "
                                      f"{', '.join(TOOL_CHOICES)} or a named function")
        return tool_choice, None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or tool_choice.get("type", "function") != "function":
        raise RequestError(field, f"{field} must be \"none\", \"auto\", \"required\" or "
                                  f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
    if name not in names:
        raise RequestError(field, f"{field} names the function {name!r}, which is not one of "
                                  f"the tools ({', '.join(map(repr, names))})")
    return "named", name


def _parameters(tool: dict) -> dict:
    parameters = tool["function"].get("parameters")
    return NO_PARAMETERS if parameters is None else parameters


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """tool_choice "required": an array of 1..N (1 when not parallel) calls, each an object
    {"name": one tool's name, "parameters": that tool's schema}, name first. A tool schema's
    local $refs ("#/$defs/X") are rewritten to its place in the array schema."""
    options = []
    for k, tool in enumerate(tools):
        base = f"#/items/anyOf/{k}/properties/parameters"
        options.append({"type": "object",
                        "properties": {"name": {"type": "string",
                                                "enum": [tool["function"]["name"]]},
                                       "parameters": _relocated(_parameters(tool), base)},
                        "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _relocated(schema, base: str):
    """A copy of schema whose local "$ref"s ("#..." JSON pointers) point into `base`."""
    if isinstance(schema, list):
        return [_relocated(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key in ("properties", "patternProperties", "$defs", "definitions",
                     "dependentSchemas"):  # maps of names to schemas: the names are data
            out[key] = ({name: _relocated(sub, base) for name, sub in value.items()}
                        if isinstance(value, dict) else value)
        else:
            out[key] = _relocated(value, base)
    return out


# ---- the conversation ------------------------------------------------------------------------
def check_messages(messages: list[dict], prefix: str = "") -> None:
    """The tool rules of a conversation given as OpenAI message dicts: content is required but
    on an assistant message with tool_calls; tool_calls only on assistant messages, each with
    arguments as JSON text; a `tool` message names the call it answers (tool_call_id)."""
    for i, m in enumerate(messages):
        where = f"{prefix}messages[{i}]"
        role, calls = m.get("role"), m.get("tool_calls")
        if calls and role != "assistant":
            raise RequestError(f"{where}.tool_calls", f"{where}.tool_calls is set on a {role} "
                                                      f"message: only assistant messages "
                                                      f"carry tool calls")
        if m.get("content") is None and not (role == "assistant" and calls):
            raise RequestError(f"{where}.content", f"{where}.content is required (only an "
                                                   f"assistant message with tool_calls may "
                                                   f"leave it out)")
        if role == "tool" and not m.get("tool_call_id"):
            raise RequestError(f"{where}.tool_call_id",
                               f"{where}.tool_call_id is required on a tool message: the id "
                               f"of the assistant's tool call it answers")
        for j, call in enumerate(calls or ()):
            field = f"{where}.tool_calls[{j}].function.arguments"
            try:
                json.loads(call["function"]["arguments"])
            except ValueError as exc:
                raise RequestError(field, f"{field} is not JSON text: {exc}") from None


