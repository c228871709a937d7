"""EngineConfig groups its settings (config.cache.page_size, config.scheduler.max_num_seqs, ...)
while the CLI flags and LLM(...) keywords stay flat: every flat name is one field of one group,
and a flag given on the command line lands in that field."""

from __future__ import annotations

import dataclasses

import pytest

from jaxserve.config import GROUPS, CacheConfig, EngineConfig
from jaxserve.entrypoints.cli import build_parser
from jaxserve.entrypoints.cli_flags import engine_config_from_args

# flat name -> (command-line tokens, the value the group field must hold); every one differs
# from its default and is valid on its own
CLI_VALUES = {
    "model": (["--model", "some/dir"], "some/dir"),
    "revision": (["--revision", "v1.0"], "v1.0"),
    "dtype": (["--dtype", "bfloat16"], "bfloat16"),
    "cache_quantized_weights": (["--no-cache-quantized-weights"], False),
    "max_model_len": (["--max-model-len", "512"], 512),
    "quantization": (["--quantization", "int8"], "int8"),
    "seed": (["--seed", "7"], 7),
    "page_size": (["--block-size", "32"], 32),
    "num_pages": (["--num-pages", "64"], 64),
    "kv_cache_memory": (["--kv-cache-memory", "2MiB"], 2 << 20),
    "gpu_memory_utilization": (["--gpu-memory-utilization", "0.5"], 0.5),
    "swap_space": (["--swap-space", "1"], 1 << 30),
    "host_prefix_cache_size": (["--host-prefix-cache-size", "1MiB"], 1 << 20),
    "enable_prefix_caching": (["--no-enable-prefix-caching"], False),
    "kv_events_config": (["--kv-events-config", '{"enable_kv_cache_events": true}'],
                         '{"enable_kv_cache_events": true}'),
    "kv_cache_dtype": (["--kv-cache-dtype", "fp8"], "fp8"),
    "calculate_kv_scales": (["--calculate-kv-scales", "--kv-cache-dtype", "fp8"], True),
    "max_num_seqs": (["--max-num-seqs", "8"], 8),
    "max_num_batched_tokens": (["--max-num-batched-tokens", "512"], 512),
    "preemption_mode": (["--preemption-mode", "swap"], "swap"),
    "enable_chunked_prefill": (["--no-enable-chunked-prefill"], False),
    "batching": (["--batching", "static"], "static"),
    "async_scheduling": (["--no-async-scheduling"], False),
    "max_queued_requests": (["--max-queued-requests", "3"], 3),
    "max_queued_requests_per_key": (["--max-queued-requests-per-key", "5"], 5),
    "tensor_parallel_size": (["-tp", "2"], 2),
    "enable_expert_parallel": (["--enable-expert-parallel"], True),
    "expert_parallel_size": (["-tp", "4", "--enable-expert-parallel",
                              "--expert-parallel-size", "2"], 2),
    "speculative_method": (["--speculative-method", "ngram", "--num-speculative-tokens", "2"],
                           "ngram"),
    "num_speculative_tokens": (["--num-speculative-tokens", "3"], 3),
    "speculative_draft": (["--speculative-method", "draft", "--num-speculative-tokens", "2",
                           "--speculative-draft", "layers:1"], "layers:1"),
    "speculative_ngram_min": (["--speculative-ngram-min", "2"], 2),
    "speculative_ngram_max": (["--speculative-ngram-max", "8"], 8),
    "speculative_disable_by_batch_size": (["--speculative-disable-by-batch-size", "4"], 4),
    "attention_impl": (["--attention-impl", "reference"], "reference"),
    "layer_loop": (["--layer-loop", "scan"], "scan"),
    "int8_activations": (["--int8-activations", "off"], "off"),
    "dequant_form": (["--dequant-form", "fused"], "fused"),
    "token_buckets": (["--token-buckets", "8", "2", "8"], (2, 8)),
    "seq_buckets": (["--seq-buckets", "4", "1"], (1, 4)),
    "compile_cache_dir": (["--compile-cache-dir", ""], ""),
    "xla_cpu_nice": (["--xla-cpu-nice", "0"], 0),
    "cpu_kernels": (["--cpu-kernels", "off"], "off"),
    "cpu_kernel_cache_dir": (["--cpu-kernel-cache-dir", "/srv/kernels"], "/srv/kernels"),
    "cpu_kernel_compiler": (["--cpu-kernel-compiler", "clang++"], "clang++"),
    "enable_lora": (["--enable-lora"], True),
    "lora_modules": (["--enable-lora", "--lora-modules", "a=/x"], ("a=/x",)),
    "max_loras": (["--max-loras", "3"], 3),
    "max_cpu_loras": (["--max-cpu-loras", "4"], 4),
    "max_lora_rank": (["--max-lora-rank", "64"], 64),
}


