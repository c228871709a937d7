"""Weight-only quantized formats on the host: QuantizedTensor, the int8 / int4 quantizers, and
what a params dict's weights cost on device.

A QuantizedTensor holds one matrix (or a stack of them: layers first, then experts) in the
layout its matmul reads on device: [..., out, in], groups of `group` inputs sharing a scale
(and a zero):
    w[..., o, i] = q[..., o, i] * scale[..., o, i // group] + zero[..., o, i // group]
* int8: q int8 [..., out, in]; symmetric per output channel (group = in, float32 scales, no
  zero) when quantized here; GGUF blocks map to groups of 32 (Q8_0, Q5_x, Q4_x) or 16 (Q6_K),
  with a zero where the block format has a min.
* int4: q uint8 [..., out, in // 2], two values per byte (low nibble = even input); asymmetric
  (q in [0, 15], float16 scale and zero) in groups of `group` inputs.
`shape` is the parameter's shape in ModelConfig.param_shapes() layout ([..., in, out] for
matrices), so shape checks treat quantized and float params alike. The embedding [V, D] is
already [out, in] for the tied head (and rows of it are what a token lookup reads).
Numpy only: this module must not import jax (model/quant/qlinear.py does the device side).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MODES = ("none", "int8", "int4")
INT4_GROUP = 32        # measured: see docs/quantization.md
# The int4 embedding (also the tied head) in groups of 16: on the default model mean KL to float32
# 0.039 (0.063 with groups of 32) at 16.3% of float32's bytes (an int8 one: 0.000, but 17.9%).
INT4_EMBED_GROUP = 16
# The matrices weight-only quantization applies to (norms and biases stay float, and so does a
# mixture-of-experts router: a few bytes, and a rounding there flips near-tied experts). The
# expert stacks [L, E, in, out] quantize like any matrix, per expert ([L, E, out, in] stored).
EXPERT_NAMES = ("layers.e_gate", "layers.e_up", "layers.e_down")
MATRIX_NAMES = ("embed", "lm_head", "layers.wq", "layers.wk", "layers.wv", "layers.wo",
                "layers.w_gate", "layers.w_up", "layers.w_down", *EXPERT_NAMES)
# Tensor groups reported at start-up and in ModelInfo (the router falls in 'other').
GROUPS = {"embed": ("embed",), "lm_head": ("lm_head",),
          "attention": ("layers.wq", "layers.wk", "layers.wv", "layers.wo"),
          "mlp": ("layers.w_gate", "layers.w_up", "layers.w_down"),
          "experts": EXPERT_NAMES}


@dataclass
class QuantizedTensor:
    q: np.ndarray              # int8 [..., out, in] | uint8 [..., out, in // 2] (int4)
    scale: np.ndarray          # [..., out, in // group]
    zero: np.ndarray | None    # like scale, or None (symmetric)
    bits: int                  # 8 or 4
    group: int                 # inputs per scale
    transposed: bool = True    # param layout is [..., in, out] (every matrix but the embedding)

    @property
    def matrix_shape(self) -> tuple[int, ...]:
        """[..., out, in]: the quantized layout."""
        *lead, out, cols = self.q.shape
        return (*lead, out, cols * (8 // self.bits))

    @property
    def shape(self) -> tuple[int, ...]:
        """The parameter's shape in ModelConfig.param_shapes() layout."""
        *lead, out, inp = self.matrix_shape
        return (*lead, inp, out) if self.transposed else (*lead, out, inp)

    @property
    def nbytes(self) -> int:
        return int(self.q.nbytes + self.scale.nbytes + (0 if self.zero is None
                                                        else self.zero.nbytes))

    @property
    def format(self) -> str:
        """e.g. 'int8 per-channel (float32 scales)', 'int4 g32 (float16 scale+zero)'."""
        inp = self.matrix_shape[-1]
        kind = "per-channel" if self.group == inp else f"g{self.group}"
        parts = "scale+zero" if self.zero is not None else "scales"
        return f"int{self.bits} {kind} ({np.dtype(self.scale.dtype).name} {parts})"

    def layer(self, index: int) -> "QuantizedTensor":
        """One layer's slice of a stacked tensor."""
        return self[index]

    def __getitem__(self, index) -> "QuantizedTensor":
        """Layers of a stacked tensor (an int or a slice of the leading axis: `layers:N`
        drafts take params[name][:N])."""
        return QuantizedTensor(self.q[index], self.scale[index],
                               None if self.zero is None else self.zero[index], self.bits,
                               self.group, self.transposed)

    def dequantize(self) -> np.ndarray:
        """float32 in the param layout (the numpy oracle of qlinear.dequantize)."""
        q = unpack_int4(self.q) if self.bits == 4 else self.q
        *lead, out, inp = self.matrix_shape
        groups = q.reshape(*lead, out, inp // self.group, self.group).astype(np.float32)
        w = groups * self.scale.astype(np.float32)[..., None]
        if self.zero is not None:
            w = w + self.zero.astype(np.float32)[..., None]
        w = w.reshape(*lead, out, inp)
        return np.swapaxes(w, -1, -2) if self.transposed else w


def pack_int4(values: np.ndarray) -> np.ndarray:
    """[..., n] of 0..15 -> uint8 [..., n // 2]; element 2j in the low nibble of byte j."""
    v = values.astype(np.uint8)
    return (v[..., 0::2] | (v[..., 1::2] << 4)).astype(np.uint8)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., n // 2] -> uint8 [..., n] of 0..15."""
    out = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), np.uint8)
    out[..., 0::2], out[..., 1::2] = packed & 15, packed >> 4
    return out


