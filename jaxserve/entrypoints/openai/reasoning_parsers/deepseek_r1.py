"""The `deepseek_r1` reasoning format (DeepSeek R1 and its distills, QwQ): <think>reasoning</think>
content, where the chat template has usually opened <think> already, so the reply starts inside
the reasoning and everything before the first </think> is reasoning, with or without an opening
tag. The template has no switch to turn thinking off (chat_template_kwargs are ignored, as in
vLLM). The splitting itself is base.py's; this module must not hold any of it.
"""

from __future__ import annotations

from jaxserve.entrypoints.openai.reasoning_parsers.base import ThinkReasoningParser


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    name = "deepseek_r1"
    reasoning_without_start_tag = True