def test_every_flat_keyword_is_one_field_of_one_group():
    owners: dict[str, list[str]] = {}
    for group, cls in GROUPS.items():
        for f in dataclasses.fields(cls):
            owners.setdefault(f.name, []).append(group)
    shared = {name: groups for name, groups in owners.items() if len(groups) > 1}
    assert not shared, f"settings in more than one group: {shared}"
    assert [s.field.name for s in EngineConfig.settings()] == list(owners)
    assert set(CLI_VALUES) == set(owners), (
        f"CLI_VALUES lacks {sorted(set(owners) - set(CLI_VALUES))}, "
        f"has unknown {sorted(set(CLI_VALUES) - set(owners))}")


@pytest.mark.parametrize("name", list(CLI_VALUES))
def test_a_flag_lands_in_its_group_field_and_round_trips(name):
    tokens, want = CLI_VALUES[name]
    config = engine_config_from_args(build_parser().parse_args(["serve", *tokens]))
    group = {s.field.name: s.group for s in EngineConfig.settings()}[name]
    got = getattr(getattr(config, group), name)
    assert got == want, f"{' '.join(tokens)}: config.{group}.{name} is {got!r}, not {want!r}"
    flat = config.as_kwargs()
    assert EngineConfig.from_kwargs(**flat) == config, "as_kwargs -> from_kwargs changed it"
    defaults = EngineConfig().as_kwargs()
    changed = {k for k, v in flat.items() if v != defaults[k]}
    companions = {"speculative_method", "num_speculative_tokens",  # what the flag needs
                  "enable_expert_parallel", "tensor_parallel_size", "enable_lora",
                  "kv_cache_dtype"}
    assert name in changed and changed <= {name} | companions, (
        f"{' '.join(tokens)} changed {sorted(changed)}")


def test_from_kwargs_refuses_unknown_settings_naming_them():
    with pytest.raises(TypeError, match="unknown engine setting.*block_size.*pages"):
        EngineConfig.from_kwargs(block_size=16, pages=4, page_size=16)


def test_groups_are_the_only_attributes_and_take_group_objects():
    config = EngineConfig.from_kwargs(page_size=32, max_num_seqs=4)
    assert (config.cache.page_size, config.scheduler.max_num_seqs) == (32, 4)
    assert not hasattr(config, "page_size"), "flat reads are gone: read config.cache.page_size"
    with pytest.raises(TypeError, match="ModelSettings.*from_kwargs"):
        EngineConfig(model="x")
    assert EngineConfig(cache=CacheConfig(page_size=32)).validate().cache.page_size == 32


def test_replace_takes_flat_settings_and_validates():
    config = EngineConfig.from_kwargs(num_pages=64)
    assert config.replace(page_size=8).cache == CacheConfig(page_size=8, num_pages=64)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        config.replace(kv_cache_memory=1 << 20)


def test_each_group_validates_its_own_settings():
    with pytest.raises(ValueError, match="page_size=12 is invalid: must be a power of two"):
        CacheConfig(page_size=12).validate()
    with pytest.raises(ValueError, match="max_num_batched_tokens=4 .*>= max_num_seqs \\(8\\)"):
        EngineConfig.from_kwargs(max_num_seqs=8, max_num_batched_tokens=4)


def test_calculate_kv_scales_without_fp8_pages_is_refused_naming_both():
    with pytest.raises(ValueError, match="calculate_kv_scales.*kv_cache_dtype='auto'"):
        EngineConfig.from_kwargs(calculate_kv_scales=True)
    EngineConfig.from_kwargs(calculate_kv_scales=True, kv_cache_dtype="fp8")
