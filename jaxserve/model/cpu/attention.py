"""Paged decode attention on the CPU: jaxserve's FFI kernel (kernels/decode_attention.cc,
built and registered by cpu_ffi.py), for the XLA path's decode rows.

Why: in XLA's ops (model/decoder/decode_attention.py) a layer's decode attention is a gather of each
request's K/V tiles into a new array, then two small batched matmuls that XLA hands to YNNPACK
(which repacks the gathered K/V again), a scatter-merge per chunk, and a while loop: on the
2-core CPU ~0.2 ms a layer at batch 1 for a few hundred positions, mostly per-op cost. The
kernel reads each request's K/V rows straight from the paged cache once, one task per
(request, KV head) over XLA's intra-op threads (docs/quantization.md, "CPU kernels", and
docs/host_loop.md: the measured figures). It computes the same attention (float32 softmax, online
over blocks of 128 positions) in another order, so it agrees with the XLA path to float32
rounding, not bit for bit; a request's result never depends on the others in the batch.

fp8 pages (float8_e4m3fn, float8_e5m2: kv_cache_dtype fp8) are read as bytes, each turned into
its float through a 256-entry table as its block of positions is fetched; the layer's k_scale
and v_scale are applied by the caller, outside (model/quant/kv.py).

`decode(...)` is the kernel's call; `usable(k_pages)` says whether it can take a cache (float32
or fp8 pages, a CPU process with one device, the kernel built). No requests, no scheduling here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model.cpu import ffi as cpu_ffi

NAME = "decode_attention"
TARGET = "jaxserve_decode_attention"


def available() -> bool:
    return cpu_ffi.ready(NAME, {TARGET: "JaxserveDecodeAttention"}, "paged decode attention")


PAGE_DTYPES = tuple(jnp.dtype(d)
                    for d in (jnp.float32, jnp.float8_e4m3fn, jnp.float8_e5m2))


def usable(k_pages) -> bool:
    return jnp.dtype(k_pages.dtype) in PAGE_DTYPES and available()


def decode(q, k_pages, v_pages, layer, page_table, kv_lens, num_decode, *, sm_scale: float,
           soft_cap: float | None = None, sliding_window: int | None = None) -> jax.Array:
    """q [S, Hq, D] (row s the query of request s, at position kv_lens[s] - 1); k_pages,
    v_pages [L, N, page_size, Hkv, D] float32 or fp8 (PAGE_DTYPES, unscaled); page_table [S, P]; requests num_decode.. and
    those with kv_lens 0 come back zero. Returns [S, Hq, D] in q's dtype."""
    if not available():
        raise RuntimeError(f"the CPU decode attention kernel can't run here: "
                           f"{cpu_ffi.reason(NAME) or 'not a one-device CPU process'}")
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    call = jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")
    i32 = lambda a: jnp.asarray(a, jnp.int32)
    result = call(q.astype(jnp.float32), k_pages, v_pages, jnp.reshape(i32(layer), ()),
                  i32(page_table), i32(kv_lens), jnp.reshape(i32(num_decode), ()),
                  sm_scale=np.float32(sm_scale), soft_cap=np.float32(soft_cap or 0.0),
                  window=np.int64(sliding_window or 0))
    return result.astype(q.dtype)
