"""Qwen3-MoE (Qwen3's attention, 8 experts, top-2 renormalised; top-4 unnormalised too)
against transformers."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import arch_oracle  # noqa: E402
import moe_oracle  # noqa: E402

MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return moe_oracle.make_moe_case(tmp_path_factory.mktemp("qwen3moe"), "qwen3_moe",
                                    v4_renames={"num_local_experts": "num_experts"}, **MOE)


class TestQwen3Moe(moe_oracle.MoESuite):
    pass


def test_top4_without_renormalisation_matches_transformers(tmp_path):
    case = arch_oracle.make_case(tmp_path, "qwen3_moe", seed=2, layouts=("transformers5",),
                                 **{**MOE, "num_experts_per_tok": 4, "norm_topk_prob": False})
    loaded = case.load("transformers5")
    assert (loaded.config.num_experts_per_tok, loaded.config.norm_topk_prob) == (4, False)
    arch_oracle.assert_logits_close(arch_oracle.last_logits(loaded, case.batch),
                                    case.want_logits)


@pytest.mark.parametrize("key,value", [("decoder_sparse_step", 2), ("mlp_only_layers", [0])])
def test_dense_layers_among_sparse_ones_are_refused_by_name(tmp_path, key, value):
    from jaxserve.model.config import ModelConfig

    d = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=256,
             hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=32, **{key: value})
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_hf_dict(d)
