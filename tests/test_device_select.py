"""The device selection table (jaxserve/model/device/select.py) with the device description
mocked as JAX reports it, the refusal of an explicit choice the device can't run, the model
shape's part on Hopper (model/device/kernel_fit.py: fewer decode splits or the XLA path), and the
engine entry points (resolve_attention_impl, get_attention, resolve_dtype) on this CPU."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from types import SimpleNamespace

import jax.numpy as jnp
import pytest

from conftest import make_llm
from jaxserve.model.decoder.attention import (AttentionShape, PallasAttention, XlaAttention,
                                      get_attention, resolve_attention_impl)
from jaxserve.model.device import select as device_select
from jaxserve.model.device.select import DeviceDescription, select
from jaxserve.model.device.kernel_fit import KernelShape
from jaxserve.runner.model_runner import resolve_dtype

# (platform, device_kind, compute_capability) as jax.devices()[0] reports them
DEVICES = {
    "T4": DeviceDescription("gpu", "Tesla T4", "7.5"),
    "L4": DeviceDescription("gpu", "NVIDIA L4", "8.9"),
    "A100": DeviceDescription("gpu", "NVIDIA A100-SXM4-40GB", "8.0"),
    "H100": DeviceDescription("gpu", "NVIDIA H100 80GB HBM3", "9.0"),
    "TPU v5e": DeviceDescription("tpu", "TPU v5 lite"),
    "TPU v6e": DeviceDescription("tpu", "TPU v6 lite"),
    "CPU": DeviceDescription("cpu", "cpu"),
}

EXPECTED = {  # name -> (attention_impl, dtype) for "auto"
    "T4": ("xla", "float16"),
    "L4": ("xla", "bfloat16"),
    "A100": ("xla", "bfloat16"),
    "H100": ("pallas", "bfloat16"),
    "TPU v5e": ("pallas", "bfloat16"),
    "TPU v6e": ("pallas", "bfloat16"),
    "CPU": ("reference", "float32"),
}


@pytest.mark.parametrize("name", list(DEVICES))
def test_auto_picks_the_tables_attention_and_dtype(name):
    chosen = select(device=DEVICES[name])
    assert (chosen.attention_impl, chosen.dtype) == EXPECTED[name], \
        f"{name}: got {chosen.attention_impl}, {chosen.dtype}:\n{chosen.describe()}"
    assert chosen.attention_reason and chosen.dtype_reason, "every choice carries its reason"


def test_a_pre_hopper_gpu_says_why_it_runs_the_xla_path():
    chosen = select(device=DEVICES["T4"])
    assert "sm_75" in chosen.attention_reason and "Hopper" in chosen.attention_reason
    assert "bfloat16 would be emulated" in chosen.dtype_reason


def test_blackwell_does_not_get_the_wgmma_kernel():
    chosen = select(device=DeviceDescription("gpu", "NVIDIA B200", "10.0"))
    assert (chosen.attention_impl, chosen.dtype) == ("xla", "bfloat16")
    assert "WGMMA" in chosen.attention_reason


def test_a_gpu_without_tensor_cores_gets_float32():
    chosen = select(device=DeviceDescription("gpu", "Tesla P100-PCIE-16GB", "6.0"))
    assert chosen.dtype == "float32", chosen.describe()


def test_rocm_runs_the_xla_path_in_bfloat16():
    chosen = select(device=DeviceDescription("gpu", "AMD Instinct MI250X", "gfx90a"))
    assert (chosen.attention_impl, chosen.dtype) == ("xla", "bfloat16")


@pytest.mark.parametrize("name", ["T4", "L4", "A100", "CPU"])
def test_explicit_pallas_where_the_kernel_cannot_run_is_a_value_error(name):
    with pytest.raises(ValueError, match=r"attention_impl='pallas' can't run on") as error:
        select(attention_impl="pallas", device=DEVICES[name])
    assert DEVICES[name].device_kind in str(error.value), "the error names the device"


@pytest.mark.parametrize("name", ["H100", "TPU v5e", "TPU v6e"])
def test_explicit_pallas_where_the_kernel_runs_is_kept(name):
    assert select(attention_impl="pallas", device=DEVICES[name]).attention_impl == "pallas"


def test_float32_on_a_hopper_gpu_runs_the_xla_path_the_kernel_takes_16_bit_only():
    chosen = select(dtype="float32", device=DEVICES["H100"])
    assert chosen.attention_impl == "xla", chosen.describe()
    with pytest.raises(ValueError, match=r"attention_impl='pallas' can't run on .*float32"):
        select(attention_impl="pallas", dtype="float32", device=DEVICES["H100"])


def test_explicit_bfloat16_on_a_t4_is_a_value_error_naming_dtype():
    with pytest.raises(ValueError, match=r"dtype='bfloat16' can't run natively on Tesla T4"):
        select(dtype="bfloat16", device=DEVICES["T4"])


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_explicit_float16_and_float32_on_a_t4_are_kept(dtype):
    assert select(dtype=dtype, device=DEVICES["T4"]).dtype == dtype


@pytest.mark.parametrize("name", list(DEVICES))
def test_interpret_mode_and_reference_run_everywhere(name):
    for impl in ("reference", "xla", "pallas-interpret"):
        assert select(attention_impl=impl, device=DEVICES[name]).attention_impl == impl


def test_unknown_names_are_value_errors_naming_the_field():
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        select(attention_impl="flash", device=DEVICES["CPU"])
    with pytest.raises(ValueError, match="dtype must be one of"):
        select(dtype="float8", device=DEVICES["CPU"])


def test_description_reads_jax_device_attributes():
    cuda = SimpleNamespace(platform="gpu", device_kind="Tesla T4", compute_capability="7.5")
    assert DeviceDescription.from_device(cuda) == DEVICES["T4"]
    assert DeviceDescription.from_device(SimpleNamespace(platform="cpu", device_kind="cpu")) \
        == DEVICES["CPU"]
    assert str(DEVICES["T4"]) == "Tesla T4 (gpu, sm_75)"


def test_this_cpu_resolves_to_reference_and_float32_and_logs_why_once(caplog):
    device_select._logged.clear()  # each choice is logged once per process
    with caplog.at_level(logging.INFO, logger="jaxserve.model.device.select"):
        assert resolve_attention_impl("auto", "cpu") == "reference"
        assert resolve_dtype("auto", "cpu") is jnp.float32
        assert resolve_attention_impl("reference", "cpu") == "reference"  # re-resolved
    lines = caplog.text.splitlines()
    assert sum("attention_impl=reference on cpu (cpu)" in line for line in lines) == 1, lines
    assert sum("dtype=float32 on cpu (cpu)" in line for line in lines) == 1, lines
    assert "chosen explicitly" not in caplog.text, "the runner's own choice is logged as auto's"


def test_explicit_pallas_on_this_cpu_fails_before_any_kernel_is_built():
    shape = AttentionShape(group=2, num_kv_heads=2, page_size=16)
    with pytest.raises(ValueError, match="attention_impl='pallas' can't run on cpu"):
        get_attention("pallas", shape)


@pytest.mark.parametrize("setting", [{"attention_impl": "pallas"}, {"attention_impl": "flash"},
                                     {"dtype": "float8"}])
def test_an_engine_with_a_choice_this_cpu_cannot_run_fails_with_the_field_named(setting):
    field = next(iter(setting))
    with pytest.raises(ValueError, match=field):
        make_llm(**setting)


@pytest.mark.parametrize("name,paths", [("T4", ["reference"]), ("A100", ["reference"]),
                                        ("H100", ["reference", "pallas"])])
def test_gpu_check_times_every_path_the_selection_allows(name, paths):
    gpu_check = _gpu_check()
    chosen = select(device=DEVICES[name])
    got = list(gpu_check.kernel_paths(chosen, on_gpu=True, interpret=False, sm_scale=0.1))
    assert got == paths, f"{name}: gpu_check would run {got}"


def _gpu_check():
    script = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", script)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    return gpu_check


def test_gpu_check_decode_rates_time_every_request_decoding():
    """gpu_check's decode tokens/s: each timed step returns one token of each of the N
    requests (none has ended, none is still in prefill)."""
    from tiny_models import tiny_loaded

    steps = 3
    rates = _gpu_check().decode_rates(tiny_loaded(), [1, 5], steps, prompt_len=40)
    assert [r["n"] for r in rates] == [1, 5]
    for r in rates:
        tokens = r["tokens_per_s"] * r["ms_per_step"] * steps / 1000
        assert tokens == pytest.approx(r["n"] * steps), f"N={r['n']}: {tokens} tokens timed"


GEMMA3 = KernelShape(256, 2, 4, "bfloat16", "bfloat16", 16, sliding_window=True)
PHI3 = KernelShape(96, 1, 32, "bfloat16", "bfloat16", 16)


def test_auto_on_hopper_caps_gemma3s_decode_splits_where_split_stats_overflow_shared_memory():
    chosen = select(device=DEVICES["H100"], shape=GEMMA3)
    assert (chosen.attention_impl, chosen.max_kv_splits) == ("pallas", 1), chosen.describe()
    assert "shared memory" in chosen.attention_reason


def test_auto_on_hopper_keeps_every_split_where_they_fit():
    shape = KernelShape(128, 4, 8, "bfloat16", "bfloat16", 16)
    chosen = select(device=DEVICES["H100"], shape=shape)
    assert (chosen.attention_impl, chosen.max_kv_splits) == ("pallas", 16), chosen.describe()


@pytest.mark.parametrize("shape,limit", [
    (PHI3, "head_dim % 64"),
    (KernelShape(256, 2, 4, "bfloat16", "float8_e4m3fn", 16), "shared memory")])
def test_auto_on_hopper_takes_the_xla_path_for_shapes_the_kernel_cannot_run(shape, limit):
    chosen = select(device=DEVICES["H100"], shape=shape)
    assert chosen.attention_impl == "xla", chosen.describe()
    assert limit in chosen.attention_reason, chosen.attention_reason


def test_explicit_pallas_for_a_shape_the_kernel_cannot_run_names_field_and_limit():
    with pytest.raises(ValueError, match=r"attention_impl='pallas' can't run on .*head_dim % 64"):
        select(attention_impl="pallas", device=DEVICES["H100"], shape=PHI3)


def test_auto_on_a_tpu_takes_the_xla_path_for_kv_heads_the_tiling_cannot_pack():
    """Phi-3-medium's 10 KV heads per device: neither bf16 nor float32 tiles them exactly."""
    shape = KernelShape(128, 4, 10, "bfloat16", "bfloat16", 16)
    chosen = select(device=DEVICES["TPU v5e"], shape=shape)
    assert chosen.attention_impl == "xla", chosen.describe()
    assert "10 KV heads per device" in chosen.attention_reason, chosen.attention_reason
    with pytest.raises(ValueError, match=r"attention_impl='pallas' can't run .*10 KV heads"):
        select(attention_impl="pallas", device=DEVICES["TPU v5e"], shape=shape)


