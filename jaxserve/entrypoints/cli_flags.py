"""The CLI's engine, security and sampling flags, made from one place: the field metadata of
EngineConfig's groups and of SecurityConfig, and SamplingParams' defaults.

Each flag's help says what it does, its unit, its choices and its default; sizes take units
(`4GiB`, `512MiB`; a plain number is in vLLM's unit for the same flag); booleans are
`--flag / --no-flag`; vLLM's names are accepted as aliases. `mapping_table()` writes the
docs/cli.md's jaxserve <-> vLLM table from the same metadata. This module only declares and reads
flags: it runs nothing and never imports jax.
"""

from __future__ import annotations

import argparse
import dataclasses

from jaxserve.config import (ENV_API_KEY, GROUPS, EngineConfig, SecurityConfig, parse_api_keys,
                             parse_size)

_SKIP = {"model"}  # a positional MODEL on serve; --model elsewhere (add_model_flag)


def parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def size_type(plain_unit: str):
    """An argparse type: bytes from '4GiB', or a plain number in plain_unit."""
    def parse(text: str) -> int:
        try:
            return parse_size(text, plain_unit)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    parse.__name__ = "size"
    return parse


class BoolFlag(argparse.Action):
    """`--flag` sets True, `--no-flag` sets False (argparse.BooleanOptionalAction, plus the
    negated spelling of every alias)."""

    def __init__(self, option_strings, dest, default=None, help=None, **kwargs):
        names = []
        for name in option_strings:
            names.append(name)
            if name.startswith("--"):
                names.append("--no-" + name[2:])
        super().__init__(names, dest, nargs=0, default=default, help=help, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, not option_string.startswith("--no-"))

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


def _describe(meta: dict, default, plain_unit: str | None) -> str:
    parts = [meta["help"]]
    if plain_unit:
        parts.append(f"size: 4GiB, 512MiB, 2GB; a plain number is in {plain_unit}")
    elif meta.get("unit"):
        parts.append(f"unit: {meta['unit']}")
    if meta.get("choices"):
        parts.append("choices: " + ", ".join(map(str, meta["choices"])))
    parts.append(f"default: {_show_default(default, meta)}")
    if meta.get("vllm"):
        parts.append("vLLM: " + ("same name" if meta["vllm"] == "=" else meta["vllm"]))
    return "; ".join(parts)


def _show_default(default, meta: dict) -> str:
    if default is None:
        return "unset"
    if meta.get("cli_plain_unit") and isinstance(default, int):
        for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if default >= scale and default % scale == 0:
                return f"{default // scale}{unit}"
    if isinstance(default, bool):
        return "on" if default else "off"
    return str(default)


def engine_fields() -> list[tuple[dataclasses.Field, str]]:
    """(field, its type as text) of every engine setting, group by group."""
    return [(s.field, str(s.type)) for s in EngineConfig.settings()]


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_model_flag(parser: argparse.ArgumentParser) -> None:
    field = {s.field.name: s.field for s in EngineConfig.settings()}["model"]
    parser.add_argument("--model", default=None, dest="model",
                        help=_describe(field.metadata, field.default, None))


def add_engine_flags(parser: argparse.ArgumentParser, with_model: bool = True) -> None:
    """Every engine setting as a flag of the same name, in one help section per group
    (defaults None: unset flags keep the groups' own defaults)."""
    from jaxserve.entrypoints import distributed

    sections = {name: parser.add_argument_group(
        f"engine: {name} (EngineConfig.{name}, {cls.__name__}; the same names in LLM(...))")
        for name, cls in GROUPS.items()}
    if with_model:
        add_model_flag(sections["model"])
    for s in EngineConfig.settings():
        f, hint, group = s.field, str(s.type), sections[s.group]
        if f.name in _SKIP:
            continue
        meta = f.metadata
        names = [flag_name(f.name), *meta.get("cli_alias", ())]
        plain = meta.get("cli_plain_unit")
        kwargs: dict = {"default": None, "dest": f.name,
                        "help": _describe(meta, f.default, plain)}
        if plain:
            kwargs.update(type=size_type(plain), metavar="SIZE")
        elif "bool" in hint:
            kwargs["action"] = BoolFlag
        elif "tuple[str" in hint:
            kwargs.update(type=str, nargs="+", metavar=meta.get("unit") or "TEXT")
        elif "tuple" in hint:
            kwargs.update(type=int, nargs="+", metavar="N")
        elif "float" in hint:
            kwargs.update(type=float, metavar="X")
        elif "int" in hint:
            kwargs.update(type=int, metavar="N")
        if meta.get("choices") and "type" not in kwargs and "action" not in kwargs:
            kwargs["choices"] = meta["choices"]
        group.add_argument(*names, **kwargs)
    distributed.add_distributed_flags(parser)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    settings = {f.name: getattr(args, f.name) for f, _ in engine_fields()
                if getattr(args, f.name, None) is not None}
    return EngineConfig.from_kwargs(**settings)


