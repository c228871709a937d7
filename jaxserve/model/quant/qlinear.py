"""Quantized weights on device: the NNX holder of a QuantizedTensor's arrays, and the matmul,
token lookup and head that dequantize them inside the compiled step, next to their use.

`QuantizedWeight` keeps q / scale / zero as separate nnx.Params in their stored dtypes (int8,
uint8 nibbles, float16 / float32) and the MatmulForm the backend multiplies them in
(model/quant/select.py: chosen per backend by the runner, as the layer loop is); `value()` gives
a `QArray` pytree, which lax.scan slices by layer like any array. `linear(x, w)` is `x @ w` for
a float [in, out] array, and for a QArray it dequantizes [out, in] to x's dtype and contracts on
`in` -- except per-channel int8 with int8 activations.

Per-channel int8 with int8 activations (`int8_dot`; the CPU and TPUs with an int8 MXU): XLA's
CPU dots take one dtype, so an int8 weight is widened before any float dot, and its own loops
do not vectorize a multiply-and-reduce that would read int8 (measured:
scripts/qmatmul_options.py). But an int8 x int8 -> int32 dot can read them as stored: on the
CPU jaxserve's own kernel (model/cpu/int8.py), else XLA's (YNNPACK, which repacks the weights
every call: 2x the kernel's time at batch 1); on a TPU, lax.dot_general on the MXU. So the
activations are quantized too, per row, in two int8 levels (the value, then its rounding
error), stacked as 2T rows of one integer dot: about 15 bits of the activation, the same
accuracy as weight-only int8 on the default model, and exact int32 sums, so a row's result does
not depend on the batch and is the same on every backend. Grouped forms (GGUF's blocks, int4)
need a scale per group of 32 inside the sum, which one dot cannot apply: they are dequantized.

Dequantized matrices, "fused" form (GPUs, TPUs): one dequantize-then-dot, which XLA fuses into
the matmul. "chunked" form (the CPU): the weights do not depend on the step's inputs, so XLA's
scheduler is free to run every layer's dequantization at the start of the step; on the CPU it
did, and the step then held all layers' float32 weights at once (56 MB for 16 matrices of
SmolLM2's MLP: 47 ms instead of 0.8 ms, past the 32 MB L3). `_after(x)` is a zero XLA cannot
prove zero (a bit count shifted out), computed from x, which pins each dequantization after
the activation it multiplies. XLA on the CPU does not fuse a convert into its dot: the float32
weights are written and read back, so a matrix over CHUNK_BYTES is dequantized that many bytes
of output rows at a time, each chunk tied to the previous chunk's result, and the tied head
loops (lax.map) over vocabulary chunks; on SmolLM2 the head alone went from ~42 ms a decode
step (a 113 MB float32 copy of the embedding) to a few. Layout and formats: model/quant/formats.py.
This module holds no host quantizers and knows nothing of files or shardings.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.model.cpu import int8 as cpu_int8
from jaxserve.model.quant import select as quant_select
from jaxserve.model.device.select import DeviceDescription
from jaxserve.model.quant.formats import QuantizedTensor
from jaxserve.model.quant.select import MatmulForm


@dataclass(frozen=True)
class QArray:
    q: jax.Array                # int8 [..., out, in] | uint8 [..., out, in // 2]
    scale: jax.Array            # [..., out, in // group]
    zero: jax.Array | None      # like scale, or None
    bits: int
    group: int
    form: MatmulForm | None = None  # None: the current backend's "auto" (quant_select)


jax.tree_util.register_dataclass(QArray, data_fields=["q", "scale", "zero"],
                                 meta_fields=["bits", "group", "form"])


def _device(a) -> jax.Array:
    """A host array on the device; a jax array (traced ones too, under nnx.eval_shape) as is."""
    return a if isinstance(a, jax.Array) else jnp.asarray(np.asarray(a))


class QuantizedWeight(nnx.Module):
    """One quantized matrix (or a layer stack of them) as model state."""

    def __init__(self, t: QuantizedTensor, form: MatmulForm | None = None):
        self.q = nnx.Param(_device(t.q))
        self.scale = nnx.Param(_device(t.scale))
        if t.zero is not None:
            self.zero = nnx.Param(_device(t.zero))
        self.bits, self.group, self.transposed = t.bits, t.group, t.transposed
        self.form = form

    def value(self) -> QArray:
        zero = self.zero[...] if hasattr(self, "zero") else None
        return QArray(self.q[...], self.scale[...], zero, self.bits, self.group, self.form)


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
    # A per-channel scale is not split over the devices (model/decoder/sharding.py), so inside a
    # shard_map a device's slice of the inputs is narrower than the stored group: one group.
    group = min(w.group, inp)
    groups = q.reshape(*lead, out, inp // group, group) * scale[..., None]
    if w.zero is not None:
        groups = groups + w.zero.astype(jnp.float32)[..., None]
    return groups.reshape(*lead, out, inp).astype(dtype)


# Output rows dequantized at a time, as float32 bytes: a layer's matrix (3.4 MiB at most in
# SmolLM2) whole, the head's 108 MiB in pieces that stay in the CPU's 32 MiB L3. Measured on
# SmolLM2's 30 layers (scripts/qmatmul_options.py, int8 g32): 256 KiB pieces, 14 per MLP
# matrix, cost more in per-piece dispatch than they saved (0.7-0.85x float32 against 1.2-1.35x
# whole).
CHUNK_BYTES = int(os.environ.get("JAXSERVE_DEQUANT_CHUNK_BYTES", 1 << 22))


def _rows(w: QArray, lo: int, hi: int) -> QArray:
    return dataclasses.replace(w, q=w.q[lo:hi], scale=w.scale[lo:hi],
                               zero=None if w.zero is None else w.zero[lo:hi])


# Set while a step is traced for one token bucket whose form was measured on this machine
# (runner: model/quant/measure.py); it outranks every QArray's own form.
_bucket_form: contextvars.ContextVar[MatmulForm | None] = contextvars.ContextVar(
    "jaxserve_bucket_matmul_form", default=None)


@contextlib.contextmanager
def matmul_form(form: MatmulForm | None):
    """Quantized matmuls traced inside (in this thread) take `form` (None: their own)."""
    token = _bucket_form.set(form)
    try:
        yield form
    finally:
        _bucket_form.reset(token)


def form_of(w: QArray) -> MatmulForm:
    """The form set by matmul_form(), else w's MatmulForm; a QArray built without one takes
    the current backend's "auto"."""
    override = _bucket_form.get()
    if override is not None:
        return override
    if w.form is not None:
        return w.form
    return quant_select.select(device=DeviceDescription.current()).form


