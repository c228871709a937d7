"""Quantized weights on device: the NNX holder of a QuantizedTensor's arrays, and the matmul,
token lookup and head that dequantize them inside the compiled step, next to their use.

`QuantizedWeight` keeps q / scale / zero as separate nnx.Params in their stored dtypes (int8,
uint8 nibbles, float16 / float32); `value()` gives a `QArray` pytree, which lax.scan slices by
layer like any array. `linear(x, w)` is `x @ w` for a float [in, out] array, and for a QArray it
dequantizes [out, in] to x's dtype and contracts on `in`.

Why the dequantization is tied to the activation: the weights do not depend on the step's
inputs, so XLA's scheduler is free to run every layer's dequantization at the start of the step;
on the CPU it did, and the step then held all layers' float32 weights at once (56 MB for 16
matrices of SmolLM2's MLP: 47 ms instead of 0.8 ms, past the 32 MB L3). `_after(x)` is a zero
XLA cannot prove zero (a bit count shifted out), computed from x, which pins each
dequantization after the activation it multiplies. XLA on the CPU does not fuse a convert into
its dot: the float32 weights are written and read back, so a matrix is dequantized CHUNK_BYTES
of output rows at a time, each chunk tied to the previous chunk's result, and the tied head
loops (lax.map) over vocabulary chunks; on SmolLM2 the head alone went from ~42 ms a decode
step (a 113 MB float32 copy of the embedding) to a few. Layout and formats: model/quant.py.
This module holds no host quantizers and knows nothing of files or shardings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.model.quant import QuantizedTensor


@dataclass(frozen=True)
class QArray:
    q: jax.Array                # int8 [..., out, in] | uint8 [..., out, in // 2]
    scale: jax.Array            # [..., out, in // group]
    zero: jax.Array | None      # like scale, or None
    bits: int
    group: int


jax.tree_util.register_dataclass(QArray, data_fields=["q", "scale", "zero"],
                                 meta_fields=["bits", "group"])


class QuantizedWeight(nnx.Module):
    """One quantized matrix (or a layer stack of them) as model state."""

    def __init__(self, t: QuantizedTensor):
        self.q = nnx.Param(jnp.asarray(np.asarray(t.q)))
        self.scale = nnx.Param(jnp.asarray(np.asarray(t.scale)))
        if t.zero is not None:
            self.zero = nnx.Param(jnp.asarray(np.asarray(t.zero)))
        self.bits, self.group, self.transposed = t.bits, t.group, t.transposed

    def value(self) -> QArray:
        zero = self.zero[...] if hasattr(self, "zero") else None
        return QArray(self.q[...], self.scale[...], zero, self.bits, self.group)


def _after(x) -> jax.Array:
    """0.0 (float32) that depends on x: popcount of a 32-bit word is at most 32, >> 6 is 0."""
    bits = jax.lax.bitcast_convert_type(x.reshape(-1)[0].astype(jnp.float32), jnp.int32)
    return (jax.lax.population_count(bits) >> 6).astype(jnp.float32)


def _values(w: QArray) -> jax.Array:
    """The stored integers as float32 [..., out, in] (int4 nibbles unpacked, interleaved)."""
    if w.bits == 8:
        return w.q.astype(jnp.float32)
    lo, hi = (w.q & 15).astype(jnp.float32), (w.q >> 4).astype(jnp.float32)
    return jnp.stack([lo, hi], axis=-1).reshape(*w.q.shape[:-1], w.q.shape[-1] * 2)


def dequantize(w: QArray, dtype=jnp.float32, after=None) -> jax.Array:
    """[..., out, in] in dtype; `after`: an activation this dequantization must follow."""
    q = _values(w)
    *lead, out, inp = q.shape
    scale = w.scale.astype(jnp.float32)
    if after is not None:
        scale = scale + _after(after)
    groups = q.reshape(*lead, out, inp // w.group, w.group) * scale[..., None]
    if w.zero is not None:
        groups = groups + w.zero.astype(jnp.float32)[..., None]
    return groups.reshape(*lead, out, inp).astype(dtype)


# Output rows dequantized at a time: a chunk's float32 weights stay in the CPU's L2 (1 MiB a
# core here) instead of streaming a whole matrix through L3 (see the module docstring).
CHUNK_BYTES = int(os.environ.get("JAXSERVE_DEQUANT_CHUNK_BYTES", 1 << 18))


def _rows(w: QArray, lo: int, hi: int) -> QArray:
    return QArray(w.q[lo:hi], w.scale[lo:hi], None if w.zero is None else w.zero[lo:hi],
                  w.bits, w.group)


def _num_chunks(out: int, inp: int) -> int:
    """Row chunks for an [out, in] matrix: the fewest that keep each within CHUNK_BYTES and
    divide out evenly (1 when none does)."""
    want = -(-out * inp * 4 // CHUNK_BYTES)
    return next((n for n in range(want, min(out, 4 * want) + 1) if out % n == 0), 1)


def linear(x, w):
    """x [T, in] @ w: a float [in, out] array, or a QArray [out, in] dequantized here, a chunk
    of output rows at a time, each chunk after the previous one's result."""
    if not isinstance(w, QArray):
        return x @ w
    out, inp = w.q.shape[-2], w.q.shape[-1] * (8 // w.bits)
    n = _num_chunks(out, inp) if CHUNK_BYTES > 0 else 1
    rows, parts, after = out // n, [], x
    for i in range(n):
        part = jnp.einsum("ti,oi->to", x, dequantize(_rows(w, i * rows, (i + 1) * rows),
                                                     x.dtype, after=after))
        parts.append(part)
        after = part
    return parts[0] if n == 1 else jnp.concatenate(parts, axis=-1)


def lookup(w, ids, dtype):
    """Rows `ids` of the embedding [V, D] (float or QArray), in dtype: only those rows are
    dequantized."""
    if not isinstance(w, QArray):
        return w[ids]
    rows = QArray(w.q[ids], w.scale[ids], None if w.zero is None else w.zero[ids], w.bits,
                  w.group)
    return dequantize(rows, dtype)


def head(h, w, transposed: bool):
    """h [R, D] -> logits [R, V] float32; w: the tied embedding [V, D] (transposed False) or
    lm_head [D, V], float or quantized ([V, D] either way)."""
    if isinstance(w, QArray):
        vocab, dim = w.q.shape[0], w.q.shape[1] * (8 // w.bits)
        n = _num_chunks(vocab, dim) if CHUNK_BYTES > 0 else 1
        if n == 1:
            return jnp.einsum("td,vd->tv", h, dequantize(w, h.dtype, after=h),
                              preferred_element_type=jnp.float32)
        # a loop over vocabulary chunks: one chunk's float weights live at a time
        chunks = jax.tree.map(lambda a: a.reshape(n, vocab // n, *a.shape[1:]), w)
        logits = jax.lax.map(lambda c: jnp.einsum("td,vd->tv", h, dequantize(c, h.dtype),
                                                  preferred_element_type=jnp.float32), chunks)
        return jnp.moveaxis(logits, 0, 1).reshape(h.shape[0], vocab)  # [n, R, V/n] -> [R, V]
    head_ = w.T if not transposed else w
    return jnp.dot(h, head_, preferred_element_type=jnp.float32)
