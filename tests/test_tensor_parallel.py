"""Tensor parallelism: 1, 2 and 4 fake CPU devices give the same greedy tokens, with the
weights, KV pages and restored checkpoint params really sharded.

The serving runs in tests/tp_check.py (a subprocess: XLA_FLAGS must give 4 host devices before
jax starts); these tests read its JSON report. The sharding rules themselves need no devices
and are checked in-process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.model.decoder import sharding
from jaxserve.model.config import ModelConfig

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp") / "report.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "tp_check.py"), str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"tp_check.py failed:\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("tp", ["2", "4", "ngram", "draft"])
def test_tensor_parallel_gives_the_same_greedy_tokens_as_one_device(report, tp):
    """ngram / draft: speculative decoding (n-gram, a layers:1 draft) at tensor_parallel_size
    2 must give the greedy tokens of one device without speculation."""
    assert report["device_count"] == 4
    want, got = report["runs"]["1"]["tokens"], report["runs"][tp]["tokens"]
    assert len(got) == 32
    differ = [i for i, (a, b) in enumerate(zip(want, got)) if a != b]
    assert not differ, f"tp={tp}: requests {differ} differ from tp=1, e.g. {got[differ[0]]} " \
                       f"vs {want[differ[0]]}"


def test_host_prefix_tier_under_tensor_parallelism(report):
    """Sharded KV pages go to the host tier and come back (second pass): same tokens."""
    run, want = report["runs"]["host_tier"], report["runs"]["1"]["tokens"]
    assert run["host_hit_tokens"] > 0 and run["loaded_pages"] > 0, run
    assert run["passes"][0] == want and run["passes"][1] == want


def test_the_mixed_batch_preempted_and_swapped_under_tensor_parallelism(report):
    run = report["runs"]["2"]
    assert run["preemptions"] > 0 and run["swaps"] > 0, f"no preemption/swap to test: {run}"


@pytest.mark.parametrize("tp", [2, 4])
def test_weights_are_split_on_heads_and_ffn(report, tp):
    w = report["runs"][str(tp)]["weights"]
    for name, axis in [("wq", -1), ("wk", -1), ("wo", -2), ("w_down", -2)]:
        assert w[name]["devices"] == tp and not w[name]["replicated"], (name, w[name])
        assert w[name]["shard_shape"][axis] * tp == w[name]["shape"][axis], (name, w[name])
    assert w["final_norm"]["replicated"] and w["inv_freq"]["replicated"]
    vocab_split = 270 % tp == 0  # 270 splits in 2 but not in 4: then it stays replicated
    assert w["lm_head"]["replicated"] != vocab_split, w["lm_head"]
    assert w["embed"]["replicated"] != vocab_split, w["embed"]


def test_both_layer_layouts_are_sharded(report):
    stacked = report["runs"]["2"]["weights"]["wq"]    # layer_loop="scan": [L, D, Hq*Dh]
    per_layer = report["runs"]["4"]["weights"]["wq"]  # layer_loop="unroll": [D, Hq*Dh]
    assert stacked["spec"] == "P(None, None, 'tp')" and len(stacked["shape"]) == 3
    assert per_layer["spec"] == "P(None, 'tp')" and len(per_layer["shape"]) == 2


@pytest.mark.parametrize("tp", [2, 4])
def test_kv_pages_are_split_on_kv_heads_and_inputs_replicated(report, tp):
    run = report["runs"][str(tp)]
    for kv in run["kv"]:  # [L, N, page_size, Hkv, Dh]
        assert kv["spec"] == "P(None, None, None, 'tp', None)", kv
        assert kv["shard_shape"][3] == 4 // tp and kv["shard_shape"][:3] == kv["shape"][:3]
    # The step's inputs enter as two leaves (step_layout.py: one buffer of every field, the
    # grammar bitmask), replicated.
    assert run["inputs_replicated"] and run["num_step_inputs"] == run["num_input_leaves"] == 2


def test_checkpoint_restores_straight_into_the_shardings(report):
    restored = report["restored"]
    assert restored["layers.wq"]["shard_shape"] == [2, 64, 64], restored["layers.wq"]
    assert restored["layers.wk"]["shard_shape"] == [2, 64, 32], restored["layers.wk"]
    assert restored["layers.w_up"]["shard_shape"] == [2, 64, 48], restored["layers.w_up"]
    assert restored["embed"]["spec"] == "P('tp', None)"


def test_impossible_settings_raise_naming_both_numbers(report):
    errors = report["errors"]
    assert "tensor_parallel_size=4" in errors["kv_heads"] and \
        "num_kv_heads=2" in errors["kv_heads"], errors
    assert "tensor_parallel_size=8" in errors["devices"] and "4" in errors["devices"], errors


def _config(**overrides) -> ModelConfig:
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2,
                num_heads=8, num_kv_heads=4, head_dim=16)
    return ModelConfig(**{**base, **overrides})


@pytest.mark.parametrize("field,overrides", [
    ("num_heads", dict(num_heads=6, num_kv_heads=6)),
    ("num_kv_heads", dict(num_heads=8, num_kv_heads=2)),
    ("intermediate_size", dict(intermediate_size=90))])
def test_check_names_the_field_and_both_numbers(field, overrides):
    config = _config(**overrides)
    with pytest.raises(ValueError, match=rf"tensor_parallel_size=4 does not divide "
                                         rf"{field}={getattr(config, field)}"):
        sharding.check_tensor_parallel(config, 4)


def test_every_parameter_has_logical_axes_of_its_rank():
    config = _config(attention_bias=True)
    for name, shape in config.param_shapes().items():
        assert len(sharding.PARAM_AXES[name]) == len(shape), name
    specs = sharding.param_specs(config, 2, per_layer=True)
    assert specs["layers.wq"] == sharding.PartitionSpec(None, "tp")
    assert specs["layers.bk"] == sharding.PartitionSpec("tp")


@pytest.mark.parametrize("architecture", ["qwen3", "gemma3", "llama"])
def test_every_family_parameter_has_logical_axes_and_norms_are_replicated(architecture):
    config = _config(architecture=architecture, attention_bias=True, output_bias=True)
    for name, shape in config.param_shapes().items():
        assert len(sharding.PARAM_AXES[name]) == len(shape), name
    specs = sharding.param_specs(config, 2)
    replicated = sharding.PartitionSpec(None, None)
    for name in ("layers.q_norm", "layers.k_norm", "layers.post_attn_norm",
                 "layers.post_mlp_norm", "layers.bo"):
        if name in specs:
            assert specs[name] == replicated, (name, specs[name])
