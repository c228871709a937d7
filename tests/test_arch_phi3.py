"""Phi-3 / Phi-4-mini against transformers: fused qkv_proj and gate_up_proj, partial rotary
(half of each head), longrope (short factors and attention factor), tied head as Phi-4-mini,
and a sliding window on every layer as Phi-3-mini."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import arch_oracle  # noqa: E402

WINDOW = 12
ORIGINAL = 64  # longrope switches to its long factors past this length (not reached here)
PHI3 = dict(partial_rotary_factor=0.5, sliding_window=WINDOW,
            tie_word_embeddings=True, original_max_position_embeddings=ORIGINAL,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10_000.0,
                             "partial_rotary_factor": 0.5, "short_factor": [1.0, 1.2, 1.5, 2.0],
                             "long_factor": [1.0, 2.0, 4.0, 8.0]})


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return arch_oracle.make_case(tmp_path_factory.mktemp("phi3"), "phi3", **PHI3)


class TestPhi3(arch_oracle.ArchSuite):
    engine_settings = dict(max_model_len=ORIGINAL)

    def test_fused_tensors_are_split_into_their_parts(self, case):
        loaded = case.load("transformers5")
        config = loaded.config
        assert config.rotary_dim == config.head_dim // 2
        assert loaded.params["layers.wq"].shape[-1] == config.q_size
        assert loaded.params["layers.w_up"].shape[-1] == config.intermediate_size

    def test_longer_max_model_len_than_longrope_computes_exactly_is_refused(self, case):
        with pytest.raises(ValueError, match="rope_type='longrope'.*max_model_len=128"):
            case.load("transformers5").config.check_runnable(max_model_len=128)


def test_fused_tensor_of_the_wrong_size_is_refused_naming_it(case, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    from jaxserve.model.loaders.loader import load_model

    shutil.copytree(case.directories["transformers5"], tmp_path / "bad")
    path = tmp_path / "bad" / "model.safetensors"
    tensors = load_file(str(path))
    name = "model.layers.1.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-16]  # one KV head short
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"qkv_proj\.weight.*\(128, 64\)"):
        load_model(str(tmp_path / "bad"), progress=False)
