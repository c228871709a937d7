"""The CLI explains itself: help for every flag, sizes with units, vLLM's names, --no-* flags,
global options after the subcommand, one set of sampling defaults."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
from pathlib import Path

import pytest

from jaxserve.entrypoints import cli_flags, logging_setup
from jaxserve.entrypoints.cli import build_parser, main
from jaxserve.entrypoints.cli_flags import engine_config_from_args
from jaxserve.config import EngineConfig, parse_size

ROOT = Path(__file__).resolve().parent.parent


def _subcommands(parser, path=()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subcommands(sub, (*path, name))


def test_every_subcommand_help_runs_and_describes_every_flag():
    paths = [path for path, _ in _subcommands(build_parser())]
    assert {("serve",), ("generate",), ("chat",), ("convert",), ("bench", "offline"),
            ("bench", "serve"), ("bench", "overhead")} <= set(paths), paths
    undocumented = []
    for path, parser in _subcommands(build_parser()):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
            main([*path, "--help"])
        assert exit_.value.code == 0, f"jaxserve {' '.join(path)} --help failed"
        assert "usage: jaxserve" in out.getvalue()
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            text = action.help or ""
            if text in ("", argparse.SUPPRESS) or text.startswith("default:"):
                undocumented.append(f"jaxserve {' '.join(path)} "
                                    f"{'/'.join(action.option_strings) or action.dest}")
    assert not undocumented, "flags without a description:\n" + "\n".join(undocumented)


def test_engine_flag_help_says_unit_choices_default_and_vllms_name():
    help_text = {a.dest: a.help for a in build_parser()._subparsers._group_actions[0]
                 .choices["serve"]._actions}
    assert "plain number is in GiB" in help_text["swap_space"]
    assert "default: 256MiB" in help_text["swap_space"]
    assert "choices: recompute, swap" in help_text["preemption_mode"]
    assert "unit: tokens" in help_text["page_size"] and "--block-size" in help_text["page_size"]


def _serve(*flags):
    return build_parser().parse_args(["serve", *flags])


@pytest.mark.parametrize("text, plain_unit, want", [
    ("4GiB", "B", 4 << 30), ("512MiB", "GiB", 512 << 20), ("1.5G", "B", 3 << 29),
    ("2GB", "B", 2 * 10**9), ("4", "GiB", 4 << 30), ("1000", "B", 1000), ("64kib", "B", 65536),
    ("0", "GiB", 0),
])
def test_sizes_take_units_and_a_plain_number_in_the_flags_unit(text, plain_unit, want):
    assert parse_size(text, plain_unit) == want


@pytest.mark.parametrize("bad", ["4 parsecs", "GiB", "-1GiB", "4XB"])
def test_a_bad_size_is_an_error_naming_it(bad):
    with pytest.raises(ValueError, match="size"):
        parse_size(bad)


def test_swap_space_plain_number_is_gib_as_in_vllm_and_kv_memory_bytes():
    config = engine_config_from_args(_serve("--swap-space", "4", "--kv-cache-memory", "1000"))
    assert config.cache.swap_space == 4 << 30, "vLLM's --swap-space 4 means 4 GiB"
    assert config.cache.kv_cache_memory == 1000
    config = engine_config_from_args(_serve("--swap-space", "512MiB",
                                            "--kv-cache-memory-bytes", "2GiB"))
    assert (config.cache.swap_space, config.cache.kv_cache_memory) == (512 << 20, 2 << 30)
    with pytest.raises(SystemExit):
        _serve("--swap-space", "lots")


def test_python_api_takes_bytes_or_a_size_string():
    assert EngineConfig.from_kwargs(swap_space="1GiB").cache.swap_space == 1 << 30
    assert EngineConfig.from_kwargs(swap_space=4096).cache.swap_space == 4096


def test_vllm_names_are_accepted():
    args = _serve("--block-size", "32", "--num-gpu-blocks-override", "64", "-tp", "2",
                  "--max-num-seqs", "8", "--served-model-name", "mine",
                  "--enable-prefix-caching")
    config = engine_config_from_args(args)
    assert (config.cache.page_size, config.cache.num_pages) == (32, 64)
    assert config.parallel.tensor_parallel_size == 2
    assert config.scheduler.max_num_seqs == 8 and config.cache.enable_prefix_caching is True
    assert args.served_model_name == "mine"
    fraction = engine_config_from_args(_serve("--gpu-memory-utilization", "0.9"))
    assert fraction.cache.gpu_memory_utilization == 0.9


def test_gpu_memory_utilization_is_a_fraction_exclusive_with_explicit_sizes():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig.from_kwargs(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig.from_kwargs(gpu_memory_utilization=0.5, kv_cache_memory=1 << 20)


def test_serve_takes_the_model_as_a_positional_like_vllm():
    assert _serve("some/dir").model_tag == "some/dir"
    assert main(["serve", "a.gguf", "--model", "b.gguf"]) == 2, "two different models"


@pytest.mark.parametrize("group, name", [("cache", "enable_prefix_caching"),
                                         ("scheduler", "enable_chunked_prefill")])
def test_boolean_flags_have_a_no_form(group, name):
    flag = "--" + name.replace("_", "-")
    assert getattr(_serve(flag), name) is True
    assert getattr(_serve("--no-" + flag[2:]), name) is False
    assert getattr(_serve(), name) is None, "unset keeps EngineConfig's default"
    config = engine_config_from_args(_serve("--no-" + flag[2:]))
    assert getattr(getattr(config, group), name) is False


@pytest.mark.parametrize("argv, want", [
    (["serve", "--log-level", "debug"], "DEBUG"),
    (["--log-level", "WARNING", "serve"], "WARNING"),
    (["serve"], "INFO"),
    (["generate", "hi", "--log-level", "ERROR", "--log-format", "json"], "ERROR"),
    (["bench", "offline", "--log-level", "DEBUG"], "DEBUG"),
])
def test_log_level_works_before_or_after_the_subcommand(argv, want):
    assert build_parser().parse_args(argv).log_level == want


def _log_lines(level: str, fmt: str = "text") -> list[str]:
    stream = io.StringIO()
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        logging_setup.configure(level, fmt, stream)
        logging.getLogger("jax._src.xla_bridge").info("Unable to initialize backend 'tpu'")
        logging.getLogger("jax._src.xla_bridge").warning("a library warning")
        logging.getLogger("jaxserve.engine.builder").info("loading model")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    return stream.getvalue().splitlines()


def test_library_info_is_hidden_at_the_default_level_and_lines_carry_timestamps():
    lines = _log_lines("INFO")
    assert not any("Unable to initialize backend" in line for line in lines), lines
    assert any("a library warning" in line for line in lines), lines
    mine = [line for line in lines if "loading model" in line]
    assert mine and mine[0][:4].isdigit() and mine[0][10] == " ", f"no timestamp: {mine}"
    assert any("Unable to initialize" in line for line in _log_lines("DEBUG"))


def test_json_log_lines_are_objects_with_a_time():
    entries = [json.loads(line) for line in _log_lines("INFO", "json")]
    assert {"time", "level", "logger", "message"} <= set(entries[0])


def test_cli_sampling_defaults_are_sampling_params_defaults():
    from jaxserve.engine.generation_defaults import sampling_params
    from jaxserve.core.request import SamplingParams

    args = build_parser().parse_args(["generate", "hi"])
    assert sampling_params(cli_flags.sampling_overrides(args)) == SamplingParams()
    args = build_parser().parse_args(["generate", "hi", "--temperature", "0", "--stop", "x"])
    assert sampling_params(cli_flags.sampling_overrides(args)) == SamplingParams(
        temperature=0.0, stop=("x",))


def test_model_generation_config_applies_unless_a_flag_overrides_it(tmp_path):
    from jaxserve.engine.generation_defaults import read_generation_defaults, sampling_params

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 99, "eos_token_id": 2}))
    defaults = read_generation_defaults(str(tmp_path))
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 99}
    args = build_parser().parse_args(["generate", "hi", "--temperature", "0.2"])
    params = sampling_params(cli_flags.sampling_overrides(args), defaults)
    assert (params.temperature, params.top_p, params.max_tokens) == (0.2, 0.9, 99)
    assert read_generation_defaults("default") == {}


def test_docs_cli_mapping_table_is_the_one_made_from_the_config():
    doc = (ROOT / "docs" / "cli.md").read_text()
    assert cli_flags.mapping_table() in doc, (
        "docs/cli.md's flag table is stale: paste python -c 'from jaxserve.entrypoints.cli_flags import "
        "mapping_table; print(mapping_table())'")


def test_cpu_default_buckets_are_every_other_power_of_two():
    from jaxserve.runner.buckets import default_token_buckets, token_buckets_for

    assert token_buckets_for("cpu", 256) == (1, 4, 16, 64, 256)
    assert token_buckets_for("gpu", 256) == default_token_buckets(256)
    assert token_buckets_for("cpu", 100) == (1, 4, 16, 64, 100)
