"""jaxserve's CPU int8 matmul kernel (model/cpu/int8.py): it builds on this machine, equals
XLA's int8 dot_general bit for bit on every shape class (rows odd and even, inputs not a
multiple of 32, the extreme values -128 / 127), inside jit and lax.scan, and per-channel int8
layers run it in their compiled program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.model.cpu import ffi as cpu_ffi
from jaxserve.model.cpu import int8 as cpu_int8
from jaxserve.model.quant import qlinear
from jaxserve.model.quant.select import MatmulForm


def test_the_kernel_builds_and_registers_here():
    assert cpu_int8.available(), (
        f"the CPU int8 kernel is not in use: {cpu_ffi.reason(cpu_int8.NAME)} (it needs a C++ "
        "compiler; a machine without one runs XLA's slower dot)")


def _operands(rows: int, inp: int, out: int, seed: int):
    rng = np.random.default_rng(seed)
    a = rng.integers(-127, 128, (rows, inp), dtype=np.int8)
    w = rng.integers(-128, 128, (out, inp), dtype=np.int8)
    a[0, : min(inp, 40)] = 127   # the extremes: products of 127 x -128 in every lane
    w[0, : min(inp, 40)] = -128
    if rows > 1:
        a[1, : min(inp, 40)] = -127
    return jnp.asarray(a), jnp.asarray(w)


@pytest.mark.parametrize("rows,inp,out", [(1, 5, 3), (2, 32, 1), (3, 576, 192),
                                          (7, 1000, 67), (2, 1536, 576), (64, 64, 1537)])
def test_the_kernel_equals_xlas_int8_dot(rows, inp, out):
    a, w = _operands(rows, inp, out, seed=rows * inp + out)
    want = np.asarray(a).astype(np.int64) @ np.asarray(w).astype(np.int64).T
    got = np.asarray(jax.jit(cpu_int8.matmul)(a, w))
    xla = np.asarray(jax.jit(cpu_int8._xla_dot)(a, w))
    assert got.dtype == np.int32 and got.shape == (rows, out)
    assert np.array_equal(got, want), f"[{rows},{inp}] x [{out},{inp}]: kernel != int64 oracle"
    assert np.array_equal(got, xla), f"[{rows},{inp}] x [{out},{inp}]: kernel != XLA's dot"


def test_the_kernel_runs_in_a_scan_over_stacked_layers():
    a, _ = _operands(4, 96, 96, seed=1)
    ws = jnp.stack([_operands(1, 96, 96, seed=s)[1] for s in range(3)])  # [3, 96, 96]

    def layers(mm):
        def body(carry, w):
            out = mm(carry, w)                                          # [4, 96] int32
            return jnp.clip(out >> 10, -127, 127).astype(jnp.int8), out
        return jax.lax.scan(body, a, ws)[1]

    got = np.asarray(jax.jit(lambda: layers(cpu_int8.matmul))())
    want = np.asarray(jax.jit(lambda: layers(cpu_int8._xla_dot))())
    assert np.array_equal(got, want), "a scanned stack of kernel calls differs from XLA's dots"


def test_a_per_channel_int8_layers_program_calls_the_kernel():
    w = qlinear.QArray(jnp.ones((192, 576), jnp.int8), jnp.ones((192, 1)), None, 8, 576,
                       MatmulForm(int8_activations=True, chunked=True))
    text = jax.jit(lambda x: qlinear.linear(x, w)).lower(jnp.ones((2, 576))).as_text()
    assert cpu_int8.TARGET in text, "per-channel int8 linear does not call the CPU kernel"


def test_a_failed_build_or_the_off_switch_is_a_reason_not_an_error(tmp_path):
    failing = cpu_ffi.KernelSettings(cache_dir=str(tmp_path / "kernels"), compiler="/bin/false")
    reason = cpu_ffi._load(cpu_int8.NAME, {"jaxserve_test_unused": "JaxserveInt8Matmul"},
                           failing)
    assert reason and "/bin/false failed" in reason, reason
    assert not list((tmp_path / "kernels").iterdir()), "a failed build left a file behind"
    missing = cpu_ffi.KernelSettings(cache_dir=str(tmp_path / "kernels"),
                                     compiler="no-such-compiler-here")
    reason = cpu_ffi._load(cpu_int8.NAME, {}, missing)
    assert reason and "no C++ compiler" in reason and "no-such-compiler-here" in reason, reason
    off = cpu_ffi.KernelSettings(mode="off")
    assert cpu_ffi._load(cpu_int8.NAME, {}, off) == "cpu_kernels=off"
    with cpu_ffi.using(off):
        assert not cpu_int8.available() and cpu_ffi.reason(cpu_int8.NAME) == "cpu_kernels=off"
    assert cpu_int8.available(), "the off switch outlived its `using` block"
