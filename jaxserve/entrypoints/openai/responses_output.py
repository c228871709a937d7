"""Chat deltas -> Responses output items and the stream events that build them (OutputAssembler),
and the response object around them.

The Responses API is served as a translation of the chat path (responses.py): a chat reply, as
deltas (`reasoning_content`, `content`, `tool_calls` announcements and argument fragments, each
as the chat path streams them), is assembled into output items in the order they arrive:

* `reasoning` (id rs_...): the reply's reasoning_content, when the server runs a reasoning
  parser; its text is one reasoning_text content part.
* `message` (id msg_...): the reply's content, one output_text part. Content that is only
  whitespace is held back until text follows; it is dropped when a function call comes (the
  space a model writes before its call), and becomes the message when nothing else does.
* `function_call` (id fc_...): one per chat tool call, call_id the chat call's id, arguments the
  concatenated argument fragments.
A reply with no item at all gets an empty message, so every response has an output item. A new
item closes the one before it. `finish(reason)` closes the last one: "incomplete" when the chat
reply was cut by its token limit ("length"), else "completed".

`feed` and `finish` return the events (OpenAI's stream event dicts, without sequence_number)
that add and fill the items; a non-streamed reply is fed whole to a fresh assembler and its
events dropped, so the streamed and non-streamed outputs are built by the same code and agree.
A whole non-streamed reply puts its content before its calls, while a stream keeps the order in
which they came: content the model wrote after a call is a second message item in a stream, and
part of the first in a non-streamed reply (their texts concatenate alike).

`response_object` shapes the response (status, incomplete_details, usage in OpenAI's names) for
both. Pure data: no engine, no HTTP, no I/O.
"""

from __future__ import annotations

import uuid


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputAssembler:
    def __init__(self):
        self.items: list[dict] = []       # output items, the last one open while `open`
        self.open = False
        self.call_items: dict[int, int] = {}  # chat tool call index -> output index
        self.held_space = ""              # whitespace-only content that has no item yet

    # ---- feeding ---------------------------------------------------------------------------
    def feed(self, delta: dict) -> list[dict]:
        """The events one chat delta makes (reasoning first, then content, then calls)."""
        events = []
        if delta.get("reasoning_content"):
            events += self._reasoning(delta["reasoning_content"])
        if delta.get("content"):
            events += self._text(delta["content"])
        for call in delta.get("tool_calls") or ():
            events += self._call(call)
        return events

    def finish(self, reason: str | None) -> list[dict]:
        """Close the output: held whitespace becomes a message unless a call was made; an
        output with no item gets an empty message; the last item is closed, "incomplete" when
        the reply was cut at its token limit."""
        events = []
        has_call = any(item["type"] == "function_call" for item in self.items)
        if self.held_space and not has_call:
            space, self.held_space = self.held_space, ""
            events += self._text(space, hold=False)
        if not self.items:
            events += self._start("message")
        return events + self._close("incomplete" if reason == "length" else "completed")

    @property
    def reasoning_text(self) -> str:
        return "".join(part["text"] for item in self.items if item["type"] == "reasoning"
                       for part in item["content"])

    # ---- items -----------------------------------------------------------------------------
    def _current(self, kind: str) -> dict | None:
        if self.open and self.items[-1]["type"] == kind:
            return self.items[-1]
        return None

    def _reasoning(self, text: str) -> list[dict]:
        events = [] if self._current("reasoning") else self._start("reasoning")
        item = self.items[-1]
        item["content"][0]["text"] += text
        return events + [self._at(item, "response.reasoning_text.delta", content_index=0,
                                  delta=text)]

    def _text(self, text: str, hold: bool = True) -> list[dict]:
        events = []
        if not self._current("message"):
            if hold and not (self.held_space + text).strip():
                self.held_space += text
                return []
            text, self.held_space = self.held_space + text, ""
            events = self._start("message")
        item = self.items[-1]
        item["content"][0]["text"] += text
        return events + [self._at(item, "response.output_text.delta", content_index=0,
                                  delta=text, logprobs=[])]

    def _call(self, call: dict) -> list[dict]:
        index, function = call.get("index", 0), call.get("function") or {}
        events = []
        if call.get("id") is not None:  # a new call: the chat path announces each once
            self.held_space = ""
            events = self._start("function_call", call_id=call["id"],
                                 name=function.get("name") or "")
            self.call_items[index] = len(self.items) - 1
        fragment = function.get("arguments") or ""
        if not fragment:
            return events
        where = self.call_items.get(index)
        if where is None or not self.open or where != len(self.items) - 1:
            raise RuntimeError(f"the chat reply sent arguments for tool call {index} while "
                               f"it was not the call being written")
        item = self.items[where]
        item["arguments"] += fragment
        return events + [self._at(item, "response.function_call_arguments.delta",
                                  delta=fragment)]

    def _start(self, kind: str, **fields) -> list[dict]:
        """Close the open item and open a new one of this kind: its added events."""
        events = self._close("completed")
        if kind == "message":
            item = {"id": new_id("msg"), "type": "message", "role": "assistant",
                    "status": "in_progress",
                    "content": [{"type": "output_text", "text": "", "annotations": []}]}
        elif kind == "reasoning":
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [],
                    "status": "in_progress", "content": [{"type": "reasoning_text", "text": ""}]}
        else:
            item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                    "arguments": "", **fields}
        self.items.append(item)
        self.open = True
        shown = dict(item, content=[]) if "content" in item else dict(item)
        events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                       "item": shown})
        if "content" in item:
            events.append(self._at(item, "response.content_part.added", content_index=0,
                                   part=dict(item["content"][0])))
        return events

    def _close(self, status: str) -> list[dict]:
        """The open item's done events (none when no item is open)."""
        if not self.open:
            return []
        self.open = False
        item = self.items[-1]
        item["status"] = status
        events = []
        if item["type"] == "function_call":
            events.append(self._at(item, "response.function_call_arguments.done",
                                   arguments=item["arguments"]))
        else:
            part = item["content"][0]
            kind = ("response.output_text.done" if item["type"] == "message" else
                    "response.reasoning_text.done")
            extra = {"logprobs": []} if item["type"] == "message" else {}
            events.append(self._at(item, kind, content_index=0, text=part["text"], **extra))
            events.append(self._at(item, "response.content_part.done", content_index=0,
                                   part=dict(part)))
        events.append({"type": "response.output_item.done", "output_index": len(self.items) - 1,
                       "item": _copy(item)})
        return events

    def _at(self, item: dict, kind: str, **fields) -> dict:
        """An event of the last item (the only one ever written to)."""
        return {"type": kind, "item_id": item["id"], "output_index": len(self.items) - 1,
                **fields}


def _copy(item: dict) -> dict:
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(part) for part in out["content"]]
    return out


# ---- the response object ------------------------------------------------------------------------
def usage(chat_usage: dict | None, reasoning_tokens: int) -> dict | None:
    """Chat usage {prompt_tokens, completion_tokens, ...} -> Responses usage."""
    if chat_usage is None:
        return None
    details = chat_usage.get("prompt_tokens_details") or {}
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0)},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": chat_usage["total_tokens"]}


def response_object(header: dict, items: list[dict], status: str,
                    usage_: dict | None = None, error: dict | None = None) -> dict:
    """The response: header (id, created_at, model and the echoed request fields), the output
    items (copied) and status "in_progress", "completed", "incomplete" (cut at
    max_output_tokens) or "failed" (error: {code, message})."""
    return {**header, "status": status, "error": error,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "output": [_copy(item) for item in items], "usage": usage_}
