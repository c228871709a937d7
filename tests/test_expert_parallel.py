"""Tensor and expert parallelism of mixture-of-experts models written by transformers give
transformers' greedy tokens without a compilation after warm-up, the experts really split:
tiny Qwen3-MoE (8 experts, top-2) on one device, with plain tensor parallelism 2, expert
parallelism 2 and 4, and expert 2 x tensor 2; Mixtral and gpt-oss (4 experts, top-2) on one
device, with expert parallelism 4 and expert 2 x tensor 2 (runs_of). A dense model ignores
expert parallelism with a warning.

The serving runs in tests/ep_check.py (one subprocess with 4 fake CPU devices for every
configuration); these tests read its JSON report. One device's share of the MoE FFN
(moe_shard.local_experts), the sharding rules and the settings' errors need no devices and are
checked in-process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxserve.config import EngineConfig
from jaxserve.model.decoder import sharding
from jaxserve.model.config import ModelConfig

ROOT = Path(__file__).resolve().parent.parent
# 4 KV heads (arch_oracle's TINY has 2), so that 4 devices hold whole heads.
MODELS = {"qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                            num_key_value_heads=4),
          "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, num_key_value_heads=4,
                          sliding_window=12),
          # attention sinks split with their heads; biases on the router and every expert
          "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, num_key_value_heads=4,
                          sliding_window=8)}


def runs_of(model: str) -> tuple[str, ...]:
    """The configurations tests/ep_check.py serves `model` in."""
    if model == next(iter(MODELS)):
        return ("1", "tp2", "ep2", "ep4", "ep2xtp2")
    return ("1", "ep4", "ep2xtp2")


# run -> (experts per device, expert width per device) as fractions of the whole
SPLITS = {"tp2": (1, 2), "ep2": (2, 1), "ep4": (4, 1), "ep2xtp2": (2, 2)}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    pytest.importorskip("transformers")
    import arch_oracle

    root = tmp_path_factory.mktemp("ep")
    return {name: arch_oracle.make_case(root / name, name, layouts=("transformers5",), **kw)
            for name, kw in MODELS.items()}


@pytest.fixture(scope="module")
def report(cases, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ep_report")
    spec = {"models": {name: str(case.directories["transformers5"])
                       for name, case in cases.items()},
            "batch": next(iter(cases.values())).batch}
    (tmp / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "ep_check.py"),
                           str(tmp / "spec.json"), str(tmp / "out.json")],
                          cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"ep_check.py failed:\n{proc.stderr[-4000:]}"
    return json.loads((tmp / "out.json").read_text())


@pytest.mark.parametrize("model,run", [(m, r) for m in MODELS for r in runs_of(m)])
def test_greedy_tokens_equal_one_device_and_transformers(cases, report, model, run):
    import arch_oracle

    assert report["device_count"] == 4
    runs = report["models"][model]
    got = runs[run]
    assert got["tokens"] == runs["1"]["tokens"], f"{model} {run} differs from one device"
    arch_oracle.assert_greedy_equal(got["tokens"], cases[model].want_greedy,
                                    got["preemptions"])
    assert got["compiles"] == 0, f"{model} {run}: {got['compiles']} compilations after warm-up"


@pytest.mark.parametrize("model,run", [(m, r) for m in MODELS for r in runs_of(m)
                                       if r in SPLITS])
def test_experts_are_split_and_the_router_replicated(report, model, run):
    got = report["models"][model][run]
    expert_ways, width_ways = SPLITS[run]
    assert got["expert_parallel_size"] == (1 if run == "tp2" else expert_ways)
    w = got["weights"]
    assert w["router"]["replicated"], w["router"]
    for name, width_axis in (("e_gate", -1), ("e_down", -2)):
        shape, shard = w[name]["shape"], w[name]["shard_shape"]
        assert shard[-3] * expert_ways == shape[-3], (name, w[name])  # experts
        assert shard[width_axis] * width_ways == shape[width_axis], (name, w[name])  # F
        assert shard[-3] * shard[width_axis] * w[name]["devices"] \
            == shape[-3] * shape[width_axis], f"{name} is not split over every device: {w[name]}"
    # attention stays tensor-parallel over every device of the mesh
    wq = w["wq"]
    assert wq["shard_shape"][-1] * wq["devices"] == wq["shape"][-1], wq


def test_a_moe_checkpoint_restored_into_the_expert_shardings_serves_the_same_tokens(cases, report):
    import arch_oracle

    runs = report["models"]["qwen3_moe"]
    got = runs["ep2xtp2_checkpoint"]
    assert got["tokens"] == runs["1"]["tokens"]
    arch_oracle.assert_greedy_equal(got["tokens"], cases["qwen3_moe"].want_greedy,
                                    got["preemptions"])
    assert got["weights"]["e_gate"]["spec"] == "P('ep', None, 'tp')", got["weights"]["e_gate"]
    assert got["weights"]["e_gate"] == runs["ep2xtp2"]["weights"]["e_gate"]


def test_int8_experts_split_over_the_devices_give_one_devices_int8_tokens(report):
    runs = report["models"]["qwen3_moe"]
    want, got = runs["int8"], runs["ep2xtp2_int8"]
    assert got["tokens"] == want["tokens"]
    assert got["preemptions"] > 0 and got["compiles"] == 0


def test_a_dense_model_ignores_expert_parallelism_with_a_warning(report):
    dense = report["dense"]
    assert dense["tokens"] == dense["want"]
    assert dense["expert_parallel_size"] == 1
    assert dense["weights"]["wq"]["spec"] == "P(None, 'tp')", dense["weights"]["wq"]
    assert any("enable_expert_parallel is ignored" in m for m in dense["warnings"]), dense


# ---- in-process: one device's share, rules and errors -------------------------------------

def _moe_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=128, hidden_size=16, intermediate_size=24, num_layers=1,
                num_heads=4, num_kv_heads=4, head_dim=4, architecture="qwen3moe",
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=12)
    return ModelConfig(**{**base, **overrides})


def _layer_weights(config: ModelConfig, rng) -> dict:
    """One layer's expert weights with every bias (the sum must add e_down_bias once)."""
    E, D, F = config.num_experts, config.hidden_size, config.moe_intermediate_size
    shapes = {"e_gate": (E, D, F), "e_up": (E, D, F), "e_down": (E, F, D),
              "e_gate_bias": (E, F), "e_up_bias": (E, F), "e_down_bias": (E, D)}
    return {k: (0.3 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}


def _share(w: dict, group: int, num_local: int, part: int, width_ways: int) -> dict:
    """Device (group, part)'s slice: its experts, its part of each one's width F."""
    experts = slice(group * num_local, (group + 1) * num_local)
    F = w["e_gate"].shape[-1]
    cols = slice(part * F // width_ways, (part + 1) * F // width_ways)
    return {"e_gate": w["e_gate"][experts, :, cols], "e_up": w["e_up"][experts, :, cols],
            "e_down": w["e_down"][experts, cols], "e_gate_bias": w["e_gate_bias"][experts, cols],
            "e_up_bias": w["e_up_bias"][experts, cols], "e_down_bias": w["e_down_bias"][experts]}


@pytest.mark.parametrize("num_tokens", [4, 16])  # 8 pairs: gathered; 32 pairs: grouped
@pytest.mark.parametrize("expert_ways,width_ways", [(1, 2), (2, 1), (2, 2), (4, 1), (8, 1)])
def test_the_devices_shares_sum_to_the_whole_ffn(num_tokens, expert_ways, width_ways):
    import jax.numpy as jnp

    from jaxserve.model.decoder import moe
    from jaxserve.model.decoder.moe_shard import local_experts

    config = _moe_config()
    rng = np.random.default_rng(0)
    w = _layer_weights(config, rng)
    x = jnp.asarray(rng.standard_normal((num_tokens, config.hidden_size)), jnp.float32)
    logits = jnp.asarray(rng.standard_normal((num_tokens, config.num_experts)), jnp.float32)
    weights, experts = moe.route(logits, 2, config.family.router, True)
    assert len(np.unique(np.asarray(experts))) >= 4  # pairs on several devices' experts
    want = moe.compute_experts(x, weights, experts, w, config)
    num_local = config.num_experts // expert_ways
    got = sum(local_experts(x, weights, experts, _share(w, g, num_local, p, width_ways), config,
                            first_expert=g * num_local, num_local=num_local,
                            owns_down_bias=p == 0)
              for g in range(expert_ways) for p in range(width_ways))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_every_moe_parameter_has_logical_axes_and_the_specs_split_experts_on_ep():
    config = _moe_config()
    for name, shape in config.param_shapes().items():
        assert len(sharding.PARAM_AXES[name]) == len(shape), name
    P = sharding.PartitionSpec
    plain = sharding.param_specs(config, 4)
    assert plain["layers.e_gate"] == P(None, None, None, "tp")
    assert plain["layers.e_down"] == P(None, None, "tp", None)
    assert plain["layers.router"] == P(None, None, None)
    ep = sharding.param_specs(config, 4, per_layer=True, expert_parallel_size=2)
    assert ep["layers.e_gate"] == P("ep", None, "tp")
    assert ep["layers.e_down"] == P("ep", "tp", None)
    assert ep["layers.router"] == P(None, None)
    assert ep["layers.wq"] == P(None, ("ep", "tp"))  # attention: every device


def test_quantized_expert_specs_split_like_the_matrix_and_keep_whole_groups():
    from jaxserve.model.quant.formats import QuantizedTensor

    config = _moe_config(moe_intermediate_size=48)
    L, E, D, F = 1, 8, 16, 48

    def stand_in(out, inp, group):
        return QuantizedTensor(np.zeros((L, E, out, inp), np.int8),
                               np.zeros((L, E, out, inp // group), np.float32), None, 8, group)

    P = sharding.PartitionSpec
    specs = sharding.quantized_specs(config, "layers.e_down", stand_in(D, F, 8), 4,
                                     expert_parallel_size=2)  # [L, E, D, F]: F split 2 ways
    assert specs == {"q": P(None, "ep", None, "tp"), "scale": P(None, "ep", None, "tp")}
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 / expert_parallel_size=2 = 2 "
                                         r"splits the 48 inputs of layers.e_down into 24"):
        sharding.quantized_specs(config, "layers.e_down", stand_in(D, F, 16), 4,
                                 expert_parallel_size=2)
    per_channel = sharding.quantized_specs(config, "layers.e_gate", stand_in(F, D, D), 4,
                                           per_layer=True, expert_parallel_size=4)
    assert per_channel == {"q": P("ep", "tp", None), "scale": P("ep", "tp", None)}


@pytest.mark.parametrize("overrides,tp,ep,message", [
    (dict(num_experts=6), 4, 4, r"expert_parallel_size=4 does not divide num_experts=6"),
    (dict(moe_intermediate_size=33), 4, 2,
     r"tensor_parallel_size=4 / expert_parallel_size=2 = 2 does not divide "
     r"moe_intermediate_size=33"),
    (dict(moe_intermediate_size=30), 4, 1,
     r"tensor_parallel_size=4 does not divide moe_intermediate_size=30"),
    (dict(), 4, 3, r"expert_parallel_size=3 does not divide tensor_parallel_size=4")])
def test_impossible_expert_splits_raise_naming_the_setting(overrides, tp, ep, message):
    with pytest.raises(ValueError, match=message):
        sharding.check_tensor_parallel(_moe_config(**overrides), tp, ep)


def test_a_moe_model_needs_no_dense_intermediate_size_split():
    sharding.check_tensor_parallel(_moe_config(intermediate_size=30), 4, 2)


@pytest.mark.parametrize("settings,field", [
    (dict(tensor_parallel_size=4, enable_expert_parallel=True, expert_parallel_size=3),
     "expert_parallel_size=3"),
    (dict(tensor_parallel_size=4, expert_parallel_size=2), "expert_parallel_size=2"),
    (dict(tensor_parallel_size=4, enable_expert_parallel=True, expert_parallel_size=0),
     "expert_parallel_size=0")])
def test_expert_parallel_settings_are_checked_by_name(settings, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig.from_kwargs(**settings)


def test_expert_parallel_size_defaults_to_the_tensor_parallel_group():
    groups = lambda **kw: EngineConfig.from_kwargs(**kw).parallel.expert_parallel_groups
    assert groups(tensor_parallel_size=4) == 1
    assert groups(tensor_parallel_size=4, enable_expert_parallel=True) == 4
    assert groups(tensor_parallel_size=4, enable_expert_parallel=True,
                  expert_parallel_size=2) == 2
