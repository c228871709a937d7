"""PEFT adapters read on the host (jaxserve/lora/peft.py), the host's registry of them, the LoRA
settings and LoRARequest: every bad adapter, setting or request is refused with a ValueError
that names the problem. No device step runs here.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

import arch_oracle  # noqa: E402
import lora_oracle  # noqa: E402

from jaxserve.lora.peft import read_adapter  # noqa: E402


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(base checkpoint directory, its ModelConfig, a good rank-4 rsLoRA adapter on q/v/down)."""
    from jaxserve.model.loaders.loader import load_model

    root = tmp_path_factory.mktemp("lora_base")
    arch_oracle.hf_checkpoint(root / "base", "llama")
    good = lora_oracle.make_adapter(root / "base", root / "good", 1, r=4, lora_alpha=8,
                                    use_rslora=True,
                                    target_modules=["q_proj", "v_proj", "down_proj"])
    return root / "base", load_model(str(root / "base"), progress=False).config, good


def edited(good, tmp_path, **changes):
    """A copy of the good adapter with adapter_config.json settings changed."""
    path = tmp_path / "edited"
    shutil.copytree(good, path)
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def test_a_good_adapter_reads_as_a_and_b_per_target_with_the_scaling_folded_into_b(base):
    from safetensors.numpy import load_file

    _, config, good = base
    adapter = read_adapter(good, config, max_lora_rank=16)
    assert adapter.rank == 4 and adapter.scaling == pytest.approx(8 / 2)  # rsLoRA: 8 / sqrt(4)
    assert sorted(adapter.weights) == ["w_down", "wq", "wv"]
    a, b = adapter.weights["wq"]
    assert a.shape == (config.num_layers, config.hidden_size, 4) and a.dtype == np.float32
    assert b.shape == (config.num_layers, 4, config.q_size)
    tensors = load_file(str(good / "adapter_model.safetensors"))
    torch_b = tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"]
    np.testing.assert_allclose(b[1], torch_b.T * 4.0, rtol=1e-6)


