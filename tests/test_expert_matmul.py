"""The two grouped forms of the expert matmul agree: `tiled` (the CPU's: groups padded to whole
tiles, a loop over tiles) and `ragged_dot` (TPU and GPU), float and quantized, for any group
sizes, tile size and rows that belong to no group (a device's pairs held elsewhere)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.model import expert_matmul, quant
from jaxserve.model.qlinear import QuantizedWeight

E, D, F = 8, 64, 32


def _stack(rng, mode):
    """An [E, in, out] expert stack: float, or quantized as the loader quantizes experts."""
    w = (0.05 * rng.standard_normal((E, D, F))).astype(np.float32)
    if mode == "float":
        return jnp.asarray(w)
    return QuantizedWeight(quant.quantize(w, mode, "layers.e_up")).value()


@pytest.mark.parametrize("mode", ["float", "int8", "int4"])
@pytest.mark.parametrize("num_rows,held,tile", [(1, 1, None), (9, 9, 1), (16, 10, None),
                                                (40, 40, 3), (40, 25, 7), (200, 200, None)])
def test_tiled_equals_ragged_dot(mode, num_rows, held, tile):
    rng = np.random.default_rng(num_rows * 7 + held)
    w = _stack(rng, mode)
    experts = np.sort(rng.integers(0, E, num_rows))
    sizes = jnp.asarray(np.bincount(experts[:held], minlength=E), jnp.int32)
    rows = jnp.asarray(rng.standard_normal((num_rows, D)), jnp.float32)
    expert_of_row = jnp.asarray(experts, jnp.int32)
    tiled = jax.jit(expert_matmul.tiled, static_argnums=3)(rows, w, sizes, tile)
    expert_matmul.GROUPED, saved = "ragged_dot", expert_matmul.GROUPED
    try:
        want = jax.jit(expert_matmul.grouped)(rows, w, sizes, expert_of_row)
    finally:
        expert_matmul.GROUPED = saved
    # per-channel int8 on the CPU multiplies int8 activations (qlinear.int8_dot: ~15 bits of
    # them), the ragged_dot form the dequantized weights: outputs ~0.4 agree to ~1e-4
    atol = 2e-4 if mode == "int8" else 2e-5
    np.testing.assert_allclose(np.asarray(tiled)[:held], np.asarray(want)[:held], atol=atol)
