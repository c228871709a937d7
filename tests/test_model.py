"""The Llama forward pass against Hugging Face transformers on tiny random models.

Logits must match at every position whether the prompt is read in one prefill, in chunks, or
token by token through paged decode with a shuffled, non-contiguous page table.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")

from jaxserve.model.decoder.decoder import Llama  # noqa: E402
from model_chunks import NUM_PAGES, run_in_chunks  # noqa: E402
from tiny_models import hf_logits, hf_model, tiny_model  # noqa: E402


CASES = {
    "gqa-untied": dict(num_heads=4, num_kv_heads=2),
    "mha-tied": dict(num_heads=4, num_kv_heads=4, tie_word_embeddings=True),
    "gqa4-qkv-bias": dict(num_heads=8, num_kv_heads=2, head_dim=8, attention_bias=True,
                          architecture="qwen2"),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    config, params = tiny_model(seed=3, **CASES[request.param])
    tokens = np.random.default_rng(7).integers(0, config.vocab_size, 45).tolist()
    want = hf_logits(hf_model(config, params), tokens)
    return config, params, tokens, want


@pytest.mark.parametrize("layer_loop", ["scan", "unroll"])
@pytest.mark.parametrize("chunks", [[45], [16, 5, 24], [1] * 45], ids=["prefill", "chunked",
                                                                        "decode"])
def test_logits_match_transformers(case, layer_loop, chunks):
    config, params, tokens, want = case
    model = Llama(config, params, layer_loop=layer_loop)
    pages = np.random.default_rng(len(chunks)).permutation(np.arange(1, NUM_PAGES))[:6]
    got = run_in_chunks(model, config, tokens, chunks, pages)
    err = np.abs(got - want).max()
    assert err <= 1e-4, f"max |logits - transformers| = {err:.2e} over {len(tokens)} positions"


def test_llama3_rope_scaling_matches_transformers():
    from jaxserve.model.config import RopeScaling
    config, params = tiny_model(seed=4, rope_theta=500000.0,
                                rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64))
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, 40).tolist()
    want = hf_logits(hf_model(config, params), tokens)
    got = run_in_chunks(Llama(config, params), config, tokens, [40], list(range(1, 6)))
    assert np.abs(got - want).max() <= 1e-4


def test_shape_mismatch_names_the_parameter():
    config, params = tiny_model()
    params["layers.wq"] = params["layers.wq"][:, :, :-1]
    with pytest.raises(ValueError, match="layers.wq"):
        Llama(config, params)


def test_gguf_safetensors_and_orbax_give_identical_logits(tmp_path):
    import model_fixtures
    from gguf import GGMLQuantizationType as Q

    from jaxserve.model.loaders.loader import convert, load_model, save_hf_directory

    config, params = model_fixtures.random_model(seed=5)
    gguf_path = model_fixtures.write_gguf(tmp_path / "m.gguf", config, params, qtype=Q.Q8_0)
    from_gguf = load_model(str(gguf_path), progress=False)
    save_hf_directory(tmp_path / "hf", from_gguf.config, from_gguf.params, from_gguf.tokenizer)
    convert(str(gguf_path), tmp_path / "orbax")
    loaded = [from_gguf, load_model(str(tmp_path / "hf"), progress=False),
              load_model(str(tmp_path / "orbax"), progress=False)]
    tokens = list(range(3, 40))
    logits = [run_in_chunks(Llama(m.config, m.params), m.config, tokens, [len(tokens)],
                            list(range(1, 6))) for m in loaded]
    assert np.array_equal(logits[0], logits[1]), "safetensors logits differ from GGUF's"
    assert np.array_equal(logits[0], logits[2]), "Orbax logits differ from GGUF's"