@pytest.mark.parametrize("changes, words", [
    ({"r": 32}, "rank r=32 exceeds max_lora_rank=16"),
    ({"target_modules": ["q_proj", "lm_head"]}, "unknown target module 'lm_head'"),
    ({"use_dora": True}, "use_dora=True is not supported"),
    ({"lora_bias": True}, "lora_bias=True is not supported"),
    ({"bias": "all"}, "bias='all' is not supported"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out=True is not supported"),
    ({"rank_pattern": {"q_proj": 8}}, "rank_pattern={'q_proj': 8} is not supported"),
    ({"alpha_pattern": {"q_proj": 4}}, "alpha_pattern={'q_proj': 4} is not supported"),
    ({"layers_to_transform": [0]}, "layers_to_transform=[0] is not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save=['lm_head'] is not supported"),
    ({"a_future_setting": 3}, "a_future_setting=3 is not supported: this reader does not know"),
    ({"peft_type": "IA3"}, "peft_type='IA3' is not supported"),
    ({"r": 0}, "r=0 is invalid"),
    ({"lora_alpha": "big"}, "lora_alpha='big' is invalid"),
])
def test_an_adapter_config_that_changes_the_math_or_breaks_a_limit_is_refused(
        base, tmp_path, changes, words):
    _, config, good = base
    with pytest.raises(ValueError, match="LoRA adapter .*" + _escaped(words)):
        read_adapter(edited(good, tmp_path, **changes), config, max_lora_rank=16)


def _escaped(words: str) -> str:
    import re
    return re.escape(words)


def test_missing_files_are_named(base, tmp_path):
    _, config, good = base
    with pytest.raises(ValueError, match="is not a directory"):
        read_adapter(tmp_path / "nowhere", config, 16)
    no_weights = edited(good, tmp_path)
    (no_weights / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match="missing file adapter_model.safetensors"):
        read_adapter(no_weights, config, 16)
    no_config = tmp_path / "no_config"
    shutil.copytree(good, no_config)
    (no_config / "adapter_config.json").unlink()
    with pytest.raises(ValueError, match="missing file adapter_config.json"):
        read_adapter(no_config, config, 16)


def _rewrite_tensors(path, change):
    from safetensors.numpy import load_file, save_file

    file = path / "adapter_model.safetensors"
    tensors = load_file(str(file))
    change(tensors)
    save_file(tensors, str(file))


def test_tensor_shapes_that_do_not_match_the_base_model_are_refused(base, tmp_path):
    _, config, good = base
    path = edited(good, tmp_path)
    key = "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"
    _rewrite_tensors(path, lambda t: t.update({key: np.zeros((4, 7), np.float32)}))
    want = (f"down_proj.lora_A of layer 0 has shape (4, 7), but the base model and r=4 need "
            f"(4, {config.intermediate_size})")
    with pytest.raises(ValueError, match=_escaped(want)):
        read_adapter(path, config, 16)


def test_a_lone_half_a_layer_past_the_model_and_a_foreign_tensor_are_refused(base, tmp_path):
    _, config, good = base
    prefix = "base_model.model.model.layers"
    cases = [
        (lambda t: t.pop(f"{prefix}.1.self_attn.q_proj.lora_B.weight"),
         "q_proj of layer 1 has only one of lora_A and lora_B"),
        (lambda t: t.update({f"{prefix}.9.self_attn.q_proj.lora_A.weight":
                             np.zeros((4, 64), np.float32)}),
         "is for layer 9, but the base model has 2 layers"),
        (lambda t: t.update({"base_model.model.lm_head.lora_A.weight":
                             np.zeros((4, 64), np.float32)}),
         "is not a LoRA A or B weight"),
        (lambda t: t.update({f"{prefix}.0.self_attn.k_proj.lora_A.weight":
                             np.zeros((4, 64), np.float32)}),
         "adapts 'k_proj', which target_modules"),
    ]
    for i, (change, words) in enumerate(cases):
        path = edited(good, tmp_path / str(i))
        _rewrite_tensors(path, change)
        with pytest.raises(ValueError, match=_escaped(words)):
            read_adapter(path, config, 16)


def test_dense_mlp_targets_are_refused_on_a_mixture_of_experts_model(base):
    import dataclasses

    _, config, good = base

    class MoEConfig:  # the base's attention, with experts instead of a dense MLP
        num_experts, num_layers = 4, config.num_layers

        @staticmethod
        def param_shapes():
            return {k: v for k, v in config.param_shapes().items()
                    if k not in ("layers.w_gate", "layers.w_up", "layers.w_down")}

    assert dataclasses.is_dataclass(config)
    with pytest.raises(ValueError, match="'down_proj' is a dense-MLP projection, but the base "
                                         "model's MLP is a mixture of experts"):
        read_adapter(good, MoEConfig, 16)


def test_the_registry_reads_each_adapter_once_and_refuses_conflicts(base, tmp_path):
    from jaxserve import LoRARequest
    from jaxserve.lora.registry import LoRARegistry

    _, config, good = base
    registry = LoRARegistry(config, max_lora_rank=16, max_cpu_loras=2)
    assert registry.resolve(LoRARequest("good", 7, str(good))) == 7
    first = registry.get(7)
    assert registry.resolve(LoRARequest("good", 7, str(good))) == 7 and registry.get(7) is first
    with pytest.raises(ValueError, match="lora_int_id=7 already names adapter 'good'"):
        registry.resolve(LoRARequest("other", 7, str(good)))
    with pytest.raises(ValueError, match="lora_name='good' already names the adapter with "
                                         "lora_int_id=7"):
        registry.resolve(LoRARequest("good", 8, str(good)))
    with pytest.raises(ValueError, match="rank r=4 exceeds max_lora_rank=2"):
        LoRARegistry(config, 2, 2).resolve(LoRARequest("good", 1, str(good)))
    registry.resolve(LoRARequest("second", 8, str(good)))
    with pytest.raises(ValueError, match="holds max_cpu_loras=2 adapters, all in use"):
        registry.resolve(LoRARequest("third", 9, str(good)))
    assert len(registry) == 2 and [r.lora_int_id for r in registry.requests] == [7, 8]


def test_more_lora_modules_than_host_slots_are_all_served_least_recently_used_out(base):
    """vLLM registers every --lora-modules entry and loads them on demand into its LRU host
    cache: three adapters with max_cpu_loras=1 are all known, one held at a time."""
    from jaxserve import EngineConfig, LoRARequest
    from jaxserve.engine.builder import lora_adapters

    _, model_config, good = base
    config = EngineConfig.from_kwargs(enable_lora=True, max_loras=1, lora_modules=[
        f"{name}={good}" for name in ("a", "b", "c")])
    registry = lora_adapters(config, model_config, num_processes=1)
    assert [r.lora_name for r in registry.requests] == ["a", "b", "c"], "an adapter is unknown"
    assert len(registry) == 1 and 3 in registry, "host memory must hold the last one read only"
    first = registry.lookup("a")
    assert registry.resolve(first) == first.lora_int_id, "a known adapter must read back"
    registry.queued(first.lora_int_id)
    assert first.lora_int_id in registry and len(registry) == 1
    assert registry.num_evictions == 3, "b and c made room, then a again"


@pytest.mark.parametrize("args, words", [
    (("", 1, "/x"), "lora_name='' is invalid"),
    (("a", 0, "/x"), "lora_int_id=0 is invalid"),
    (("a", True, "/x"), "lora_int_id=True is invalid"),
])
def test_a_lora_request_with_a_bad_field_is_refused(args, words):
    from jaxserve import LoRARequest

    with pytest.raises(ValueError, match=_escaped(words)):
        LoRARequest(*args)


@pytest.mark.parametrize("settings, words", [
    (dict(enable_lora=True, max_loras=0), "max_loras=0 is invalid: must be >= 1"),
    (dict(enable_lora=True, max_lora_rank=0), "max_lora_rank=0 is invalid"),
    (dict(enable_lora=True, max_loras=4, max_cpu_loras=2), "max_cpu_loras=2 is invalid: must "
                                                           "be >= max_loras (4)"),
    (dict(lora_modules=["a=/x"]), "must be unset unless enable_lora is on"),
    (dict(enable_lora=True, lora_modules=["no-path"]), "lora_modules='no-path' is invalid"),
    (dict(enable_lora=True, lora_modules=["a=/x", "a=/y"]), "one entry per adapter name"),
    (dict(enable_lora=True, speculative_method="draft", num_speculative_tokens=2,
          speculative_draft="layers:1"),
     "enable_lora=True is invalid with speculative_method='draft'"),
])
def test_bad_lora_settings_are_refused_naming_the_setting(settings, words):
    from jaxserve import EngineConfig

    with pytest.raises(ValueError, match=_escaped(words)):
        EngineConfig.from_kwargs(**settings)


def test_the_lora_flags_have_vllms_names():
    import argparse

    from jaxserve.entrypoints import cli_flags

    parser = argparse.ArgumentParser()
    cli_flags.add_engine_flags(parser)
    args = parser.parse_args(["--enable-lora", "--lora-modules", "a=/x",
                              '{"name": "b", "path": "/y"}', "--max-loras", "2",
                              "--max-cpu-loras", "3", "--max-lora-rank", "8"])
    lora = cli_flags.engine_config_from_args(args).lora
    assert lora.modules() == [("a", "/x"), ("b", "/y")]
    assert (lora.enable_lora, lora.max_loras, lora.num_cpu_loras, lora.max_lora_rank) == \
        (True, 2, 3, 8)
