"""Weight loading: GGUF, Hugging Face safetensors and Orbax checkpoints give the same params."""

from __future__ import annotations

import dataclasses
import json

import gguf
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from jaxserve.model.config import ModelConfig, RopeScaling
from jaxserve.model.loaders.gguf_loader import llama3_rope_factors, load_gguf
from jaxserve.model.loaders.loader import convert, load_model, save_hf_directory
from jaxserve.model.loaders.weights import to_hf_state_dict
from model_fixtures import (gguf_tensors, hf_default_model, random_model, real_default_model,
                            tiny_tokenizer, write_gguf)


def assert_same_params(got: dict, want: dict, *, exact: bool = True, atol: float = 0.0):
    assert set(got) == set(want), f"param names differ: {set(got) ^ set(want)}"
    for name in want:
        assert got[name].shape == want[name].shape, \
            f"{name}: {got[name].shape} != {want[name].shape}"
        if exact:
            assert got[name].dtype == want[name].dtype, \
                f"{name}: {got[name].dtype} != {want[name].dtype}"
            assert np.array_equal(got[name].view(np.uint8), want[name].view(np.uint8)), \
                f"{name} differs bitwise"
        else:
            np.testing.assert_allclose(got[name], want[name], atol=atol, rtol=0, err_msg=name)


def dequantized_reference(config, params, qtype) -> dict:
    """What a loader must return for a GGUF written in `qtype`: our params pushed through the same
    quantize -> dequantize, in our layout (1-D tensors stay F32)."""
    ref = {}
    for name, w in params.items():
        if w.ndim - (1 if name.startswith("layers.") else 0) == 1 or qtype == Q.F32:
            ref[name] = w.astype(np.float32)
            continue
        if qtype == Q.F16:
            ref[name] = w.astype(np.float16).astype(np.float32)
            continue
        # blocks run along the input dim: rows of HF's [out, in]; the embedding is [V, D] already
        flip = name != "embed"
        hf = np.ascontiguousarray(np.swapaxes(w, -1, -2) if flip else w)
        deq = gguf.quants.dequantize(gguf.quants.quantize(hf, qtype), qtype).reshape(hf.shape)
        ref[name] = np.swapaxes(deq, -1, -2) if flip else deq
    return ref


# ---- Hugging Face directory --------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_hf_directory_round_trip_keeps_values_and_dtype(tmp_path, dtype):
    config, params = random_model(dtype=dtype)
    save_hf_directory(tmp_path, config, params, tiny_tokenizer())
    loaded = load_model(str(tmp_path), progress=False)
    assert loaded.config == config
    assert_same_params(loaded.params, params)
    assert loaded.tokenizer.encode("the cat") == tiny_tokenizer().encode("the cat")
    assert loaded.tokenizer.eos_token_ids == (2,)


def test_hf_directory_with_tied_embeddings_has_no_lm_head(tmp_path):
    config, params = random_model(tie_word_embeddings=True)
    save_hf_directory(tmp_path, config, params, tiny_tokenizer())
    loaded = load_model(str(tmp_path), progress=False)
    assert "lm_head" not in loaded.params
    assert_same_params(loaded.params, params)


def test_hf_directory_merges_generation_config_stop_tokens(tmp_path):
    config, params = random_model()
    save_hf_directory(tmp_path, config, params, tiny_tokenizer())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    loaded = load_model(str(tmp_path), progress=False)
    assert loaded.config.eos_token_ids == (2, 0)
    assert loaded.tokenizer.eos_token_ids == (2, 0)


def test_hf_directory_bos_follows_the_tokenizer(tmp_path):
    from jaxserve.model.text.tokenizer import Tokenizer
    from model_fixtures import tiny_vocab

    config, params = random_model(add_bos_token=False)
    adds_bos = Tokenizer.from_gguf(dict(tiny_vocab(), **{"tokenizer.ggml.add_bos_token": True}))
    save_hf_directory(tmp_path, config, params, adds_bos)
    loaded = load_model(str(tmp_path), progress=False)
    assert loaded.config.add_bos_token and loaded.tokenizer.encode(" the")[0] == 1


# ---- GGUF ----------------------------------------------------------------------------------------

def test_gguf_f32_round_trip_undoes_llama_cpp_qk_permutation(tmp_path):
    config, params = random_model()
    loaded = load_gguf(write_gguf(tmp_path / "m.gguf", config, params), progress=False)
    assert_same_params(loaded.params, params)


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_gguf_quantized_types_dequantize_like_ggml(tmp_path, qtype):
    config, params = random_model(seed=1)
    loaded = load_gguf(write_gguf(tmp_path / "m.gguf", config, params, qtype=qtype), progress=False)
    assert all(v.dtype == np.float32 for v in loaded.params.values())
    assert_same_params(loaded.params, dequantized_reference(config, params, qtype), exact=False,
                       atol=1e-7)
    # and the quantized model is still close to the original
    tolerance = {Q.F16: 1e-3, Q.BF16: 2e-3, Q.Q8_0: 5e-3, Q.Q4_0: 0.1, Q.Q4_1: 0.1}[qtype]
    assert_same_params(loaded.params, params, exact=False, atol=tolerance)


