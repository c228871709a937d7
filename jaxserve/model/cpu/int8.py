"""The CPU's int8 x int8 -> int32 matmul: jaxserve's FFI kernel (kernels/int8_matmul.cc,
built and registered by cpu_ffi.py), or XLA's dot_general where it can't run.

Why: XLA on the CPU hands an int8 dot to YNNPACK, whose every call repacks the weight matrix
(the weights are runtime arguments, never constants), so per-channel int8 layers read their
bytes about three times. The kernel reads them once, as stored, over XLA's intra-op threads.
Measured on the 2-core CPU (scripts/bench_cpu_kernels.py), SmolLM2's 30 layers of seven
matrices in one jit: 2 rows (batch 1's two activation levels) 12.1 ms against YNNPACK's 24.2
and float32's 35.4; no slower than YNNPACK up to 1024 rows. Its sums are exact int32s, so its result is XLA's dot_general bit for
bit: which of the two runs never changes a token. This module knows nothing of models.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.model.cpu import ffi as cpu_ffi

NAME = "int8_matmul"
TARGET = "jaxserve_int8_matmul"


def available() -> bool:
    return cpu_ffi.ready(NAME, {TARGET: "JaxserveInt8Matmul"}, "int8 x int8 dots")


def _xla_dot(a, w):
    return jax.lax.dot_general(a, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)


def matmul(a: jax.Array, w: jax.Array, kernel: bool = True) -> jax.Array:
    """a int8 [R, K] (values in [-127, 127]) times w int8 [N, K] -> int32 [R, N], exact;
    kernel False: XLA's dot even where the kernel runs (the runner measures both per bucket:
    model/quant/measure.py)."""
    if not kernel or not available():
        return _xla_dot(a, w)
    out = jax.ShapeDtypeStruct((a.shape[0], w.shape[0]), jnp.int32)
    kernel = jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")
    # the kernel only where the step is lowered for the CPU: a step lowered on this host
    # ahead of time for a TPU or GPU gets XLA's dot (the kernel exists on no other platform)
    return jax.lax.platform_dependent(a, w, cpu=kernel, default=_xla_dot)
