"""Chat messages -> prompt text and token ids, through the model's chat template (or an override).

What the OpenAI front end adds to Tokenizer.apply_chat_template: content given as a list of text
parts, the `developer` role (OpenAI's new name for `system`), `continue_final_message` (the
final assistant message left open, cut exactly as transformers' apply_chat_template cuts it),
`--chat-template FILE`, the request's tools (the template's `tools`), assistant tool calls and
tool messages (as transformers' templates read them) and chat_template_kwargs (more template
variables, such as Qwen3's enable_thinking; those the server sets itself are refused). Pure
functions over a tokenizer: no engine, no I/O, no HTTP.
"""

from __future__ import annotations

import json

from jaxserve.core.errors import RequestError

# Template variables the server sets: chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents",
                                         "add_generation_prompt", "continue_final_message",
                                         "chat_template", "tokenize"})


def with_chat_template(tokenizer, source: str | None):
    """The tokenizer, or a copy sharing its vocabulary that renders `source` instead."""
    if source is None:
        return tokenizer
    from jaxserve.model.text.tokenizer import Tokenizer

    if not isinstance(tokenizer, Tokenizer):
        raise ValueError(f"--chat-template needs a Hugging Face style tokenizer; this model's "
                         f"is a {type(tokenizer).__name__}")
    return Tokenizer(tokenizer.backend, bos_token_id=tokenizer.bos_token_id,
                     eos_token_ids=tokenizer.eos_token_ids, chat_template=source,
                     pad_token_id=tokenizer.pad_token_id)


def request_messages(messages) -> list[dict]:
    """Pydantic ChatMessages (or dicts) -> OpenAI message dicts, unset fields left out."""
    return [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in messages]


def message_dicts(messages) -> list[dict]:
    """Pydantic ChatMessages (or OpenAI message dicts, checked by tools.check_messages) -> the
    dicts templates read: {role, content[, name][, tool_calls][, tool_call_id]}. An assistant
    message's tool calls keep their id and type, and their arguments become a dict (as
    transformers' templates expect and vLLM gives them); its absent content is ""."""
    out = []
    for m in request_messages(messages):
        content = m.get("content")
        if content is None:
            content = ""
        elif not isinstance(content, str):  # text parts, as vLLM joins them
            content = "\n".join(part["text"] for part in content)
        role = "system" if m["role"] == "developer" else m["role"]
        message = {"role": role, "content": content}
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                message[key] = m[key]
        if m.get("tool_calls"):
            message["tool_calls"] = [
                {"id": c.get("id", ""), "type": c.get("type", "function"),
                 "function": {"name": c["function"]["name"],
                              "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]]
        out.append(message)
    return out


def _cut_after_final_message(text: str, final: str) -> str:
    """transformers' continue_final_message: end the prompt right after the last message."""
    if final.strip() not in text:
        raise ValueError("continue_final_message is set, but the final message does not "
                         "appear in the rendered chat template")
    loc = text.rindex(final.strip())
    if text[loc:loc + len(final.lstrip())] == final:
        return text[:loc + len(final.lstrip())]
    return text[:loc + len(final.strip())]


def check_template_kwargs(kwargs: dict | None, field: str = "chat_template_kwargs") -> dict:
    """A request's chat_template_kwargs, checked: RequestError naming `field` when one would
    replace a variable the server sets itself."""
    kwargs = dict(kwargs or {})
    clash = sorted(RESERVED_TEMPLATE_VARIABLES & kwargs.keys())
    if clash:
        raise RequestError(field, f"{field} sets {', '.join(clash)}, which the server sets "
                                  f"itself (use the request's own fields instead)")
    return kwargs


def apply_template(tokenizer, dicts: list[dict], add_generation_prompt: bool,
                   chat_template_kwargs: dict | None, tools: list[dict] | None = None) -> str:
    """The template's text for message dicts, with the request's tools and extra variables
    (checked: ValueError naming chat_template_kwargs when the template cannot take them)."""
    extra = check_template_kwargs(chat_template_kwargs)
    try:
        return tokenizer.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt,
                                             **({"tools": tools} if tools else {}), **extra)
    except TypeError as exc:  # a variable the template (or its renderer) cannot take as given
        if not extra:
            raise
        raise ValueError(f"chat_template_kwargs could not be used by the chat template: "
                         f"{exc}") from None


def render_chat(tokenizer, messages, add_generation_prompt: bool = True,
                continue_final_message: bool = False, tools: list[dict] | None = None,
                chat_template_kwargs: dict | None = None) -> tuple[str, list[int]]:
    """(prompt text, token ids); ValueError naming what is wrong (the template's own refusals
    included). tools: the request's tools as the template gets them (`tools`);
    chat_template_kwargs: more template variables. The ids are encoded without special
    tokens: the template writes any BOS."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message=true cannot be combined with "
                         "add_generation_prompt=true: set add_generation_prompt to false")
    dicts = message_dicts(messages)
    text = apply_template(tokenizer, dicts, add_generation_prompt, chat_template_kwargs, tools)
    if continue_final_message:
        text = _cut_after_final_message(text, dicts[-1]["content"])
    return text, list(tokenizer.encode(text, add_special_tokens=False))