def test_gguf_metadata_becomes_the_config(tmp_path):
    config, params = random_model(rope_theta=50000.0, rms_norm_eps=1e-6,
                                  max_position_embeddings=1024, name="tiny-gguf")
    loaded = load_gguf(write_gguf(tmp_path / "m.gguf", config, params), progress=False)
    want = dataclasses.replace(config, rms_norm_eps=float(np.float32(1e-6)))
    assert loaded.config == want
    assert loaded.tokenizer.chat_template is not None
    assert loaded.source == str(tmp_path / "m.gguf")


def test_gguf_without_output_tensor_ties_the_head_to_the_embedding(tmp_path):
    config, params = random_model(tie_word_embeddings=True)
    loaded = load_gguf(write_gguf(tmp_path / "m.gguf", config, params), progress=False)
    assert loaded.config.tie_word_embeddings and "lm_head" not in loaded.params
    assert_same_params(loaded.params, params)


def test_gguf_qwen2_keeps_qk_rows_and_reads_biases(tmp_path):
    config, params = random_model(architecture="qwen2", attention_bias=True)
    loaded = load_gguf(write_gguf(tmp_path / "m.gguf", config, params), progress=False)
    assert loaded.config.architecture == "qwen2" and loaded.config.attention_bias
    assert_same_params(loaded.params, params)


def test_gguf_llama_biases_are_unpermuted_like_weights(tmp_path):
    config, params = random_model(attention_bias=True)
    loaded = load_gguf(write_gguf(tmp_path / "m.gguf", config, params), progress=False)
    assert_same_params(loaded.params, params)


def test_gguf_rope_freqs_become_llama3_rope_scaling(tmp_path):
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)
    config, params = random_model(rope_theta=500000.0, head_dim=64, num_heads=2, num_kv_heads=1)
    factors = llama3_rope_factors(scaling, config.head_dim, config.rope_theta).astype(np.float32)
    path = write_gguf(tmp_path / "m.gguf", config, params,
                      extra_tensors=[("rope_freqs.weight", factors, None)])
    assert load_gguf(path, progress=False).config.rope_scaling == scaling


# ---- Orbax checkpoints ---------------------------------------------------------------------------

@pytest.mark.parametrize("source", ["hf-bf16", "gguf-q8"])
def test_convert_to_orbax_restores_bit_identical_params(tmp_path, source):
    if source == "hf-bf16":
        config, params = random_model(dtype=ml_dtypes.bfloat16)
        save_hf_directory(tmp_path / "src", config, params, tiny_tokenizer())
        spec = str(tmp_path / "src")
    else:
        config, params = random_model()
        spec = str(write_gguf(tmp_path / "m.gguf", config, params, qtype=Q.Q8_0))
    original = load_model(spec, progress=False)
    convert(spec, tmp_path / "ckpt", progress=False)
    restored = load_model(str(tmp_path / "ckpt"), progress=False)
    assert restored.config == original.config
    assert_same_params(restored.params, original.params)
    assert all(isinstance(v, np.ndarray) for v in restored.params.values())
    text = "<|im_start|>the other"
    assert restored.tokenizer.encode(text) == original.tokenizer.encode(text)
    assert restored.tokenizer.chat_template == original.tokenizer.chat_template


def test_checkpoint_restores_into_given_shardings(tmp_path):
    import jax
    from jaxserve.model.loaders.checkpoint import load_checkpoint

    config, params = random_model(dtype=ml_dtypes.bfloat16)
    save_hf_directory(tmp_path / "src", config, params, tiny_tokenizer())
    convert(str(tmp_path / "src"), tmp_path / "ckpt", progress=False)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    restored = load_checkpoint(tmp_path / "ckpt", shardings={k: sharding for k in params})
    for name, value in restored.params.items():
        assert isinstance(value, jax.Array) and value.sharding == sharding, name
        assert np.array_equal(np.asarray(value).view(np.uint8), params[name].view(np.uint8)), name


def test_convert_refuses_a_non_empty_directory(tmp_path):
    config, params = random_model()
    save_hf_directory(tmp_path / "src", config, params, tiny_tokenizer())
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        convert(str(tmp_path / "src"), tmp_path / "dst", progress=False)


# ---- errors --------------------------------------------------------------------------------------

def test_missing_model_path_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf(tmp_path / "nope.gguf")


