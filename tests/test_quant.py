"""Weight-only quantization: the formats' error bounds, GGUF blocks mapped without loss, the
quantized forward pass against the float model on the same (dequantized) weights, checkpoints.
"""

from __future__ import annotations

import gguf
import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from jaxserve.model.quant import gguf as gguf_quant
from jaxserve.model.quant import qlinear
from jaxserve.model.quant import formats as quant
from jaxserve.model.loaders.checkpoint import load_checkpoint
from jaxserve.model.loaders.gguf_loader import load_gguf
from jaxserve.model.decoder.decoder import Llama
from jaxserve.model.loaders.loader import convert, load_model
from jaxserve.model.quant.select import MatmulForm
from jaxserve.runner.tensor_parallel import Placement
from model_chunks import run_in_chunks
from model_fixtures import random_model, write_gguf
from tiny_models import tiny_model

NOT_WEIGHTS = ("inv_freq", "kv_scales")  # the model's other variables (RoPE, fp8 KV scales)

def _dequantized(params: dict) -> dict:
    return {k: v.dequantize() if isinstance(v, quant.QuantizedTensor) else v
            for k, v in params.items()}


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantization_error_is_at_most_half_a_step(mode):
    w = np.random.default_rng(0).standard_normal((3, 64, 96)).astype(np.float32)  # [L, in, out]
    t = quant.quantize(w, mode, "layers.w_up")
    assert t.shape == w.shape and t.matrix_shape == (3, 96, 64)
    step = np.repeat(t.scale.astype(np.float32), t.group, axis=-1)  # [L, out, in]
    err = np.abs(t.dequantize() - w)
    assert np.all(err <= np.swapaxes(step, -1, -2) / 2 + 1e-6), \
        f"{mode}: error {err.max()} exceeds half a quantization step"


def test_int4_packs_two_values_per_byte_and_unpacks_them():
    values = np.random.default_rng(1).integers(0, 16, (5, 64)).astype(np.uint8)
    packed = quant.pack_int4(values)
    assert packed.shape == (5, 32) and packed.dtype == np.uint8
    assert np.array_equal(quant.unpack_int4(packed), values)


EXACT_FILES = [(Q.Q8_0, "int8"), (Q.Q4_0, "int8"), (Q.Q4_1, "int8"), (Q.Q5_0, "int8"),
               (Q.Q5_1, "int8"), (Q.Q4_0, "int4"), (Q.Q4_1, "int4")]


@pytest.mark.parametrize("qtype,mode", EXACT_FILES, ids=lambda v: getattr(v, "name", v))
def test_gguf_blocks_map_to_the_same_values_without_float(tmp_path, qtype, mode):
    config, params = random_model(seed=2)
    path = write_gguf(tmp_path / "m.gguf", config, params, qtype=qtype)
    want = load_gguf(path, progress=False).params  # the file dequantized to float32
    got = load_gguf(path, progress=False, quantization=mode).params
    for name in quant.MATRIX_NAMES:
        if name not in want:
            continue
        t = got[name]
        assert isinstance(t, quant.QuantizedTensor) and t.bits == int(mode[3:]), name
        assert t.group == 32, f"{name}: GGUF's 32-element blocks should stay groups of 32"
        np.testing.assert_allclose(t.dequantize(), want[name], rtol=1e-6, atol=1e-7,
                                   err_msg=f"{qtype.name} -> {mode}: {name}")