# Security flags are SecurityConfig's fields; api_keys takes vLLM's singular, repeatable flag.
_SECURITY_FLAGS = {"api_keys": "--api-key"}


def add_security_flags(parser: argparse.ArgumentParser) -> None:
    """SecurityConfig's fields as `jaxserve serve` flags (vLLM's names), one help section."""
    group = parser.add_argument_group(
        "security: both front ends (SecurityConfig; docs/security.md)")
    for f in dataclasses.fields(SecurityConfig):
        shown = None if f.default == () else f.default
        kwargs: dict = {"dest": f.name, "help": _describe(f.metadata, shown, None)}
        if f.name == "api_keys":
            kwargs.update(action="append", default=None, metavar="KEY[,KEY...]")
        elif isinstance(f.default, bool):
            kwargs.update(action=BoolFlag, default=f.default)
        else:
            kwargs.update(default=None, metavar="FILE")
        group.add_argument(_SECURITY_FLAGS.get(f.name, flag_name(f.name)), **kwargs)


def security_config_from_args(args: argparse.Namespace, environ=None) -> SecurityConfig:
    """The validated SecurityConfig from add_security_flags' flags; keys from --api-key, else
    from $JAXSERVE_API_KEY (empty or unset: no key)."""
    import os
    environ = os.environ if environ is None else environ
    values = args.api_keys
    if values is None:
        values = [environ[ENV_API_KEY]] if environ.get(ENV_API_KEY, "").strip() else []
    return SecurityConfig(api_keys=parse_api_keys(values),
                          grpc_open_health=args.grpc_open_health,
                          ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
                          ssl_ca_certs=args.ssl_ca_certs).validate()


def add_reasoning_flags(parser: argparse.ArgumentParser) -> None:
    """ReasoningSettings' field as `jaxserve serve`'s --reasoning-parser (vLLM's name)."""
    from jaxserve.config.reasoning import ReasoningSettings

    group = parser.add_argument_group("reasoning output (both front ends' chat; "
                                      "ReasoningSettings)")
    for f in dataclasses.fields(ReasoningSettings):
        group.add_argument(flag_name(f.name), default=None, dest=f.name, metavar="NAME",
                           help=_describe(f.metadata, f.default, None))


def reasoning_settings_from_args(args: argparse.Namespace):
    """The ReasoningSettings the flags give; ValueError listing the parsers for an unknown
    name (before the model loads)."""
    from jaxserve.config.reasoning import ReasoningSettings
    from jaxserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS

    name = getattr(args, "reasoning_parser", None)
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is unknown: choose one of "
                         f"{', '.join(sorted(REASONING_PARSERS))}")
    return ReasoningSettings(reasoning_parser=name)
def add_tool_call_flags(parser: argparse.ArgumentParser) -> None:
    """ToolCallSettings' fields as flags of the same names (vLLM's), one help section."""
    from jaxserve.config.tool_calls import ToolCallSettings

    group = parser.add_argument_group("tool calling (both front ends' chat; ToolCallSettings)")
    for f in dataclasses.fields(ToolCallSettings):
        kwargs: dict = {"default": f.default, "dest": f.name,
                        "help": _describe(f.metadata, f.default, None)}
        if isinstance(f.default, bool):
            kwargs["action"] = BoolFlag
        else:
            kwargs["metavar"] = "NAME"
        group.add_argument(flag_name(f.name), **kwargs)