@pytest.mark.parametrize("kv_heads", [1, 2, 4, 8])
def test_auto_on_a_tpu_keeps_the_kernel_for_kv_heads_the_tiling_packs(kv_heads):
    shape = KernelShape(128, 32 // kv_heads, kv_heads, "bfloat16", "float8_e4m3fn", 16)
    assert select(device=DEVICES["TPU v5e"], shape=shape).attention_impl == "pallas"


@pytest.mark.parametrize("name", ["T4", "A100", "CPU", "TPU v5e"])
def test_the_shape_does_not_change_other_devices_choices(name):
    assert select(device=DEVICES[name], shape=PHI3).attention_impl == EXPECTED[name][0]


def hopper_attention(monkeypatch, impl, **shape):
    """get_attention as a Hopper process would run it (the device mocked, kernels lowered for
    the GPU); nothing is compiled."""
    from pallas_kernels import tuning
    monkeypatch.setattr(DeviceDescription, "current", classmethod(lambda cls, p=None:
                                                                  DEVICES["H100"]))
    monkeypatch.setattr(tuning, "backend", lambda: "gpu")
    device_select._logged.clear()
    return get_attention(impl, AttentionShape(**shape))


def test_get_attention_builds_the_xla_backend_for_phi3_on_hopper_and_logs_why(monkeypatch,
                                                                              caplog):
    with caplog.at_level(logging.INFO, logger="jaxserve.model.device.select"):
        backend = hopper_attention(monkeypatch, "auto", group=1, num_kv_heads=32, page_size=16,
                                   head_dim=96, dtype="bfloat16")
    assert isinstance(backend, XlaAttention), type(backend)
    assert "attention_impl=xla" in caplog.text and "head_dim % 64" in caplog.text, caplog.text


def test_get_attention_gives_gemma3_on_hopper_the_kernel_with_one_split(monkeypatch):
    backend = hopper_attention(monkeypatch, "auto", group=2, num_kv_heads=4, page_size=16,
                               sliding_windows=(None, 512), head_dim=256, dtype="bfloat16")
    assert isinstance(backend, PallasAttention) and backend.max_kv_splits == 1
    assert backend._configs((4, 64), None)[2] == 1, "the decode call must not split"


def test_get_attention_refuses_explicit_pallas_for_phi3_on_hopper(monkeypatch):
    with pytest.raises(ValueError, match=r"attention_impl='pallas'.*head_dim % 64"):
        hopper_attention(monkeypatch, "pallas", group=1, num_kv_heads=32, page_size=16,
                         head_dim=96, dtype="bfloat16")


def test_placement_gives_the_attention_shape_head_dim_dtypes_and_sinks(monkeypatch):
    from jaxserve.runner import tensor_parallel
    from tiny_models import tiny_config
    seen = []
    monkeypatch.setattr(tensor_parallel, "get_attention",
                        lambda impl, shape, device=None: seen.append(shape))
    config = tiny_config()
    tensor_parallel.Placement(None, config).attention("auto", 16, jnp.bfloat16,
                                                      jnp.float8_e4m3fn)
    shape = seen[0]
    assert (shape.head_dim, shape.dtype, shape.kv_dtype, shape.sinks) == \
        (config.head_dim, "bfloat16", "float8_e4m3fn", config.family.attention_sinks), shape
