"""Roofline for batch-1 decode: this machine's memory bandwidth and matmul rate, and the bound.

A decode step at batch 1 must read every weight its token uses once plus the request's KV
cache, so its time is at least (weight bytes + KV bytes) / memory bandwidth. The weights a token
uses are the model's active parameters (ModelConfig.num_active_params()): all of a dense model,
but of a mixture-of-experts model only the experts its token is routed to (k of E per layer)
besides the shared weights, so the bound counts those, not the total. `measure_machine` times
reads and a copy of a large array (numpy, XLA, and a matrix-vector product like decode's) and a
large f32 matmul once; `decode_bound` turns a model's sizes into that bound. Measurement only:
it builds no engine and keeps no state.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class MachineRates:
    copy_gbs: float          # numpy copy of a large f32 array: (bytes read + written) / s
    read_gbs: float          # numpy sum over it: bytes read / s
    jax_read_gbs: float      # jnp.sum over it, through XLA
    matvec_read_gbs: float   # a [1, k] x [k, n] jnp matmul: the weight bytes read / s (decode)
    matmul_gflops: float     # f32 jnp.dot of two n x n matrices
    matmul_n: int
    array_bytes: int

    @property
    def bandwidth_gbs(self) -> float:
        """The fastest read rate seen: the bound uses the best the machine showed."""
        return max(self.read_gbs, self.jax_read_gbs, self.matvec_read_gbs)

    def to_dict(self) -> dict:
        return {**asdict(self), "bandwidth_gbs": self.bandwidth_gbs}


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm: page faults, compilation
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_machine(array_bytes: int = 512 << 20, matmul_n: int = 2048,
                    repeats: int = 5) -> MachineRates:
    """Best of `repeats` for each (the run least disturbed by other processes)."""
    import jax
    import jax.numpy as jnp

    n = array_bytes // 4
    src = np.ones(n, dtype=np.float32)
    dst = np.empty_like(src)
    copy_s = _best_seconds(lambda: np.copyto(dst, src), repeats)
    read_s = _best_seconds(src.sum, repeats)
    del dst
    x = jnp.asarray(src)
    del src
    jsum = jax.jit(jnp.sum)
    jax_read_s = _best_seconds(lambda: jsum(x).block_until_ready(), repeats)
    weights = x.reshape(4096, n // 4096)  # [k, n]: one weight matrix of array_bytes
    row = jnp.ones((1, 4096), jnp.float32)
    matvec = jax.jit(jnp.dot)
    matvec_s = _best_seconds(lambda: matvec(row, weights).block_until_ready(), repeats)
    del x, weights
    a = jnp.ones((matmul_n, matmul_n), jnp.float32)
    dot_s = _best_seconds(lambda: matvec(a, a).block_until_ready(), repeats)
    return MachineRates(copy_gbs=2 * array_bytes / copy_s / 1e9,
                        read_gbs=array_bytes / read_s / 1e9,
                        jax_read_gbs=array_bytes / jax_read_s / 1e9,
                        matvec_read_gbs=array_bytes / matvec_s / 1e9,
                        matmul_gflops=2 * matmul_n ** 3 / dot_s / 1e9, matmul_n=matmul_n,
                        array_bytes=array_bytes)


def decode_bound(num_weight_params: int, weight_bytes_per_param: int,
                 kv_bytes_per_token: int, context_len: float, bandwidth_gbs: float) -> dict:
    """Bytes one batch-1 decode step reads and the time that takes at `bandwidth_gbs`.

    num_weight_params: the active parameters, ModelConfig.num_active_params() (a MoE model's
    experts its token is not routed to are not read). Each is read once (a tied embedding counts
    once: the output head reads it all, the input lookup one row); the KV cache is read for
    `context_len` tokens."""
    weight_bytes = num_weight_params * weight_bytes_per_param
    kv_bytes = int(kv_bytes_per_token * context_len)
    total = weight_bytes + kv_bytes
    return {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "bytes_per_step": total,
            "bound_s": total / (bandwidth_gbs * 1e9)}
