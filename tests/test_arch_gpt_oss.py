"""gpt-oss (attention sinks, alternating sliding / full layers, YaRN RoPE, biases on attention,
router and experts, the clamped SwiGLU, top-k-then-softmax routing) against transformers, and its
MXFP4 expert weights dequantized on load."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("transformers")

import arch_oracle  # noqa: E402
import moe_oracle  # noqa: E402

MOE = dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return moe_oracle.make_moe_case(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss", **MOE)


class TestGptOss(moe_oracle.MoESuite):
    def test_reads_its_own_settings(self, case):
        config = case.load("transformers5").config
        assert config.layer_types == ("sliding_attention", "full_attention")
        assert config.rope_scaling.rope_type == "yarn" and not config.rope_scaling.truncate
        assert (config.swiglu_alpha, config.swiglu_limit) == (1.702, 7.0)
        assert config.num_active_params() < config.num_params()


def _mxfp4_checkpoint(directory, seed=3):
    """A gpt-oss checkpoint whose expert matrices are stored as MXFP4 blocks and scales (as the
    released ones are), and the transformers model holding transformers' own dequantization
    of them."""
    import torch
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = arch_oracle.hf_checkpoint(directory, "gpt_oss", seed=seed, **MOE)
    rng = np.random.default_rng(seed)
    state = load_file(str(directory / "model.safetensors"))
    for i, layer in enumerate(model.model.layers):
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(layer.mlp.experts, name)          # [E, in, out]
            num_experts, inputs, outputs = param.shape
            blocks = rng.integers(0, 256, (num_experts, outputs, inputs // 32, 16), np.uint8)
            scales = rng.integers(121, 124, (num_experts, outputs, inputs // 32), np.uint8)
            with torch.no_grad():
                param.copy_(convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales),
                                                       dtype=torch.float32))
            key = f"model.layers.{i}.mlp.experts.{name}"
            del state[key]
            state[f"{key}_blocks"], state[f"{key}_scales"] = blocks, scales
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (directory / "config.json").write_text(json.dumps(config))
    return model


def test_mxfp4_experts_are_dequantized_on_load_as_transformers_does(tmp_path):
    from jaxserve.model.loaders.loader import load_model

    model = _mxfp4_checkpoint(tmp_path)
    batch = arch_oracle.prompts(3)
    loaded = load_model(str(tmp_path), progress=False)
    assert loaded.params["layers.e_gate"].dtype == np.float32
    arch_oracle.assert_logits_close(arch_oracle.last_logits(loaded, batch),
                                    arch_oracle.hf_last_logits(model.eval(), batch))


def test_other_quantization_configs_are_refused_by_name():
    from jaxserve.model.config import ModelConfig

    d = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=256,
             hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
             quantization_config={"quant_method": "fp8"})
    with pytest.raises(ValueError, match="quant_method='fp8'"):
        ModelConfig.from_hf_dict(d)
