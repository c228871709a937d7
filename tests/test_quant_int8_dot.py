"""The CPU's int8 matmul (qlinear.int8_dot): per-channel int8 weights times activations
quantized per row in two int8 levels, one int8 x int8 -> int32 dot. It equals its numpy oracle,
a row's result does not depend on the rows around it, and the compiled CPU program reads the
int8 weights without making a float or int32 copy of them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.model.quant import qlinear
from jaxserve.model.quant import formats as quant
from jaxserve.model.quant.select import MatmulForm

IN, OUT = 96, 80


def _weight(seed: int = 0) -> qlinear.QArray:
    w = np.random.default_rng(seed).standard_normal((OUT, IN)).astype(np.float32)
    t = quant.quantize_int8(w, transposed=False)
    return qlinear.QArray(jnp.asarray(t.q), jnp.asarray(t.scale), None, 8, IN)


def _rows(t: int, seed: int = 1) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((t, IN)).astype(np.float32)
    x[:, 3] *= 40  # an outlier channel, as LLM activations have
    return x


def _oracle(x: np.ndarray, w: qlinear.QArray) -> np.ndarray:
    """The same two-level quantization in numpy, the integer sums in int64."""
    def rows(a):
        s = np.maximum(np.abs(a).max(-1, keepdims=True), 1e-30) / np.float32(127)
        return np.clip(np.round(a / s), -127, 127).astype(np.int64), s.astype(np.float32)
    qx, sx = rows(x)
    qr, sr = rows(x - qx.astype(np.float32) * sx)
    q = np.asarray(w.q).astype(np.int64)
    scale = np.asarray(w.scale)[:, 0]
    return ((qx @ q.T).astype(np.float32) * sx + (qr @ q.T).astype(np.float32) * sr) * scale


@pytest.mark.parametrize("t", [1, 2, 5, 16])
def test_int8_dot_equals_its_numpy_oracle(t):
    w, x = _weight(), _rows(t)
    got = np.asarray(jax.jit(lambda a: qlinear.int8_dot(a, w, jnp.float32))(x))
    np.testing.assert_allclose(got, _oracle(x, w), rtol=1e-5, atol=1e-5,
                               err_msg=f"int8_dot of {t} rows differs from the oracle")


def test_int8_dot_is_within_two_int8_levels_of_the_float_product():
    w, x = _weight(), _rows(8)
    want = x @ np.asarray(quant.QuantizedTensor(np.asarray(w.q), np.asarray(w.scale), None, 8,
                                                IN, transposed=True).dequantize())
    got = np.asarray(qlinear.int8_dot(jnp.asarray(x), w, jnp.float32))
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-3, f"relative error {err:.2e} to the float product of the same weights"


def test_a_rows_result_does_not_depend_on_the_rows_around_it():
    w, x = _weight(), _rows(16)
    fn = jax.jit(lambda a: qlinear.int8_dot(a, w, jnp.float32))
    alone = np.asarray(fn(x[5:6]))[0]
    for t in (2, 4, 16):
        batch = np.asarray(fn(np.concatenate([x[5:6], x[:t - 1]])))[0]
        assert np.array_equal(batch, alone), f"row 5 changed in a batch of {t} rows"


@pytest.mark.parametrize("chunked", [True, False])
def test_linear_takes_int8_dot_for_per_channel_int8_only_where_chosen(chunked):
    w, x = _weight(), jnp.asarray(_rows(3))
    on = dataclasses.replace(w, form=MatmulForm(int8_activations=True, chunked=chunked))
    assert np.array_equal(np.asarray(qlinear.linear(x, on)),
                          np.asarray(qlinear.int8_dot(x, w, x.dtype)))
    off = dataclasses.replace(w, form=MatmulForm(int8_activations=False, chunked=chunked))
    dequantized = x @ qlinear.dequantize(w).T
    np.testing.assert_allclose(np.asarray(qlinear.linear(x, off)), np.asarray(dequantized),
                               rtol=1e-5, atol=1e-5)
    grouped = quant.quantize_int8(np.ones((OUT, IN), np.float32), transposed=False)
    grouped_w = qlinear.QArray(jnp.asarray(grouped.q), jnp.ones((OUT, 3)), None, 8, 32)
    assert not qlinear.per_channel_int8(grouped_w), "groups of 32 are not per channel"


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU compiler property")
@pytest.mark.parametrize("t", [1, 4, 16])
def test_the_cpu_program_makes_no_wider_copy_of_the_int8_weights(t):
    out, inp = 1536, 576
    w = qlinear.QArray(jnp.ones((out, inp), jnp.int8), jnp.ones((out, 1)), None, 8, inp)
    x = jnp.ones((t, inp))
    hlo = jax.jit(lambda a, q: qlinear.int8_dot(a, q, jnp.float32)).lower(x, w).compile()
    text = hlo.as_text()
    for dtype in ("f32", "s32", "bf16"):
        assert f"{dtype}[{out},{inp}]" not in text and f"{dtype}[{inp},{out}]" not in text, \
            f"{t} rows: the compiled dot widens the weights to {dtype}"


@pytest.mark.parametrize("chunked", [True, False], ids=["cpu-form", "accelerator-form"])
def test_the_model_with_int8_activations_stays_close_to_the_float_model(chunked):
    """The whole forward pass (tiny Llama, per-channel int8, tied head) against the float model
    on the same dequantized weights: only the activations' two-level rounding differs. The
    accelerator form (int8 activations forced on with fused dequantization, as a TPU with an
    int8 MXU runs it) is the same arithmetic: XLA's int8 dot here."""
    from model_chunks import run_in_chunks
    from test_quant import _dequantized
    from jaxserve.model.decoder.decoder import Llama
    from tiny_models import tiny_model

    form = MatmulForm(int8_activations=True, chunked=chunked)
    config, params = tiny_model(seed=3, tie_word_embeddings=True)
    quantized = quant.quantize_params(params, "int8")
    tokens = np.random.default_rng(7).integers(0, config.vocab_size, 45).tolist()
    pages = [3, 1, 7, 2, 5, 4, 6]
    want = run_in_chunks(Llama(config, _dequantized(quantized)), config, tokens, [45], pages)
    got = run_in_chunks(Llama(config, quantized, quant_form=form), config, tokens, [20, 1, 24],
                        pages)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-3, f"logits' relative error {err:.2e} with int8 activations"