def _random_blocks(qtype, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes as GGUF blocks, their float16 super-scales set to sane values."""
    rng = np.random.default_rng(seed)
    elems, size = gguf.quants.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // elems, size), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.01, (blocks.shape[0], 2)).astype(np.float16)
    blocks[:, :4] = scales.view(np.uint8)  # Q4_K: d, dmin
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_q4_k_blocks_map_up_to_float16_scales(mode):
    data = _random_blocks(Q.Q4_K, 8, 512)
    want = gguf_quant.dequantize_tensor(Q.Q4_K, data, (8, 512))
    t = gguf_quant.map_tensor(Q.Q4_K, data, 8, 512, mode)
    t.transposed = False
    step = np.repeat(t.scale.astype(np.float32), 32, axis=-1)
    err = np.abs(t.dequantize() - want)
    # d * sc and dmin * m rounded to float16: 2^-11 relative, times at most 15 steps and a zero
    assert np.all(err <= 16 * 2.0 ** -11 * (np.abs(want) + step) + 1e-7), err.max()


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("layer_loop,chunked,chunk_bytes,tied", [
    ("scan", True, 0, True), ("unroll", True, 0, False), ("unroll", True, 4096, True),
    ("unroll", True, 4096, False), ("scan", False, 4096, True), ("unroll", False, 4096, False)])
def test_quantized_forward_equals_the_float_model_on_the_dequantized_weights(
        mode, tied, layer_loop, chunked, chunk_bytes, monkeypatch):
    """The chunked (CPU) form with chunk_bytes 4096: every matrix and the head dequantized a
    few rows at a time, for a tied and an untied head; with whole matrices (0), scan and
    unroll take one head each (a tied and an untied head run the same qlinear code, on the
    embedding or lm_head). The fused (accelerator) form: one dequantize-then-dot whatever
    CHUNK_BYTES says. int8 activations: tests/test_quant_int8_dot.py."""
    monkeypatch.setattr(qlinear, "CHUNK_BYTES", chunk_bytes)
    form = MatmulForm(int8_activations=False, chunked=chunked)
    config, params = tiny_model(seed=3, tie_word_embeddings=tied)
    quantized = quant.quantize_params(params, mode)
    tokens = np.random.default_rng(7).integers(0, config.vocab_size, 45).tolist()
    pages = [3, 1, 7, 2, 5, 4, 6]
    want = run_in_chunks(Llama(config, _dequantized(quantized)), config, tokens, [45], pages)
    got = run_in_chunks(Llama(config, quantized, layer_loop=layer_loop, quant_form=form),
                        config, tokens, [20, 1, 24], pages)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5,
                               err_msg=f"{mode} logits differ from dequantize-then-float")


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_device_bytes_are_those_of_the_arrays_on_device(mode):
    config, params = tiny_model(seed=0)
    quantized = quant.quantize_params(params, mode)
    _, state = Placement(None, config).model(quantized, np.float32, "unroll")
    on_device = sum(leaf.nbytes for path, leaf in jax.tree_util.tree_leaves_with_path(state)
                    if not any(v in jax.tree_util.keystr(path) for v in NOT_WEIGHTS))
    assert on_device == quant.device_bytes(quantized, 4)
    kinds = {str(leaf.dtype) for leaf in jax.tree_util.tree_leaves(state)}
    assert ("int8" if mode == "int8" else "uint8") in kinds, kinds


def test_quantized_checkpoint_restores_the_stored_arrays(tmp_path):
    config, params = random_model(seed=4)
    src = write_gguf(tmp_path / "m.gguf", config, params, qtype=Q.Q4_1)
    convert(str(src), tmp_path / "ckpt", progress=False, quantization="int4")
    want = load_gguf(src, progress=False, quantization="int4").params
    got = load_checkpoint(tmp_path / "ckpt").params
    for name, t in want.items():
        if isinstance(t, quant.QuantizedTensor):
            g = got[name]
            assert (g.bits, g.group, g.transposed) == (t.bits, t.group, t.transposed), name
            for part in ("q", "scale", "zero"):
                assert np.array_equal(getattr(g, part), getattr(t, part)), f"{name}.{part}"
        else:
            assert np.array_equal(got[name], t), name
    assert quant.stored_mode(load_model(str(tmp_path / "ckpt"), progress=False).params) == "int4"
    with pytest.raises(ValueError, match="quantization='int8'.*stored as int4"):
        load_model(str(tmp_path / "ckpt"), progress=False, quantization="int8")


def test_an_unknown_quantization_is_an_error_naming_it():
    config, params = tiny_model()
    with pytest.raises(ValueError, match="quantization='fp8'"):
        quant.quantize_params(params, "fp8")
    from jaxserve.config import EngineConfig
    with pytest.raises(ValueError, match="quantization='int3'"):
        EngineConfig.from_kwargs(quantization="int3")
