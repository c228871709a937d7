"""A Responses request -> the chat completion request that serves it, and the chat field names
-> the Responses ones (for the errors the chat path answers with).

`chat_request` checks what the chat request cannot say (a function_call_output answering no
earlier call, a tool_choice naming no tool, a json_schema format without its schema, input
with nothing to answer) and builds the api.ChatCompletionRequest; `chat_tools` is the one place
Responses' flat function tools become chat's nested ones. `check_stateless` refuses what
needs stored responses. FieldNames renames a chat refusal's field and message: messages[3] -> the input
item it came from (or instructions), an assistant message's tool_calls[1] -> its function_call
item, max_completion_tokens -> max_output_tokens, response_format -> text.format,
tools[0].function -> tools[0]. Pure functions over validated models: no engine, no I/O.
"""

from __future__ import annotations

import re

from pydantic import ValidationError

from jaxserve.entrypoints.openai import protocol as api
from jaxserve.entrypoints.openai.errors import OpenAIError, bad_request
from jaxserve.entrypoints.openai.responses_protocol import ResponsesRequest

NO_STORE = "this server stores no responses"


def check_stateless(request: ResponsesRequest) -> None:
    if request.store:
        raise bad_request(f"store=true asks the server to keep the response, and {NO_STORE}: "
                          f"omit store or set it to false", "store")
    if request.previous_response_id is not None:
        raise bad_request(f"previous_response_id cannot be served: {NO_STORE}; send the whole "
                          f"conversation in input instead (the earlier output items included)",
                          "previous_response_id")
    if request.conversation is not None:
        raise bad_request(f"conversation cannot be served: {NO_STORE} and no conversations; "
                          f"send the whole conversation in input instead", "conversation")
    if request.background:
        raise bad_request(f"background=true needs a stored response to poll, and {NO_STORE}: "
                          f"omit background or set it to false", "background")


def chat_tools(tools) -> list[dict]:
    """Responses function tools {type, name, description, parameters, strict} -> chat tools
    {type, function: {name, description, parameters, strict}}."""
    return [{"type": "function",
             "function": {k: v for k, v in (("name", t.name), ("description", t.description),
                                            ("parameters", t.parameters),
                                            ("strict", t.strict)) if v is not None}}
            for t in tools]


def chat_tool_choice(choice, tool_names: list[str]):
    """tool_choice "none", "auto" or "required" as it is; {type: function, name} -> chat's
    {type: function, function: {name}}; a name that is not one of the tools is a 400."""
    if isinstance(choice, str):
        if choice == "required" and not tool_names:
            raise bad_request('tool_choice "required" needs tools to call, and tools is not '
                              'set', "tool_choice")
        return choice
    if choice.name not in tool_names:
        shown = ", ".join(map(repr, tool_names)) or "none are given"
        raise bad_request(f"tool_choice names the function {choice.name!r}, which is not one "
                          f"of the tools ({shown})", "tool_choice")
    return {"type": "function", "function": {"name": choice.name}}


def _chat_content(content):
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": part.text} for part in content]


def chat_messages(request: ResponsesRequest) -> tuple[list[dict], "FieldNames"]:
    """instructions and input -> chat messages, and where each came from."""
    messages: list[dict] = []
    names = FieldNames()
    if request.instructions is not None:
        messages.append({"role": "system", "content": request.instructions})
        names.sources.append(("instructions", []))
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
        names.sources.append(("input", []))
        return messages, names
    call_ids: set[str] = set()
    for i, item in enumerate(request.input):
        where = f"input[{i}]"
        if item.type == "message":
            messages.append({"role": item.role, "content": _chat_content(item.content)})
            names.sources.append((where, []))
        elif item.type == "function_call":
            call_ids.add(item.call_id)
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
                names.sources[-1][1].append(where)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                names.sources.append((where, [where]))
        elif item.type == "function_call_output":
            if item.call_id not in call_ids:
                raise bad_request(f"{where}.call_id={item.call_id!r} answers no call: no "
                                  f"function_call item before it has that call_id",
                                  f"{where}.call_id")
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _chat_content(item.output)})
            names.sources.append((where, []))
    if len(messages) == (request.instructions is not None):
        raise bad_request("input holds no message, function_call or function_call_output item: "
                          "there is nothing to answer", "input")
    return messages, names


def _response_format(request: ResponsesRequest) -> dict | None:
    fmt = request.text.format if request.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.json_schema is None:
        raise bad_request("text.format.schema is required when text.format.type is "
                          "json_schema", "text.format.schema")
    spec = {"name": fmt.name, "description": fmt.description, "schema": fmt.json_schema,
            "strict": fmt.strict}
    return {"type": "json_schema",
            "json_schema": {k: v for k, v in spec.items() if v is not None}}


def chat_request(request: ResponsesRequest
                 ) -> tuple[api.ChatCompletionRequest, "FieldNames"]:
    """The chat request that serves this Responses request, and how to name its fields."""
    messages, names = chat_messages(request)
    body = {"model": request.model, "messages": messages, "stream": request.stream}
    if request.stream:
        body["stream_options"] = {"include_usage": True}
    for ours, theirs in (("max_output_tokens", "max_completion_tokens"),
                         ("temperature", "temperature"), ("top_p", "top_p")):
        if getattr(request, ours) is not None:
            body[theirs] = getattr(request, ours)
    response_format = _response_format(request)
    if response_format is not None:
        body["response_format"] = response_format
    tool_names = [t.name for t in request.tools or ()]
    choice = (None if request.tool_choice is None else
              chat_tool_choice(request.tool_choice, tool_names))
    if request.tools:
        body["tools"] = chat_tools(request.tools)
        if choice is not None:
            body["tool_choice"] = choice
        if request.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = request.parallel_tool_calls
    try:
        return api.ChatCompletionRequest.model_validate(body), names
    except ValidationError as exc:
        first = exc.errors()[0]
        field = names.rename("".join(f"[{p}]" if isinstance(p, int) else f".{p}"
                                     for p in first["loc"]).lstrip("."))
        raise bad_request(f"{field} cannot be served as a chat request: {first['msg']}",
                          field) from None


class FieldNames:
    """Chat field names -> the Responses request's: per chat message, the field it came from
    and, for an assistant message of function_call items, each call's item."""

    _CHAT = re.compile(r"\bmessages(?:\[(\d+)\](?:\.tool_calls\[(\d+)\](?:\.function)?)?|(?!\w))"
                       r"|\bmax_completion_tokens\b|\bmax_tokens\b"
                       r"|\bresponse_format(?:\.json_schema)?\b|\btools\[(\d+)\]\.function\b")

    def __init__(self):
        self.sources: list[tuple[str, list[str]]] = []

    def _replace(self, match: re.Match) -> str:
        text = match.group(0)
        if text.startswith("messages"):
            if match.group(1) is None:
                return "input"
            k = int(match.group(1))
            where, calls = self.sources[k] if k < len(self.sources) else ("input", [])
            if match.group(2) is not None and int(match.group(2)) < len(calls):
                return calls[int(match.group(2))]
            return where
        if text.startswith("max_"):
            return "max_output_tokens"
        if text.startswith("response_format"):
            return "text.format"
        return f"tools[{match.group(3)}]"

    def rename(self, text: str | None) -> str | None:
        return None if text is None else self._CHAT.sub(self._replace, text)

    def renamed(self, exc: OpenAIError) -> OpenAIError:
        return OpenAIError(exc.status, self.rename(exc.message), self.rename(exc.param),
                           exc.kind, exc.headers)
