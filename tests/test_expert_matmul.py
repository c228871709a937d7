"""The grouped forms of the expert matmul agree: `tiled` (groups padded to whole tiles, a loop
over tiles: one tile a step, the CPU's, or several as one batched matmul, the GPU's) and
`ragged_dot` (the TPU's), float and quantized, for any group sizes, tile size, tiles a step and
rows that belong to no group (a device's pairs held elsewhere)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.model.decoder import expert_matmul
from jaxserve.model.quant import formats as quant
from jaxserve.model.quant.qlinear import QuantizedWeight

E, D, F = 8, 64, 32


def _stack(rng, mode):
    """An [E, in, out] expert stack: float, or quantized as the loader quantizes experts."""
    w = (0.05 * rng.standard_normal((E, D, F))).astype(np.float32)
    if mode == "float":
        return jnp.asarray(w)
    return QuantizedWeight(quant.quantize(w, mode, "layers.e_up")).value()


@pytest.mark.parametrize("tiles_at_once", [1, 3, None])
@pytest.mark.parametrize("mode", ["float", "int8", "int4"])
@pytest.mark.parametrize("num_rows,held,tile", [(1, 1, None), (9, 9, 1), (16, 10, None),
                                                (40, 40, 3), (40, 25, 7), (200, 200, None)])
def test_tiled_equals_ragged_dot(mode, num_rows, held, tile, tiles_at_once):
    rng = np.random.default_rng(num_rows * 7 + held)
    w = _stack(rng, mode)
    experts = np.sort(rng.integers(0, E, num_rows))
    sizes = jnp.asarray(np.bincount(experts[:held], minlength=E), jnp.int32)
    rows = jnp.asarray(rng.standard_normal((num_rows, D)), jnp.float32)
    expert_of_row = jnp.asarray(experts, jnp.int32)
    tiled = jax.jit(expert_matmul.tiled, static_argnums=(3, 4))(rows, w, sizes, tile,
                                                                 tiles_at_once)
    want = jax.jit(expert_matmul.ragged)(rows, w, sizes, expert_of_row)
    # per-channel int8 one tile a step goes through qlinear.linear, which on the CPU multiplies
    # int8 activations (qlinear.int8_dot: ~15 bits of them); ragged_dot and the batched tiles
    # multiply the dequantized weights: outputs ~0.4 agree to ~1e-4
    atol = 2e-4 if mode == "int8" and tiles_at_once == 1 else 2e-5
    np.testing.assert_allclose(np.asarray(tiled)[:held], np.asarray(want)[:held], atol=atol,
                               err_msg=f"tiled ({tiles_at_once} tiles a step) != ragged_dot")


@pytest.mark.parametrize("form", ["tiled", "ragged_dot", "batched_tiles"])
def test_grouped_follows_the_override(form, monkeypatch):
    """JAXSERVE_MOE_GROUPED names the form on every platform: its result is that form's."""
    rng = np.random.default_rng(3)
    w = _stack(rng, "float")
    sizes = jnp.asarray(np.bincount(np.sort(rng.integers(0, E, 24)), minlength=E), jnp.int32)
    rows = jnp.asarray(rng.standard_normal((24, D)), jnp.float32)
    expert_of_row = jnp.repeat(jnp.arange(E), sizes, total_repeat_length=24)
    monkeypatch.setattr(expert_matmul, "GROUPED", form)
    step = lambda *a: expert_matmul.grouped(*a)  # noqa: E731  (a fresh trace: GROUPED is read then)
    traced = str(jax.make_jaxpr(step)(rows, w, sizes, expert_of_row))
    assert ("ragged_dot" in traced) == (form == "ragged_dot"), (
        f"{form}: ragged_dot {'missing from' if form == 'ragged_dot' else 'in'} the step")
    np.testing.assert_allclose(jax.jit(step)(rows, w, sizes, expert_of_row),
                               expert_matmul.ragged(rows, w, sizes, expert_of_row), atol=2e-5)
