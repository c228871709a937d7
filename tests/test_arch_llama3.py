"""Llama 3.x (llama3 RoPE scaling; 3.2 1B/3B-like: tied head, GQA, head_dim 16 of hidden 64)
against transformers; yarn's attention factor on the same decoder."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import arch_oracle  # noqa: E402

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return arch_oracle.make_case(tmp_path_factory.mktemp("llama3"), "llama",
                                 rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True,
                                 num_key_value_heads=1)


class TestLlama3(arch_oracle.ArchSuite):
    def test_reads_the_tied_llama3_checkpoint(self, case):
        config = case.load("transformers5").config
        assert config.tie_word_embeddings and "lm_head" not in case.load("transformers5").params
        assert config.rope_scaling.rope_type == "llama3" and config.rope_theta == 500_000.0


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "linear", "rope_theta": 10_000.0, "factor": 2.0},
], ids=["yarn", "linear"])
def test_scaled_rope_logits_match_transformers(tmp_path, rope):
    case = arch_oracle.make_case(tmp_path, "llama", seed=2, layouts=("transformers5",),
                                 rope_parameters=rope)
    got = arch_oracle.last_logits(case.load("transformers5"), case.batch)
    arch_oracle.assert_logits_close(got, case.want_logits)
