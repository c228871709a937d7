"""ReasoningSettings: the front ends' reasoning output (vLLM's --reasoning-parser), documented
with `setting()` like the engine's settings, so the CLI's flag and help are made from it
(cli_flags.add_reasoning_flags).

With a parser, chat replies carry the model's reasoning apart from its content (HTTP
`reasoning_content`, gRPC `reasoning_text`) and an output constraint applies only after the
reasoning. Plain data: whether the name is a known parser is the parser registry's to say
(cli_flags checks it before the model loads; this package imports no front end).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.config.settings import setting

# The registry's names (entrypoints/openai/reasoning_parsers), for the flag's help only.
REASONING_PARSER_NAMES = ("deepseek_r1", "qwen3")


@dataclass(frozen=True)
class ReasoningSettings:
    """How chat replies of a reasoning model are split (both front ends)."""
    reasoning_parser: str | None = setting(
        None, "split a reasoning model's chat replies into reasoning and content (HTTP "
        "reasoning_content, gRPC reasoning_text) by its format: deepseek_r1 (DeepSeek R1, "
        "QwQ: the template opens <think>), qwen3 (Qwen3: the reply opens <think>, "
        "chat_template_kwargs enable_thinking=false turns it off); an output constraint "
        "then applies only after </think>; unset: replies as the model writes them",
        choices=REASONING_PARSER_NAMES, vllm="=")
