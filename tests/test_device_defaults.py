"""Per-device defaults (model/device/defaults.py) on mocked devices, and the KV pool sized from a
given device-memory figure and the real memory_analysis() of a tiny model's largest bucket
(engine/memory_profile.py), refused before serving when it can't fit."""

from __future__ import annotations

import logging

import pytest

from jaxserve.config import EngineConfig
from jaxserve.engine import builder, memory_profile
from jaxserve.model.device import defaults as device_defaults
from jaxserve.model.device.select import DeviceDescription
from jaxserve.runner.buckets import token_buckets_for

GIB = 1 << 30
H100 = DeviceDescription("gpu", "NVIDIA H100 80GB HBM3", "9.0")
GPU_POWERS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048)


@pytest.mark.parametrize("device, memory, name, seqs, tokens, buckets", [
    (H100, 80 * GIB, "H100 SXM", 1024, 8192, GPU_POWERS + (4096, 8192)),
    (DeviceDescription("gpu", "NVIDIA H200", "9.0"), 141 * GIB, "H200", 1024, 8192,
     GPU_POWERS + (4096, 8192)),
    (DeviceDescription("gpu", "NVIDIA A100-SXM4-40GB", "8.0"), 40 * GIB, "A100 40GB", 256,
     2048, GPU_POWERS),
    (DeviceDescription("gpu", "NVIDIA A100-SXM4-80GB", "8.0"), 80 * GIB, "A100 80GB", 256,
     2048, GPU_POWERS),
    (DeviceDescription("gpu", "NVIDIA L4", "8.9"), 22 * GIB, "L4", 256, 2048, GPU_POWERS),
    (DeviceDescription("gpu", "Tesla T4", "7.5"), 15 * GIB, "T4", 256, 2048, GPU_POWERS),
    (DeviceDescription("gpu", "NVIDIA L40S", "8.9"), 45 * GIB, "GPU", 256, 2048, GPU_POWERS),
    (DeviceDescription("gpu", "NVIDIA B200", "10.0"), 180 * GIB, "GPU >= 70 GiB", 1024, 8192,
     GPU_POWERS + (4096, 8192)),
    (DeviceDescription("tpu", "TPU v5 lite"), 16 * GIB, "TPU v5e", 256, 512,
     (16, 32, 64, 128, 256, 512)),
    (DeviceDescription("tpu", "TPU v6 lite"), 32 * GIB, "TPU v6e", 256, 1024,
     (16, 32, 64, 128, 256, 512, 1024)),
])
def test_each_device_class_gets_its_defaults(device, memory, name, seqs, tokens, buckets):
    assert device_defaults.chip(device, memory).name == name
    config, choices = device_defaults.apply(EngineConfig.from_kwargs(), device, memory)
    assert config.scheduler.max_num_seqs == seqs
    assert config.scheduler.max_num_batched_tokens == tokens
    assert config.runner.token_buckets == buckets
    assert config.cache.gpu_memory_utilization == 0.9
    chosen = {c.field: c for c in choices}
    assert set(chosen) == {"max_num_seqs", "max_num_batched_tokens", "token_buckets",
                           "gpu_memory_utilization"}
    assert all(c.default and name in c.reason for c in choices), choices


def test_the_cpu_keeps_todays_defaults():
    given = EngineConfig.from_kwargs()
    config, choices = device_defaults.apply(given, DeviceDescription("cpu", "cpu"), None)
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (16, 256)
    assert config.runner.token_buckets == token_buckets_for("cpu", 256) == (1, 4, 16, 64, 256)
    assert config.cache.gpu_memory_utilization is None
    assert config.cache == given.cache and config.scheduler == given.scheduler


def test_explicit_settings_are_kept_and_only_unset_ones_take_the_device_default():
    config, choices = device_defaults.apply(
        EngineConfig.from_kwargs(max_num_seqs=16), H100, 80 * GIB)
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (16, 8192)
    assert {c.field: c.default for c in choices}["max_num_seqs"] is False
    # a smaller token budget given: the sequences default is capped to it
    config, _ = device_defaults.apply(
        EngineConfig.from_kwargs(max_num_batched_tokens=64), H100, 80 * GIB)
    assert (config.scheduler.max_num_seqs, config.runner.token_buckets) == (64, (1, 4, 16, 32, 64))
    config, _ = device_defaults.apply(
        EngineConfig.from_kwargs(token_buckets=(8, 8192)), H100, 80 * GIB)
    assert config.runner.token_buckets == (8, 8192)
    # a pool sized explicitly: no memory fraction on top of it
    config, _ = device_defaults.apply(
        EngineConfig.from_kwargs(kv_cache_memory=1 << 30), H100, 80 * GIB)
    assert config.cache.gpu_memory_utilization is None and config.cache.kv_cache_memory == 1 << 30
    # an explicit value equal to the CPU default still counts as given
    given = EngineConfig.from_kwargs(max_num_seqs=16, max_num_batched_tokens=256)
    config, _ = device_defaults.apply(given, H100, 80 * GIB)
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (16, 256)
    # replace() keeps what was explicit and adds its changes
    changed = given.replace(page_size=32)
    assert changed.is_explicit("max_num_seqs") and changed.is_explicit("page_size")
    assert not changed.is_explicit("gpu_memory_utilization")
    assert EngineConfig.from_kwargs(**given.as_kwargs()) == given


