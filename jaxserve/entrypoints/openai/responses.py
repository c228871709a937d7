"""POST /v1/responses: OpenAI's Responses API, stateless, as a translation over the chat path.

A Responses request becomes one chat completion request (responses_request.py), served by
OpenAIServing.chat exactly as /v1/chat/completions serves it (template, limits, output
constraints, tool calling and reasoning are all the chat path's), and the chat reply becomes
the Responses output (responses_output.py). The mapping:

* `instructions` -> a system message first; `input` (a string: one user message) -> messages;
  `function_call` items -> an assistant message's tool_calls (consecutive calls, and calls right
  after an assistant message, join that message); `function_call_output` -> a `tool` message
  (its call_id must name a function_call earlier in input); `reasoning` items are dropped.
* `max_output_tokens` -> max_completion_tokens; `text.format` -> response_format; `tools`
  (Responses' flat function shape) -> chat tools (`chat_tools`, the one place the two shapes
  meet), `tool_choice` and `parallel_tool_calls` likewise.
* The chat reply's reasoning_content, content and tool_calls -> reasoning, message and
  function_call items; finish_reason "length" -> status "incomplete" (max_output_tokens); usage
  in OpenAI's Responses names (reasoning_tokens: the reasoning text re-encoded, since the chat
  path does not say where in the tokens the reasoning ended).

Nothing is stored: store=true, previous_response_id, conversation and background=true are 400s
naming the field. A chat refusal is answered with the Responses field names
(messages[3] -> input[2], max_completion_tokens -> max_output_tokens, response_format ->
text.format, tools[0].function -> tools[0]). Streams are SSE events `event: <type>` whose data
carries type and a sequence_number counting from 0: response.created, response.in_progress,
the items' events, then response.completed or response.incomplete with the whole response; an
error after the stream began is an `error` event followed by response.failed. The chat stream is
read back from its SSE text (one json.loads per chunk): the price of reusing the chat path whole
rather than a second copy of it. Talks to the engine only through OpenAIServing.chat; no
routing (http_server.py), no scheduling.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time

from jaxserve.entrypoints.openai.errors import OpenAIError, error_for_exception
from jaxserve.entrypoints.openai.responses_output import (OutputAssembler, new_id,
                                                        response_object, usage)
from jaxserve.entrypoints.openai.responses_protocol import ResponseObject, ResponsesRequest
from jaxserve.entrypoints.openai.responses_request import (FieldNames, chat_request, chat_tools,
                                                         check_stateless)
from jaxserve.engine.prompt_intake import INLINE_MAX_CHARS, encode

log = logging.getLogger(__name__)
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


# ---- serving ------------------------------------------------------------------------------------
def response_header(serving, request: ResponsesRequest) -> dict:
    """The response's id, creation time, model and the request fields it echoes."""
    tools = [{"type": "function", **t["function"]} for t in chat_tools(request.tools or ())]
    choice = request.tool_choice
    fmt = request.text.format if request.text is not None else None
    return {
        "id": new_id("resp"), "object": "response", "created_at": int(time.time()),
        "model": request.model or serving.model_name, "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens, "temperature": request.temperature,
        "top_p": request.top_p, "tools": tools,
        "tool_choice": (choice.model_dump() if hasattr(choice, "model_dump") else
                        choice or ("auto" if tools else "none")),
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "text": {"format": (fmt.model_dump(by_alias=True, exclude_none=True) if fmt else
                            {"type": "text"})},
        "reasoning": (request.reasoning.model_dump(exclude_none=True)
                      if request.reasoning is not None else None),
        "metadata": request.metadata or {}, "user": request.user, "store": False,
        "previous_response_id": None, "background": False}