def quantize_int8(w_oi: np.ndarray, transposed: bool = True) -> QuantizedTensor:
    """Symmetric int8, one float32 scale per output channel. w_oi: [..., out, in]."""
    w = np.asarray(w_oi, np.float32)
    scale = np.abs(w).max(axis=-1, keepdims=True) / 127.0  # [..., out, 1]
    safe = np.where(scale == 0, 1.0, scale)
    q = np.clip(np.rint(w / safe), -127, 127).astype(np.int8)
    return QuantizedTensor(q, scale.astype(np.float32), None, 8, w.shape[-1], transposed)


def quantize_int4(w_oi: np.ndarray, group: int = INT4_GROUP,
                  transposed: bool = True) -> QuantizedTensor:
    """Asymmetric int4 in groups of `group` inputs: float16 scale = (max - min) / 15 and zero =
    min, q = round((w - zero) / scale) in [0, 15]. w_oi: [..., out, in]."""
    w = np.asarray(w_oi, np.float32)
    *lead, out, inp = w.shape
    if inp % group:
        raise ValueError(f"int4 group {group} does not divide the input size {inp}")
    g = w.reshape(*lead, out, inp // group, group)
    lo, hi = g.min(axis=-1), g.max(axis=-1)
    zero = lo.astype(np.float16)
    scale = ((hi - zero.astype(np.float32)) / 15.0).astype(np.float16)
    s = scale.astype(np.float32)[..., None]
    q = np.rint((g - zero.astype(np.float32)[..., None]) / np.where(s == 0, 1.0, s))
    q = np.clip(q, 0, 15).reshape(*lead, out, inp)
    return QuantizedTensor(pack_int4(q), scale, zero, 4, group, transposed)


def quantize(w: np.ndarray, mode: str, name: str) -> QuantizedTensor:
    """The param `name` (param layout) quantized to `mode` ('int8' | 'int4')."""
    transposed = name != "embed"  # every other matrix is stored [in, out]
    w_oi = np.swapaxes(np.asarray(w, np.float32), -1, -2) if transposed else w
    if mode == "int8":
        return quantize_int8(w_oi, transposed)
    if mode == "int4":
        return quantize_int4(w_oi, INT4_EMBED_GROUP if name == "embed" else INT4_GROUP,
                             transposed)
    raise ValueError(f"quantization={mode!r} is not one of {MODES}")


def formats(params: dict) -> dict[str, str]:
    """{param name: its format on device} ('float' for float arrays: the model casts them)."""
    return {name: v.format if isinstance(v, QuantizedTensor) else "float"
            for name, v in params.items()}


def stored_mode(params: dict) -> str:
    """'none', 'int8' or 'int4': how the matrices of `params` are already stored (a quantized
    checkpoint or GGUF mapping); 'mixed' when they differ."""
    bits = {v.bits for v in params.values() if isinstance(v, QuantizedTensor)}
    matrices = [n for n in MATRIX_NAMES if n in params]
    if not bits:
        return "none"
    if len(bits) == 1 and all(isinstance(params[n], QuantizedTensor) for n in matrices
                              if n != "embed"):
        return f"int{bits.pop()}"
    return "mixed"


def quantize_params(params: dict, mode: str) -> dict:
    """params with every matrix quantized to `mode` ('none': unchanged). Matrices already
    quantized (a GGUF mapping, a quantized checkpoint) are kept as they are."""
    if mode not in MODES:
        raise ValueError(f"quantization={mode!r} is not one of {MODES}")
    if mode == "none":
        return params
    return {name: quantize(v, mode, name)
            if name in MATRIX_NAMES and not isinstance(v, QuantizedTensor) else v
            for name, v in params.items()}


def int8_per_channel(params: dict) -> dict:
    """params with every int8 matrix stored in groups (a GGUF's blocks, a checkpoint of them)
    dequantized and requantized per output channel, the form int8 activations multiply; other
    params unchanged (the same dict when nothing is grouped). Host (numpy) arrays only: a
    matrix restored straight into device shardings stays as stored."""
    def grouped(v) -> bool:
        return (isinstance(v, QuantizedTensor) and v.bits == 8
                and (v.zero is not None or v.group != v.matrix_shape[-1])
                and isinstance(v.q, np.ndarray))

    def requantized(v: QuantizedTensor) -> QuantizedTensor:
        w = v.dequantize()  # param layout
        return quantize_int8(np.swapaxes(w, -1, -2) if v.transposed else w, v.transposed)

    if not any(grouped(v) for v in params.values()):
        return params
    return {name: requantized(v) if grouped(v) else v for name, v in params.items()}


def device_bytes(params: dict, float_itemsize: int) -> int:
    """Bytes the weights take on device: quantized parts as stored, floats in the model dtype."""
    return sum(v.nbytes if isinstance(v, QuantizedTensor)
               else int(np.prod(v.shape)) * float_itemsize for v in params.values())


def report(params: dict, float_dtype) -> tuple[int, tuple[tuple[str, str, int], ...]]:
    """(weight bytes on device, group_formats) with floats in `float_dtype` (a numpy-compatible
    dtype: the model's)."""
    dtype = np.dtype(float_dtype)
    return device_bytes(params, dtype.itemsize), group_formats(params, dtype.name,
                                                               dtype.itemsize)


def group_formats(params: dict, float_dtype: str, float_itemsize: int
                  ) -> tuple[tuple[str, str, int], ...]:
    """((tensor group, format, device bytes), ...) for start-up logs and ModelInfo; the norms,
    biases and a MoE router are one group, 'other'."""
    named = {n for names in GROUPS.values() for n in names}
    rows = []
    for group, names in (*GROUPS.items(), ("other", tuple(n for n in params if n not in named))):
        present = [n for n in names if n in params]
        if not present:
            continue
        fmts = dict.fromkeys(params[n].format if isinstance(params[n], QuantizedTensor)
                             else float_dtype for n in present)
        rows.append((group, " | ".join(fmts), device_bytes({n: params[n] for n in present},
                                                           float_itemsize)))
    return tuple(rows)
