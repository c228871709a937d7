"""ToolCallSettings: the front ends' tool-calling settings (vLLM's --enable-auto-tool-choice and
--tool-call-parser), documented with `setting()` like the engine's, so the CLI's flags and help
are made from them (cli_flags.add_tool_call_flags).

tool_choice "required" and named functions need none of these (the structured-output engine
enforces them); tool_choice "auto" needs both: the parser reads the calls out of the model's
text. Plain data and validation only: whether a parser name exists is the tool-parser
registry's to say when a front end starts (this package imports no front end).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.config.settings import need, setting


@dataclass(frozen=True)
class ToolCallSettings:
    """How chat requests with tool_choice "auto" (or tools and no tool_choice) are served."""
    enable_auto_tool_choice: bool = setting(
        False, "serve tool_choice auto (the default when a chat request has tools): the "
        "--tool-call-parser reads the calls out of the model's reply; off: such requests get "
        "a 400 naming these flags (required and named tool_choice are always served)",
        vllm="=")
    tool_call_parser: str | None = setting(
        None, "the model's tool-call format for tool_choice auto: hermes (Qwen2.5/3, Hermes), "
        "llama3_json, llama4_json, mistral, pythonic", vllm="=")

    def validate(self) -> "ToolCallSettings":
        need(not self.enable_auto_tool_choice or bool(self.tool_call_parser),
             "enable_auto_tool_choice", self.enable_auto_tool_choice,
             "used with --tool-call-parser NAME (which format to read calls in)")
        return self

    @property
    def auto_parser(self) -> str | None:
        """The parser tool_choice auto uses; None when auto is not served."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None
