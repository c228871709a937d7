"""The KV pool plan's memory accounting on mocked accelerators (engine/memory_profile.py,
engine/device_memory.py): gpu_memory_utilization is a share of the whole card, XLA's GPU
allocator limit (75% of the card unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise) is
checked against it, TPU pages are counted tile-padded, the TPU kernels' page table must fit
their 1 MiB of scalar memory, only this process's devices are read, and the step's
temporaries do not grow with the pool. The figures docs/accelerators.md states are these.

Beside the plan's own arithmetic, one check measures instead of recomputing: a real engine built
on the CPU against a mocked GPU budget places a KV pool whose arrays, with the bytes in use and
what the compiled largest step reports, fill the budget to within one page."""

from __future__ import annotations

import logging

import pytest

from jaxserve.config import EngineConfig
from jaxserve.engine import builder, device_memory, memory_profile
from jaxserve.model.device import defaults as device_defaults
from jaxserve.model.device.select import DeviceDescription
from jaxserve.runner.buckets import BucketTable
from pallas_kernels import tuning

GIB = 1 << 30
MIB = 1 << 20
H100_KIND = "NVIDIA H100 80GB HBM3"
# An 8B Llama's KV page (32 layers, 8 KV heads of 128, 16 tokens, bfloat16): 2 MiB unpadded.
LLAMA_8B = dict(num_layers=32, page_size=16, head_dim=128, dtype="bfloat16")
WEIGHTS = 16 * GIB                       # bytes_in_use once the 8B model's weights are placed
STEP = memory_profile.StepMemory((8192, 1024), temp_bytes=2 * GIB, output_bytes=0)


class FakeDevice:
    """What the plan reads of a JAX device: platform, kind, owner and memory_stats()."""

    def __init__(self, platform: str, kind: str, bytes_limit: int, bytes_in_use: int = WEIGHTS,
                 process_index: int = 0):
        self.platform, self.device_kind = platform, kind
        self.compute_capability = "9.0" if platform == "gpu" else None
        self.process_index = process_index
        self.stats = {"bytes_limit": bytes_limit, "bytes_in_use": bytes_in_use}

    def memory_stats(self):
        return dict(self.stats)


@pytest.fixture
def xla_env(monkeypatch):
    """The process environment with neither allocator fraction variable set (JAX's default),
    restored after the test; set(value) names XLA_PYTHON_CLIENT_MEM_FRACTION."""
    for name in (device_memory.FRACTION_VAR, device_memory.NEW_FRACTION_VAR,
                 device_memory.ALLOCATOR_VAR):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return lambda value: monkeypatch.setenv(device_memory.FRACTION_VAR, value)


def h100(fraction_of_card: float) -> FakeDevice:
    """An 80 GiB H100 whose allocator XLA sized at fraction_of_card of it."""
    return FakeDevice("gpu", H100_KIND, int(fraction_of_card * 80 * GIB))


def page_bytes(platform: str, heads_per_device: int = 8, num_devices: int = 1, **model) -> int:
    shape = {**LLAMA_8B, **model}
    return device_memory.kv_page_bytes(shape["num_layers"], shape["page_size"], heads_per_device,
                                       shape["head_dim"], shape["dtype"], platform, num_devices)


# ---- GPU: gpu_memory_utilization of the whole card ------------------------------------------

def test_the_card_is_bytes_limit_over_jax_default_fraction(xla_env):
    device = h100(0.75)
    assert device_memory.card_bytes(device, device.memory_stats()) == 80 * GIB
    assert memory_profile.device_memory_bytes(device) == 80 * GIB


def test_the_card_follows_the_fraction_the_environment_names(xla_env):
    xla_env("0.9")
    device = h100(0.9)
    assert device_memory.card_bytes(device, device.memory_stats()) == 80 * GIB


def test_an_environment_at_odds_with_bytes_limit_falls_back_to_the_table(xla_env):
    xla_env("0.5")  # changed after the backend started with JAX's 0.75
    device = h100(0.75)
    assert device_memory.card_bytes(device, device.memory_stats()) == 80 * GIB, (
        "bytes_limit / 0.5 would be 120 GiB, far from the H100's nominal 80 GiB")