def test_cli_flags_are_explicit_and_unset_flags_are_not():
    from jaxserve.entrypoints.cli import build_parser
    from jaxserve.entrypoints.cli_flags import engine_config_from_args

    args = build_parser().parse_args(["serve", "--max-num-seqs", "16"])
    config = engine_config_from_args(args)
    assert config.is_explicit("max_num_seqs")
    assert not config.is_explicit("max_num_batched_tokens")
    resolved, _ = device_defaults.apply(config, H100, 80 * GIB)
    assert (resolved.scheduler.max_num_seqs, resolved.scheduler.max_num_batched_tokens) == (
        16, 8192)


def test_plan_pool_subtracts_the_weights_and_one_step():
    class Device:
        def memory_stats(self):
            return {"bytes_limit": 10 * GIB, "bytes_in_use": 2 * GIB}

    step = memory_profile.StepMemory((32, 4), temp_bytes=GIB, output_bytes=0)
    plan = memory_profile.plan_pool(0.5, [Device(), Device()], step, bytes_per_page=1 << 20,
                                    page_size=16, max_model_len=128)
    assert plan.pool_bytes == 2 * (5 * GIB - 2 * GIB - GIB)
    assert plan.num_pages == plan.pool_bytes >> 20
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.3"):
        memory_profile.plan_pool(0.3, [Device()], step, 1 << 20, 16, 128)
    assert memory_profile.plan_pool(0.5, [object()], step, 1 << 20, 16, 128) is None


# Engine-level: a tiny model on the CPU pretending to be an H100 of a given memory size.
SMALL = dict(max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(16, 32),
             max_model_len=128, page_size=16)


@pytest.fixture
def fake_h100(monkeypatch):
    """The CPU device with `memory["stats"]` as its memory figures, taking an H100's defaults
    (its kernels and dtype stay the CPU's: only the defaults table sees the H100)."""
    memory = {"stats": None}
    real_apply = device_defaults.apply
    monkeypatch.setattr(memory_profile, "memory_stats", lambda device: memory["stats"])
    monkeypatch.setattr(device_defaults, "apply",
                        lambda config, device, memory_bytes: real_apply(config, H100,
                                                                        memory_bytes))
    return memory


def _build(**settings):
    from tiny_models import tiny_loaded

    return builder.build_engine(EngineConfig.from_kwargs(**settings), loaded=tiny_loaded(),
                                progress=False)


def test_pool_is_what_the_fraction_leaves_after_weights_and_the_largest_step(fake_h100, caplog):
    in_use = 3 << 20
    fake_h100["stats"] = {"bytes_limit": 256 << 20, "bytes_in_use": in_use}
    with caplog.at_level(logging.INFO):
        parts = _build(**SMALL)
    config = parts.config
    assert config.cache.gpu_memory_utilization == 0.9, "the H100 default fraction"
    assert config.scheduler.max_num_seqs == 4, "explicit settings kept"
    runner = parts.runner
    largest = max(runner.buckets.shapes())
    assert largest == (32, 4)
    stats = runner.step._executables[largest].memory_analysis()  # the real executable's
    assert stats.temp_size_in_bytes > 0
    reserve = stats.temp_size_in_bytes + max(0, stats.output_size_in_bytes
                                             - stats.alias_size_in_bytes)
    page_bytes = 16 * parts.model_config.kv_bytes_per_token(4)
    want = (int(0.9 * (256 << 20)) - in_use - reserve) // page_bytes
    assert parts.info.num_pages == want == runner.num_pages
    assert runner.kv[0].shape[1] == want, "the pool the runner holds has that many pages"
    assert "for one step of the largest bucket (T, S)=(32, 4)" in caplog.text
    text = LLMText(parts).greedy([5, 6, 7])
    assert len(text) == 4, "the engine serves on the resized pool"


class LLMText:
    """Greedy tokens through an Engine built from parts."""

    def __init__(self, parts):
        from jaxserve.engine.engine import Engine

        self.engine = Engine(parts.config, parts=parts)

    def greedy(self, prompt) -> list[int]:
        from jaxserve.core.request import SamplingParams

        self.engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.0,
                                                       ignore_eos=True))
        tokens = []
        while self.engine.has_unfinished():
            tokens += [t for o in self.engine.step() for t in o.new_token_ids]
        self.engine.close()
        return tokens


def test_a_model_that_cannot_fit_is_refused_before_serving(fake_h100):
    from jaxserve.entrypoints.llm import LLM
    from tiny_models import tiny_loaded

    fake_h100["stats"] = {"bytes_limit": 4 << 20, "bytes_in_use": (36 << 20) // 10}
    with pytest.raises(ValueError) as err:
        LLM(loaded=tiny_loaded(), progress=False, **SMALL)
    message = str(err.value)
    for setting in ("gpu_memory_utilization=0.9", "max_num_batched_tokens", "max_model_len"):
        assert setting in message, message
