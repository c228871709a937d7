"""config.json reading: transformers 4 and 5 layouts give the same ModelConfig, RoPE frequencies
match transformers', and settings jaxserve cannot compute fail to load naming the key and value."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxserve.model.decoder import rope
from jaxserve.model.config import ModelConfig

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def saved(model_type: str, **kw) -> dict:
    """What transformers 5 writes to config.json for this config."""
    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **kw})
    return json.loads(config.to_json_string())


def test_transformers5_rope_parameters_theta_is_read():
    d = saved("qwen2", rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert "rope_theta" not in d and d["rope_parameters"]["rope_theta"] == 1e6
    assert ModelConfig.from_hf_dict(d).rope_theta == 1e6


def test_transformers4_and_5_layouts_give_the_same_config():
    t5 = saved("llama", rope_parameters={"rope_type": "llama3", "rope_theta": 5e5,
                                         "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 64})
    t4 = {k: v for k, v in t5.items() if k != "rope_parameters"}
    t4.update(rope_theta=5e5, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 64})
    a, b = ModelConfig.from_hf_dict(t5), ModelConfig.from_hf_dict(t4)
    assert a == b, f"transformers 5 layout {a} != transformers 4 layout {b}"
    assert a.rope_scaling.rope_type == "llama3" and a.rope_theta == 5e5


@pytest.mark.parametrize("params", [
    {"rope_type": "default", "rope_theta": 1e4},
    {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0},
    {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
    {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
     "original_max_position_embeddings": 64},
], ids=lambda p: p["rope_type"])
def test_inv_freq_and_attention_factor_match_transformers(params):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from jaxserve.model.loaders.hf_config import read_hf_config
    d = saved("llama", rope_parameters=dict(params), head_dim=16)
    config = ModelConfig(**read_hf_config(d), name="m")  # yarn: read, not yet run (below)
    hf_config = transformers.LlamaConfig(**{k: v for k, v in d.items()
                                            if k not in ("architectures", "model_type")})
    if params["rope_type"] == "default":
        want = 1.0 / (params["rope_theta"] ** (np.arange(0, 16, 2) / 16))
        want_factor = 1.0
    else:
        inv, want_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_config, "cpu")
        want = inv.numpy()
    got = rope.inv_freq(config.rope_theta, config.rotary_dim, config.rope_scaling)
    np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=params["rope_type"])
    assert rope.attention_factor(config.rope_scaling) == pytest.approx(want_factor)


def test_yarn_reads_its_attention_factor():
    d = saved("llama", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                        "original_max_position_embeddings": 64})
    config = ModelConfig.from_hf_dict(d)
    assert config.rope_scaling.rope_type == "yarn"
    assert rope.attention_factor(config.rope_scaling) == pytest.approx(0.1 * np.log(4.0) + 1)


def test_unsupported_rope_type_names_it():
    d = saved("llama", rope_parameters={"rope_type": "mrope", "rope_theta": 1e4})
    with pytest.raises(ValueError, match="rope_type='mrope'"):
        ModelConfig.from_hf_dict(d)


def test_unknown_key_inside_rope_dict_names_it():
    d = saved("llama")
    d["rope_parameters"] = {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0,
                            "mystery": 3}
    with pytest.raises(ValueError, match="mystery=3"):
        ModelConfig.from_hf_dict(d)


def test_unknown_top_level_key_names_it_and_can_be_allowed(monkeypatch):
    d = dict(saved("llama"), quantization_config={"quant_method": "awq"})
    with pytest.raises(ValueError, match="quantization_config="):
        ModelConfig.from_hf_dict(d)
    monkeypatch.setenv("JAXSERVE_IGNORE_CONFIG_KEYS", "quantization_config")
    assert ModelConfig.from_hf_dict(d).architecture == "llama"


@pytest.mark.parametrize("key,value", [("mlp_bias", True), ("rope_interleaved", True),
                                       ("hidden_act", "relu")])
def test_math_changing_value_is_refused(key, value):
    d = dict(saved("llama"), **{key: value})
    with pytest.raises(ValueError, match=f"{key}={value!r}"):
        ModelConfig.from_hf_dict(d)


def test_llama_sliding_window_is_refused():
    d = dict(saved("llama"), sliding_window=16)
    with pytest.raises(ValueError, match="sliding_window=16"):
        ModelConfig.from_hf_dict(d)


def test_mistral_sliding_window_applies_to_every_layer():
    assert ModelConfig.from_hf_dict(saved("mistral", sliding_window=8)).layer_windows == (8, 8)


def test_qwen2_use_sliding_window_applies_from_max_window_layers():
    d = saved("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert ModelConfig.from_hf_dict(d).layer_windows == (None, 8)


@pytest.mark.parametrize("model_type,kw,architecture", [
    ("qwen3", {}, "qwen3"),
    ("gemma3_text", {}, "gemma3"),
    ("phi3", {"partial_rotary_factor": 0.5, "eos_token_id": 2, "pad_token_id": 0}, "phi3"),
])
def test_new_families_load(model_type, kw, architecture):
    assert ModelConfig.from_hf_dict(saved(model_type, **kw)).architecture == architecture


def test_gemma3_windows_and_ropes_are_read_per_layer_type():
    from jaxserve.model.loaders.hf_config import read_hf_config
    d = saved("gemma3_text", num_hidden_layers=6, sliding_window=8, head_dim=8,
              query_pre_attn_scalar=8)
    c = ModelConfig(**read_hf_config(d), name="g")
    assert c.layer_windows == (8, 8, 8, 8, 8, None)
    assert c.sliding_windows == (8, None)
    assert (c.rope_theta, c.sliding_rope_theta) == (1e6, 1e4)
    assert c.layer_rope(0)[0] == 1e4 and c.layer_rope(5)[0] == 1e6
    assert c.attention_scale == pytest.approx(8 ** -0.5)