def test_a_pool_of_the_whole_card_once_the_allocator_holds_the_fraction(xla_env, caplog):
    xla_env("0.9")
    with caplog.at_level(logging.WARNING):
        plan = memory_profile.plan_pool(0.9, [h100(0.9)], STEP, page_bytes("gpu"), 16, 8192,
                                        strict=True)
    assert page_bytes("gpu") == 2 * MIB
    assert plan.card_bytes == 80 * GIB and plan.budget_bytes == int(0.9 * 80 * GIB)
    assert plan.pool_bytes == int(0.9 * 80 * GIB) - WEIGHTS - STEP.reserve_bytes
    assert plan.num_pages == 27648, plan.describe()
    assert not caplog.records, "the allocator holds what was asked: nothing to warn about"


def test_a_default_fraction_beyond_the_allocator_warns_and_uses_bytes_limit(xla_env, caplog):
    with caplog.at_level(logging.WARNING):
        plan = memory_profile.plan_pool(0.9, [h100(0.75)], STEP, page_bytes("gpu"), 16, 8192)
    assert plan.budget_bytes == 60 * GIB, "capped at what XLA's allocator holds"
    assert plan.pool_bytes == 60 * GIB - WEIGHTS - STEP.reserve_bytes
    assert plan.num_pages == 21504
    for name in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "gpu_memory_utilization=0.9",
                 "72.00 GiB", "60.00 GiB", "gpu_memory_utilization=0.75"):
        assert name in caplog.text, f"the warning does not say {name!r}: {caplog.text}"


def test_an_explicit_fraction_beyond_the_allocator_is_refused(xla_env):
    with pytest.raises(ValueError) as err:
        memory_profile.plan_pool(0.9, [h100(0.75)], STEP, page_bytes("gpu"), 16, 8192,
                                 strict=True)
    message = str(err.value)
    for name in ("XLA_PYTHON_CLIENT_MEM_FRACTION=0.9", "gpu_memory_utilization=0.9",
                 "JAX's default 0.75"):
        assert name in message, message


