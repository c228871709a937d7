"""Qwen3 (RMSNorm on q and k per head before RoPE, no biases) against transformers."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import arch_oracle  # noqa: E402


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return arch_oracle.make_case(tmp_path_factory.mktemp("qwen3"), "qwen3", rope_parameters={
        "rope_type": "default", "rope_theta": 1_000_000.0})


class TestQwen3(arch_oracle.ArchSuite):
    pass


def test_attention_bias_adds_q_k_v_and_o_biases(tmp_path):
    case = arch_oracle.make_case(tmp_path, "qwen3", seed=1, layouts=("transformers5",),
                                 attention_bias=True)
    loaded = case.load("transformers5")
    assert loaded.config.output_bias and "layers.bo" in loaded.params
    arch_oracle.assert_logits_close(arch_oracle.last_logits(loaded, case.batch),
                                    case.want_logits)