def test_directory_without_a_model_is_rejected(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no model"):
        load_model(str(tmp_path))


def test_unsupported_quant_type_names_tensor_and_type(tmp_path):
    config, params = random_model()
    tensors = gguf_tensors(config, params)
    blk = tensors.pop("blk.1.ffn_up.weight")  # [F, D] = [96, 64]
    raw = np.zeros((blk.shape[0], blk.shape[1] // 32 * 18), np.uint8)  # IQ4_NL: 18 B / 32 values
    path = write_gguf(tmp_path / "m.gguf", config, params, tensors=tensors,
                      extra_tensors=[("blk.1.ffn_up.weight", raw, Q.IQ4_NL)])
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight.*IQ4_NL"):
        load_gguf(path, progress=False)


def test_gguf_tensor_with_wrong_shape_names_both_shapes(tmp_path):
    config, params = random_model()
    tensors = gguf_tensors(config, params)
    tensors["blk.0.attn_v.weight"] = tensors["blk.0.attn_v.weight"][:16]
    path = write_gguf(tmp_path / "m.gguf", config, params, tensors=tensors)
    with pytest.raises(ValueError, match=r"blk\.0\.attn_v\.weight.*\(16, 64\).*\(32, 64\)"):
        load_gguf(path, progress=False)


def test_safetensors_tensor_with_wrong_shape_names_both_shapes(tmp_path):
    from safetensors.numpy import save_file

    config, params = random_model()
    save_hf_directory(tmp_path, config, params, tiny_tokenizer())
    state = to_hf_state_dict(config, params)
    state["model.layers.1.mlp.down_proj.weight"] = np.zeros((64, 95), np.float32)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight.*\(64, 95\)"
                                         r".*\(64, 96\)"):
        load_model(str(tmp_path), progress=False)


def test_missing_tensor_is_reported(tmp_path):
    config, params = random_model()
    tensors = gguf_tensors(config, params)
    del tensors["blk.1.attn_k.weight"]
    path = write_gguf(tmp_path / "m.gguf", config, params, tensors=tensors)
    with pytest.raises(ValueError, match=r"missing tensors: layers\.wk\[layer 1\]"):
        load_gguf(path, progress=False)


def test_unsupported_architecture_is_rejected(tmp_path):
    config, params = random_model()
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        load_gguf(write_gguf(tmp_path / "m.gguf", config, params, arch="gpt2"), progress=False)
    save_hf_directory(tmp_path / "hf", config, params, tiny_tokenizer())
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    hf_config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf_config))
    with pytest.raises(ValueError, match="unsupported architecture"):
        load_model(str(tmp_path / "hf"), progress=False)


# ---- transformers as the independent oracle ------------------------------------------------------

def test_tiny_gguf_and_hf_directory_load_like_transformers(tmp_path):
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM

    config, params = random_model(seed=3)
    write_gguf(tmp_path / "m.gguf", config, params, qtype=Q.Q8_0)
    ours = to_hf_state_dict(config, load_gguf(tmp_path / "m.gguf", progress=False).params)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32)
    theirs = {k: v.numpy() for k, v in hf.state_dict().items()}
    for name, value in ours.items():
        np.testing.assert_allclose(value, theirs[name], atol=1e-6, rtol=0, err_msg=name)

    save_hf_directory(tmp_path / "hf", config, params, tiny_tokenizer())
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    theirs = {k: v.numpy() for k, v in hf.state_dict().items()}
    for name, value in to_hf_state_dict(config, params).items():
        np.testing.assert_array_equal(value, theirs[name], err_msg=name)


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_other_quant_types_dequantize_like_transformers(qtype):
    pytest.importorskip("transformers")
    import torch
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    # clearing bit 6 of every byte keeps each fp16 scale finite (exponent < 31)
    raw = (rng.integers(0, 256, (4, 2 * block_bytes), dtype=np.uint8) & 0xBF).astype(np.uint8)
    ours = gguf.quants.dequantize(raw, qtype).reshape(-1)
    theirs = hf_dequantize(torch.from_numpy(raw.reshape(-1)), int(qtype)).numpy()
    assert ours.shape == (4 * 2 * block_elems,)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_default_model_params_equal_transformers_gguf_loader():
    pytest.importorskip("transformers")
    model = real_default_model()
    hf = hf_default_model()
    theirs = {k: v.numpy() for k, v in hf.state_dict().items()}
    ours = to_hf_state_dict(model.config, model.params)
    assert set(ours) <= set(theirs)
    for name, value in ours.items():
        np.testing.assert_allclose(value, theirs[name], atol=1e-6, rtol=0, err_msg=name)


def test_fast_gguf_reader_parses_exactly_like_gguf_reader(tmp_path):
    from jaxserve.model.loaders import gguf_loader

    config, params = random_model()
    path = write_gguf(tmp_path / "m.gguf", config, params, qtype=Q.Q4_1)
    fast, plain = gguf_loader._READER(path), gguf.GGUFReader(path)
    assert gguf_loader.read_metadata(fast) == gguf_loader.read_metadata(plain)
    assert [t.name for t in fast.tensors] == [t.name for t in plain.tensors]
    for a, b in zip(fast.tensors, plain.tensors):
        assert a.tensor_type == b.tensor_type and list(a.shape) == list(b.shape), a.name
        assert np.array_equal(a.data, b.data), a.name