def test_claim_sets_the_allocator_fraction_and_preallocation():
    environ = {}
    assert device_memory.claim_device_memory(0.9, environ) == environ == {
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9", "XLA_PYTHON_CLIENT_PREALLOCATE": "true"}


def test_claim_keeps_what_the_environment_sets():
    environ = {"XLA_CLIENT_MEM_FRACTION": "0.5", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    assert device_memory.claim_device_memory(0.9, environ) == {}, (
        "JAX refuses both fraction spellings at once; a given one stays")
    assert device_memory.claim_device_memory(None, {}) == {}, "an explicit pool claims nothing"


@pytest.mark.parametrize("flags, fraction", [
    ([], 0.9),
    (["--gpu-memory-utilization", "0.8"], 0.8),
    (["--num-pages", "64"], None),
])
def test_the_cli_claims_the_engine_fraction_before_the_backend_starts(monkeypatch, flags,
                                                                      fraction):
    from jaxserve.entrypoints import cli

    claimed = []
    monkeypatch.setattr(device_memory, "claim_device_memory", claimed.append)
    cli._claim_device_memory(cli.build_parser().parse_args(["serve", "some/model", *flags]))
    assert claimed == [fraction]


# ---- the chip table on the card's memory --------------------------------------------------

@pytest.mark.parametrize("kind, card_gib, name", [
    ("NVIDIA A100-SXM4-80GB", 80, "A100 80GB"),
    ("NVIDIA A100 80GB PCIe", 80, "A100 80GB"),
    ("NVIDIA A100-SXM4-40GB", 40, "A100 40GB"),
    ("NVIDIA A100-SXM4", 80, "A100 80GB"),      # a kind without its size: the card decides
    ("NVIDIA A100-SXM4", 40, "A100 40GB"),
    ("NVIDIA GH200 480GB", 96, "GPU >= 70 GiB"),  # not the H200
    ("NVIDIA H200", 141, "H200"),
])
def test_the_chip_is_found_from_the_card_not_the_allocator_limit(xla_env, kind, card_gib,
                                                                 name):
    device = FakeDevice("gpu", kind, int(0.75 * card_gib * GIB))
    memory = memory_profile.device_memory_bytes(device)
    assert memory == card_gib * GIB
    assert device_defaults.chip(DeviceDescription("gpu", kind, "8.0"), memory).name == name


# ---- TPU: tile-padded pages, 1 MiB of scalar memory ----------------------------------------

@pytest.mark.parametrize("heads, head_dim, devices, dtype, factor", [
    (8, 128, 1, "bfloat16", 2),   # 8 heads fill half of bfloat16's 16-row tile
    (16, 64, 1, "bfloat16", 2),   # head_dim 64 fills half of the 128 lanes
    (16, 128, 1, "bfloat16", 1),
    (8, 128, 1, "float32", 1),
    (1, 128, 8, "bfloat16", 16),  # one KV head per device under tensor parallelism
])
def test_tpu_pages_are_counted_with_their_tile_padding(heads, head_dim, devices, dtype, factor):
    padded = page_bytes("tpu", heads, devices, head_dim=head_dim, dtype=dtype)
    plain = page_bytes("gpu", heads, devices, head_dim=head_dim, dtype=dtype)
    assert padded == factor * plain, f"padding x{padded / plain}, want x{factor}"


def test_a_tpu_pool_holds_the_pages_that_fit_padded(xla_env):
    tpu = FakeDevice("tpu", "TPU v6 lite", 32 * GIB)
    step = memory_profile.StepMemory((1024, 256), temp_bytes=GIB, output_bytes=0)
    plan = memory_profile.plan_pool(0.9, [tpu], step, page_bytes("tpu"), 16, 8192)
    assert plan.card_bytes == 32 * GIB, "a TPU's bytes_limit is the whole device"
    free = int(0.9 * 32 * GIB) - WEIGHTS - GIB
    assert page_bytes("tpu") == 4 * MIB
    assert plan.num_pages == free // (4 * MIB) == 3020, plan.describe()
    assert free // (2 * MIB) == 6041, "what unpadded pages would have promised"


def smem_need(max_num_seqs: int, max_model_len: int) -> int:
    """The v6e defaults' buckets (1024 tokens, page 16) for an 8B Llama (4 heads per KV head)."""
    buckets = BucketTable.build(1024, max_num_seqs, max_model_len, 16)
    sizes = tuning.block_sizes("tpu")
    return device_memory.check_tpu_scalar_memory(
        buckets.shapes(), buckets.max_pages_per_request, 16, max_model_len, max_num_seqs,
        tuning.tokens_per_block(4, sizes.q_block_rows), sizes.max_kv_splits)


def test_a_page_table_that_fills_tpu_scalar_memory_is_refused():
    with pytest.raises(ValueError) as err:
        smem_need(256, 16384)
    message = str(err.value)
    for text in ("max_num_seqs=256", "max_model_len=16384", "256 x 1024 int32 page table "
                 "(1048576 bytes)", "1054340 bytes in all"):
        assert text in message, message


def test_half_the_sequences_or_context_fit_tpu_scalar_memory():
    assert smem_need(128, 16384) == 4 * (1 + 128 * 1024 + 5 * (1024 // 32 + 128)) == 527492
    assert smem_need(256, 8192) == 4 * (1 + 256 * 512 + 5 * (1024 // 32 + 256)) == 530052


class TpuDevice:
    platform, device_kind, compute_capability = "tpu", "TPU v6 lite", None


def test_start_up_checks_scalar_memory_on_a_tpu_only():
    from tiny_models import tiny_config

    config = EngineConfig.from_kwargs(max_num_seqs=256, max_num_batched_tokens=1024,
                                      max_model_len=16384, page_size=16)
    with pytest.raises(ValueError, match="max_model_len=16384"):
        builder.check_scalar_memory(tiny_config(), config, 16384, "auto", TpuDevice())
    builder.check_scalar_memory(tiny_config(), config.replace(attention_impl="reference"),
                                16384, "auto", TpuDevice())  # the XLA path reads no SMEM


# ---- several processes, and what grows with the pool --------------------------------------

class RemoteDevice(FakeDevice):
    def memory_stats(self):
        raise AssertionError("read another host's device")


def test_only_this_process_devices_are_read_and_the_pool_spans_all(xla_env):
    tpus = [FakeDevice("tpu", "TPU v6 lite", 32 * GIB) for _ in range(2)]
    remote = [RemoteDevice("tpu", "TPU v6 lite", 32 * GIB, process_index=1) for _ in range(2)]
    local = memory_profile.local_devices(tpus + remote, process_index=0)
    assert local == tpus
    step = memory_profile.StepMemory((1024, 256), temp_bytes=GIB, output_bytes=0)
    plan = memory_profile.plan_pool(0.9, local, step, page_bytes("tpu", 2, 4), 16, 8192,
                                    num_devices=4)
    assert plan.pool_bytes == 4 * (int(0.9 * 32 * GIB) - WEIGHTS - GIB)


def test_the_step_temporaries_do_not_grow_with_the_pool():
    from jaxserve.runner.model_runner import ModelRunner
    from tiny_models import tiny_model

    model_config, params = tiny_model()
    temps = {}
    for num_pages in (2, 64):
        runner = ModelRunner(model_config, params, num_pages=num_pages, page_size=16,
                             max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
                             token_buckets=(16,), layer_loop="scan")
        step = memory_profile.StepMemory.of(*runner.profile_step_memory())
        temps[num_pages] = step.reserve_bytes
    assert temps[2] == temps[64], f"temporaries by pool size: {temps}"


def test_the_pool_start_up_places_fills_the_budget_as_its_arrays_measure_it(xla_env,
                                                                             monkeypatch):
    """Measured, not recomputed: the bytes of the KV arrays the engine allocated (not the
    plan's page size) plus the bytes in use plus the largest step's memory_analysis() fit
    gpu_memory_utilization x the card, and less than one more page would be left over."""
    import jax
    from tiny_models import tiny_loaded

    xla_env("0.9")
    card, in_use = 64 * MIB, 3 * MIB
    monkeypatch.setattr(device_memory, "platform_of", lambda device: "gpu")
    monkeypatch.setattr(memory_profile, "memory_stats", lambda device: {
        "bytes_limit": int(0.9 * card), "bytes_in_use": in_use})
    config = EngineConfig.from_kwargs(gpu_memory_utilization=0.9, max_num_seqs=4,
                                      max_num_batched_tokens=32, token_buckets=(16, 32),
                                      max_model_len=128, page_size=16)
    runner = builder.build_engine(config, loaded=tiny_loaded(), progress=False).runner
    kv_bytes = sum(a.nbytes for a in jax.tree.leaves(runner.kv))
    page = kv_bytes // runner.num_pages
    step = memory_profile.StepMemory.of(*runner.profile_step_memory())
    used = in_use + kv_bytes + step.reserve_bytes
    budget = int(0.9 * card)
    assert used <= budget, (f"{runner.num_pages} pages of {page} bytes, {in_use} in use and "
                            f"{step.reserve_bytes} for the step overflow {budget}")
    assert budget - used < page, f"{budget - used} bytes left unused, pages are {page} bytes"


def test_start_up_refuses_an_explicit_fraction_the_allocator_cannot_hold(xla_env, monkeypatch):
    """A tiny model on the CPU whose device reads as a GPU with JAX's default allocator."""
    from tiny_models import tiny_loaded

    card = 256 * MIB
    monkeypatch.setattr(device_memory, "platform_of", lambda device: "gpu")
    monkeypatch.setattr(memory_profile, "memory_stats", lambda device: {
        "bytes_limit": int(0.75 * card), "bytes_in_use": 3 * MIB})
    config = EngineConfig.from_kwargs(gpu_memory_utilization=0.9, max_num_seqs=4,
                                      max_num_batched_tokens=32, token_buckets=(16, 32),
                                      max_model_len=128, page_size=16)
    with pytest.raises(ValueError) as err:
        builder.build_engine(config, loaded=tiny_loaded(), progress=False)
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.9" in str(err.value), str(err.value)
