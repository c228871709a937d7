"""Gemma 3 text (Gemma3ForCausalLM) against transformers: (1 + w) RMSNorm, four norms per layer,
q/k norm, GeGLU, embeddings scaled by sqrt(hidden), local sliding-window layers with their own
RoPE base between global ones (linear-scaled), query_pre_attn_scalar, final logit soft-cap."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

import arch_oracle  # noqa: E402
from jaxserve.model.config import ModelConfig  # noqa: E402

WINDOW = 8
# Untied: a tiny random Gemma with a tied head greedily repeats its last token forever (the
# scaled embedding dominates the residual), which would make the greedy check toothless.
GEMMA3 = dict(num_hidden_layers=4, tie_word_embeddings=False, sliding_window=WINDOW,
              sliding_window_pattern=2, query_pre_attn_scalar=24, final_logit_softcapping=3.0, rope_parameters={
                  "full_attention": {"rope_type": "linear", "factor": 2.0,
                                     "rope_theta": 1_000_000.0},
                  "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return arch_oracle.make_case(tmp_path_factory.mktemp("gemma3"), "gemma3_text", **GEMMA3)


class TestGemma3(arch_oracle.ArchSuite):
    def test_local_and_global_layers_alternate(self, case):
        config = case.load("transformers5").config
        assert config.layer_windows == (WINDOW, None, WINDOW, None)
        assert config.layer_rope(0) == (10_000.0, None)
        assert config.layer_rope(1)[1].rope_type == "linear"
        assert max(map(len, case.batch)) > 4 * WINDOW, "prompts must outgrow the window"


def test_attention_logit_softcapping_is_refused_since_transformers_ignores_it(case):
    d = json.loads((case.directories["transformers5"] / "config.json").read_text())
    d["attn_logit_softcapping"] = 50.0
    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0"):
        ModelConfig.from_hf_dict(d)


def test_greedy_tokens_at_tensor_parallel_2_match_transformers(case):
    got, num_preemptions = arch_oracle.engine_greedy_in_subprocess(
        case.directories["transformers5"], case.batch, tensor_parallel_size=2)
    arch_oracle.assert_greedy_equal(got, case.want_greedy, num_preemptions)


def test_first_layers_draft_keeps_each_layers_window(case):
    from jaxserve.spec.draft import load_draft

    config, params, _ = load_draft("layers:3", case.load("transformers5"), progress=False)
    assert config.layer_windows == (WINDOW, None, WINDOW)
    assert params["layers.wq"].shape[0] == 3


def test_orbax_checkpoint_round_trips_every_gemma_parameter(case, tmp_path):
    import dataclasses

    import numpy as np

    from jaxserve.model.loaders.loader import convert, load_model

    convert(str(case.directories["transformers5"]), tmp_path / "orbax", progress=False)
    restored = load_model(str(tmp_path / "orbax"), progress=False)
    loaded = case.load("transformers5")
    assert dataclasses.replace(restored.config, name="m") == dataclasses.replace(
        loaded.config, name="m")
    assert sorted(restored.params) == sorted(loaded.params)
    assert all(np.array_equal(np.asarray(restored.params[k]), v)
               for k, v in loaded.params.items())
