"""Chat on the gRPC side: a Chat message -> the conversation, its tools and tool_choice as the
OpenAI front end has them (openai/tools.py checks them, each refusal a RequestError naming the
field under `chat.`), the rendered prompt and the request's ToolPlan; and a sample's reply ->
the tool calls and content of its last GenerateResponse (Replies).

The rules are the OpenAI front end's, shared: "required" and a named function constrain the
output (their constraint replaces SamplingParams.structured_outputs, and may not be combined
with one), "auto" reads calls with the server's tool-call parser. Pure functions and per-call
state over wire messages: no engine, no gRPC calls, no status codes.
"""

from __future__ import annotations

import dataclasses
import json

from jaxserve.core.errors import RequestError
from jaxserve.core.request import SamplingParams
from jaxserve.entrypoints.grpc.pb import jaxserve_pb2 as pb
from jaxserve.entrypoints.openai.chat_prompt import check_template_kwargs, render_chat
from jaxserve.entrypoints.openai.tool_calls import choice_output
from jaxserve.entrypoints.openai.tools import ToolPlan, check_messages, plan_tools

PREFIX = "chat."


def texts(chat: pb.Chat) -> list[str]:
    """Every text of the conversation (contents and earlier calls' arguments), uncopied, for
    the size limit."""
    return [m.content for m in chat.messages] + [c.function.arguments for m in chat.messages
                                                 for c in m.tool_calls]


def messages(chat: pb.Chat) -> list[dict]:
    """The conversation as OpenAI message dicts."""
    out = []
    for m in chat.messages:
        message = {"role": m.role, "content": m.content}
        for key in ("name", "tool_call_id"):
            if getattr(m, key):
                message[key] = getattr(m, key)
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": c.type or "function",
                 "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in m.tool_calls]
        out.append(message)
    return out


def tools(chat: pb.Chat) -> list[dict]:
    """The tools as OpenAI's dicts (a parameters schema parsed from its JSON text)."""
    out = []
    for i, tool in enumerate(chat.tools):
        f = tool.function
        function: dict = {"name": f.name}
        if f.description:
            function["description"] = f.description
        if f.parameters:
            field = f"{PREFIX}tools[{i}].function.parameters"
            try:
                function["parameters"] = json.loads(f.parameters)
            except ValueError as exc:
                raise RequestError(field, f"{field} is not JSON text: {exc}") from None
        if f.HasField("strict"):
            function["strict"] = f.strict
        out.append({"type": tool.type, "function": function})
    return out


def tool_choice(chat: pb.Chat):
    """"none" / "auto" / "required", {"type": "function", "function": {"name": N}}, or None."""
    if not chat.HasField("tool_choice"):
        return None
    which = chat.tool_choice.WhichOneof("choice")
    if which is None:
        raise RequestError(f"{PREFIX}tool_choice", f"{PREFIX}tool_choice is set but holds "
                                                   f"neither mode nor function_name")
    if which == "mode":
        return chat.tool_choice.mode
    return {"type": "function", "function": {"name": chat.tool_choice.function_name}}


def template_kwargs(chat: pb.Chat) -> dict:
    field = f"{PREFIX}chat_template_kwargs"
    if not chat.chat_template_kwargs:
        return {}
    try:
        value = json.loads(chat.chat_template_kwargs)
    except ValueError as exc:
        raise RequestError(field, f"{field} is not JSON text: {exc}") from None
    if not isinstance(value, dict):
        raise RequestError(field, f"{field} must be a JSON object of template variables")
    return check_template_kwargs(value, field)


def plan(chat: pb.Chat, other_constraint: str | None, tool_parser) -> ToolPlan:
    """The chat's ToolPlan; tool_parser: the server's parser class for "auto", or None."""
    parallel = chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else True
    return plan_tools(tools(chat), tool_choice(chat), parallel,
                      auto_tool_choice=tool_parser is not None,
                      other_constraint=other_constraint, prefix=PREFIX)


def render(tokenizer, chat: pb.Chat, tool_plan: ToolPlan | None = None) -> tuple[str, list[int]]:
    """The rendered chat template and its token ids (no special tokens added: the template
    writes any BOS itself); tool_plan: the Generate call's (its tools reach the template),
    None for Tokenize (the chat's tools go as given)."""
    if not chat.messages:
        raise ValueError("chat.messages is empty: must hold at least one message")
    conversation = messages(chat)
    check_messages(conversation, PREFIX)
    template_tools = (tool_plan.template_tools if tool_plan is not None else tools(chat))
    return render_chat(tokenizer, conversation, True, False, template_tools,
                       template_kwargs(chat))


def prompt_and_plan(tokenizer, chat: pb.Chat, params: SamplingParams,
                    tool_parser) -> tuple[list[int], ToolPlan, SamplingParams]:
    """A Generate call's chat: its token ids, ToolPlan, and params with the plan's constraint
    (the enforced modes) and the parser's need for special tokens (auto) applied."""
    other = "sampling.structured_outputs" if params.structured_outputs is not None else None
    tool_plan = plan(chat, other, tool_parser)
    _, ids = render(tokenizer, chat, tool_plan)
    if tool_plan.enforced:
        params = dataclasses.replace(params, structured_outputs=tool_plan.structured_outputs)
    if tool_plan.mode == "auto" and tool_parser.needs_special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=False)
    return ids, tool_plan, params


class Replies:
    """Each sample's reply read into tool calls as it streams (tool_choice other than
    "none"); `complete` puts them on the sample's last message."""

    def __init__(self, tool_plan: ToolPlan, tool_parser):
        self.plan, self.tool_parser = tool_plan, tool_parser
        self.outputs: dict = {}

    def _output(self, index: int):
        if index not in self.outputs:
            self.outputs[index] = choice_output(self.plan, self.tool_parser)
        return self.outputs[index]

    def feed(self, index: int, text: str) -> None:
        if text:
            self._output(index).feed(text)

    def complete(self, index: int, reason: str, response: pb.GenerateResponse) -> str:
        """Puts the sample's calls (and content) on its last message; the finish reason."""
        output = self._output(index)
        output.finish()
        content, calls = output.message()
        for call in calls or ():
            response.tool_calls.add(id=call["id"], type="function", function=pb.FunctionCall(
                name=call["function"]["name"], arguments=call["function"]["arguments"]))
        if content is not None and self.plan.mode == "auto":
            response.content = content
        return output.finish_reason(reason)