def tool_call_settings_from_args(args: argparse.Namespace):
    """The validated ToolCallSettings the flags give (ValueError naming the flag when not)."""
    from jaxserve.config.tool_calls import ToolCallSettings

    return ToolCallSettings(**{f.name: getattr(args, f.name)
                               for f in dataclasses.fields(ToolCallSettings)}).validate()


# Sampling flags: (SamplingParams field, type, help). Defaults are SamplingParams' own (the
# Python API's and the servers'), so the CLI, LLM and both front ends sample alike; a model's
# generation_config.json overrides them unless a flag is given (generation_defaults.py).
_SAMPLING = (
    ("max_tokens", int, "most tokens to generate"),
    ("temperature", float, "sampling temperature; 0 is greedy"),
    ("top_k", int, "keep the k most likely tokens; 0 keeps all"),
    ("top_p", float, "keep the most likely tokens up to this total probability; 1 keeps all"),
    ("min_p", float, "drop tokens less likely than min_p times the most likely; 0 keeps all"),
    ("repetition_penalty", float, "divide repeated tokens' positive logits by this; 1 is off"),
    ("presence_penalty", float, "subtract from tokens already in the output; in [-2, 2]"),
    ("frequency_penalty", float, "subtract per occurrence in the output; in [-2, 2]"),
)


def sampling_defaults() -> dict:
    from jaxserve.core.request import SamplingParams
    return {f.name: f.default for f in dataclasses.fields(SamplingParams)}


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    defaults = sampling_defaults()
    group = parser.add_argument_group(
        "sampling (SamplingParams; unset flags take the model's generation_config.json, "
        "else SamplingParams' defaults)")
    for name, kind, text in _SAMPLING:
        group.add_argument(flag_name(name), type=kind, default=None, dest=name,
                           metavar="N" if kind is int else "X",
                           help=f"{text}; default: the model's, else {defaults[name]}")
    group.add_argument("--sampling-seed", type=int, default=None, dest="sampling_seed",
                       metavar="N",
                       help="per-request sampling seed (--seed is the engine's); default: "
                            "unset (a fresh seed per request)")
    group.add_argument("--stop", action="append", default=[], metavar="TEXT",
                       help="stop at this string (repeat for several); default: none")
    group.add_argument("--ignore-eos", action=BoolFlag, default=False,
                       help="keep generating past EOS up to --max-tokens; default: off")


def sampling_overrides(args: argparse.Namespace) -> dict:
    """The sampling settings the user gave on the command line (unset flags left out)."""
    given = {name: getattr(args, name) for name, _, _ in _SAMPLING
             if getattr(args, name, None) is not None}
    if getattr(args, "sampling_seed", None) is not None:
        given["seed"] = args.sampling_seed
    if getattr(args, "stop", None):
        given["stop"] = tuple(args.stop)
    if getattr(args, "ignore_eos", False):
        given["ignore_eos"] = True
    return given


def mapping_table() -> str:
    """docs/cli.md's table: every engine flag, its group (EngineConfig's attribute), its unit
    and default, and vLLM's name for it."""
    rows = ["| group | jaxserve flag (LLM keyword) | unit / choices | default | vLLM |",
            "|---|---|---|---|---|"]
    for s in EngineConfig.settings():
        f, meta = s.field, s.field.metadata
        names = ", ".join(f"`{n}`" for n in (flag_name(f.name), *meta.get("cli_alias", ())))
        unit = meta.get("unit") or ""
        if meta.get("cli_plain_unit"):
            unit = f"size (`4GiB`, `512MiB`); plain number: {meta['cli_plain_unit']}"
            unit += " on the CLI, bytes in Python"
        if meta.get("choices"):
            unit = " / ".join(map(str, meta["choices"]))
        vllm = meta.get("vllm") or "-"
        vllm = "same" if vllm == "=" else f"`{vllm}`"
        rows.append(f"| {s.group} | {names} (`{f.name}`) | {unit} | "
                    f"{_show_default(f.default, meta)} | {vllm} |")
    return "\n".join(rows)