def _num_chunks(out: int, inp: int) -> int:
    """Row chunks for an [out, in] matrix: the fewest that keep each within CHUNK_BYTES and
    divide out evenly (1 when none does)."""
    want = -(-out * inp * 4 // CHUNK_BYTES)
    return next((n for n in range(want, min(out, 4 * want) + 1) if out % n == 0), 1)


def per_channel_int8(w: QArray) -> bool:
    """One scale per output row, no zero: the form an integer dot can take whole."""
    return w.bits == 8 and w.zero is None and w.scale.shape[-1] == 1


def _quantize_rows(x) -> tuple[jax.Array, jax.Array]:
    """x [T, in] -> (int8 [T, in], float32 [T, 1]): symmetric, one scale a row (a row alone
    decides its scale, so a row's result does not depend on the batch around it)."""
    x = x.astype(jnp.float32)
    sx = jnp.maximum(jnp.max(jnp.abs(x), axis=-1, keepdims=True), 1e-30) / 127.0
    return jnp.clip(jnp.round(x / sx), -127, 127).astype(jnp.int8), sx


def int8_dot(x, w: QArray, out_dtype, kernel: bool = True) -> jax.Array:
    """x [T, in] times per-channel int8 w [out, in] -> [T, out] in one int8 x int8 -> int32 dot
    of 2T rows: each row of x quantized to int8, and the rounding error it leaves quantized
    again (x ~ qx * sx + qr * sr: about 15 bits, where one int8 alone lost too much: mean KL
    0.05 to float32 on the default model); int32 sums are exact, so a row's result does not
    depend on T. The dot is cpu_int8.matmul: on the CPU jaxserve's kernel (unless `kernel` is
    False), which reads the int8 weights once as stored, or XLA's dot (YNNPACK, which repacks
    them every call), equal bit for bit; on other backends XLA's dot_general (a TPU's MXU)."""
    rows = x.shape[0]
    x = x.astype(jnp.float32)
    qx, sx = _quantize_rows(x)
    qr, sr = _quantize_rows(x - qx.astype(jnp.float32) * sx)
    acc = cpu_int8.matmul(jnp.concatenate([qx, qr]), w.q, kernel)  # [2T, out] int32
    acc = acc.astype(jnp.float32)
    y = (acc[:rows] * sx + acc[rows:] * sr) * w.scale[:, 0].astype(jnp.float32)
    return y.astype(out_dtype)


def _int4_halves(w: QArray, dtype, after=None) -> tuple[jax.Array, jax.Array]:
    """int4 w as (even inputs, odd inputs): the low and high nibbles dequantized apart,
    [..., out, in // 2] each in dtype, with no interleaving shuffle (which XLA's CPU loops ran
    at a third of float32's speed on SmolLM2's layers)."""
    scale = w.scale.astype(jnp.float32)
    if after is not None:
        scale = scale + _after(after)
    *lead, out, half = w.q.shape
    groups = scale.shape[-1]

    def dequantized(nibbles):
        g = nibbles.astype(jnp.float32).reshape(*lead, out, groups, half // groups)
        g = g * scale[..., None]
        if w.zero is not None:
            g = g + w.zero.astype(jnp.float32)[..., None]
        return g.reshape(*lead, out, half).astype(dtype)

    return dequantized(w.q & 15), dequantized(w.q >> 4)


def _dot(x, w: QArray, after=None, preferred=None) -> jax.Array:
    """x [T, in] times w [out, in] dequantized (after `after`) -> [T, out]; int4 as two dots,
    x's even inputs with the low nibbles and its odd inputs with the high ones."""
    if w.bits == 8:
        return jnp.einsum("ti,oi->to", x, dequantize(w, x.dtype, after=after),
                          preferred_element_type=preferred)
    even, odd = _int4_halves(w, x.dtype, after)
    pairs = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)  # [T, in // 2, 2]
    return (jnp.einsum("ti,oi->to", pairs[..., 0], even, preferred_element_type=preferred)
            + jnp.einsum("ti,oi->to", pairs[..., 1], odd, preferred_element_type=preferred))


def linear(x, w):
    """x [T, in] @ w: a float [in, out] array, or a QArray [out, in]: per-channel int8 times
    int8 activations where its form says so, else dequantized here: whole, or in the chunked
    form a chunk of output rows at a time, each chunk after the previous one's result."""
    if not isinstance(w, QArray):
        return x @ w
    form = form_of(w)
    if per_channel_int8(w) and form.int8_activations:
        return int8_dot(x, w, x.dtype, form.int8_kernel)
    if not form.chunked:
        return _dot(x, w)
    out, inp = w.q.shape[-2], w.q.shape[-1] * (8 // w.bits)
    n = _num_chunks(out, inp) if CHUNK_BYTES > 0 else 1
    rows, parts, after = out // n, [], x
    for i in range(n):
        part = _dot(x, _rows(w, i * rows, (i + 1) * rows), after=after)
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
    if not isinstance(w, QArray):
        head_ = w.T if not transposed else w
        return jnp.dot(h, head_, preferred_element_type=jnp.float32)
    form = form_of(w)
    if per_channel_int8(w) and form.int8_activations:
        return int8_dot(h, w, jnp.float32, form.int8_kernel)
    if not form.chunked:
        return _dot(h, w, preferred=jnp.float32)
    vocab, dim = w.q.shape[0], w.q.shape[1] * (8 // w.bits)
    n = _num_chunks(vocab, dim) if CHUNK_BYTES > 0 else 1
    if n == 1:
        return _dot(h, w, after=h, preferred=jnp.float32)
    # a loop over vocabulary chunks: one chunk's float weights live at a time
    chunks = jax.tree.map(lambda a: a.reshape(n, vocab // n, *a.shape[1:]), w)
    logits = jax.lax.map(lambda c: _dot(h, c, preferred=jnp.float32), chunks)
    return jnp.moveaxis(logits, 0, 1).reshape(h.shape[0], vocab)  # [n, R, V/n] -> [R, V]