async def create_response(serving, request: ResponsesRequest):
    """A ResponseObject, or (stream) a ResponseEventStream of SSE event strings."""
    serving.check_model(request.model)
    check_stateless(request)
    chat, names = chat_request(request)
    try:
        result = await serving.chat(chat)
    except OpenAIError as exc:
        raise names.renamed(exc) from None
    header = response_header(serving, request)
    if request.stream:
        return ResponseEventStream(_events(serving, header, result, names), result)
    choice = result.choices[0]
    message = choice.message
    # reasoning_content: only a chat path with a reasoning parser has the field
    delta = {"reasoning_content": getattr(message, "reasoning_content", None),
             "content": message.content,
             "tool_calls": [{"index": i, "id": call.id, "function": call.function.model_dump()}
                            for i, call in enumerate(message.tool_calls or ())]}
    assembler = OutputAssembler()
    assembler.feed(delta)
    assembler.finish(choice.finish_reason)
    reasoning_tokens = await _num_tokens(serving, assembler.reasoning_text)
    return ResponseObject.model_validate(response_object(
        header, assembler.items, _status(choice.finish_reason),
        usage(result.usage.model_dump(), reasoning_tokens)))


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


async def _num_tokens(serving, text: str) -> int:
    if not text:
        return 0
    if len(text) <= INLINE_MAX_CHARS:
        return len(encode(serving.tokenizer, text, False))
    return len(await serving.async_engine.text_pool.run(encode, serving.tokenizer, text, False))


class ResponseEventStream:
    """The SSE events of a streamed response; aclose() closes them and the chat stream (so the
    engine request is aborted) even if iteration never began."""

    def __init__(self, events, chat_stream):
        self.events, self.chat_stream = events, chat_stream

    def __aiter__(self):
        return self.events

    async def aclose(self) -> None:
        await self.events.aclose()
        await self.chat_stream.aclose()


async def _chat_chunks(chat_stream):
    """The chat stream's chunks, decoded from its SSE text (its final [DONE] ends them)."""
    async for event in chat_stream:
        data = event.removeprefix("data: ").rstrip("\n")
        if data == "[DONE]":
            return
        yield json.loads(data)


async def _events(serving, header: dict, chat_stream, names: FieldNames):
    sequence_number = 0

    def event(body: dict) -> str:
        nonlocal sequence_number
        body["sequence_number"] = sequence_number
        sequence_number += 1
        return f"event: {body['type']}\ndata: {_dumps(body)}\n\n"

    yield event({"type": "response.created",
                 "response": response_object(header, [], "in_progress")})
    yield event({"type": "response.in_progress",
                 "response": response_object(header, [], "in_progress")})
    assembler, reason, chat_usage, error = OutputAssembler(), None, None, None
    reasoning_tokens = 0
    try:
        async with contextlib.aclosing(_chat_chunks(chat_stream)) as chunks:
            async for chunk in chunks:
                if "error" in chunk:
                    error = chunk["error"]
                    break
                chat_usage = chunk.get("usage") or chat_usage
                for choice in chunk.get("choices") or ():
                    for body in assembler.feed(choice.get("delta") or {}):
                        yield event(body)
                    reason = choice.get("finish_reason") or reason
        if error is None:
            for body in assembler.finish(reason):
                yield event(body)
            reasoning_tokens = await _num_tokens(serving, assembler.reasoning_text)
    except Exception as exc:  # noqa: BLE001  (every failure is told to the client)
        error = _error_body(exc)
    if error is not None:
        message = names.rename(error.get("message")) or "the response failed"
        yield event({"type": "error", "code": error.get("type"), "message": message,
                     "param": names.rename(error.get("param"))})
        yield event({"type": "response.failed", "response": response_object(
            header, assembler.items, "failed",
            error={"code": "server_error", "message": message})})
        return
    final = response_object(header, assembler.items, _status(reason),
                            usage(chat_usage, reasoning_tokens))
    kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
    yield event({"type": kind, "response": final})


def _error_body(exc: Exception) -> dict:
    try:
        return error_for_exception(exc).body()["error"]
    except Exception:  # noqa: BLE001  (not an error the front end knows: an internal one)
        log.error("a streamed response failed", exc_info=exc)
        return OpenAIError(500, f"internal error: {exc!r}", None, "internal_error").body()["error"]
