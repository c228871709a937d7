"""The `qwen3` reasoning format (Qwen3 hybrid-thinking models): the reply opens with
<think>reasoning</think> when the model thinks; a reply that does not start with <think> is all
content, and `enable_thinking=False` in chat_template_kwargs (the template then closes an empty
think block in the prompt) makes the whole reply content from the first token. Thinking-only
models whose template opens <think> in the prompt (Qwen3 2507 Thinking) need `deepseek_r1`.
The splitting itself is base.py's; this module must not hold any of it.
"""

from __future__ import annotations

from jaxserve.entrypoints.openai.reasoning_parsers.base import ThinkReasoningParser


class Qwen3ReasoningParser(ThinkReasoningParser):
    name = "qwen3"
    reasoning_without_start_tag = False

    def thinking_enabled(self, chat_template_kwargs: dict) -> bool:
        return chat_template_kwargs.get("enable_thinking", True) is not False
