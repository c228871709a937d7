"""GGUF quantized blocks -> model/quant/formats.py's on-device forms, tensor by tensor, without
float32
for the formats that map exactly.

Which form each GGML type gets (all groups run along a row's inputs, as GGUF's blocks do):

| GGML type | --quantization int8                 | --quantization int4               |
|-----------|-------------------------------------|-----------------------------------|
| Q8_0      | int8 g32, exact                     | int4 g32 requantized (lossy)      |
| Q4_0      | int8 g32 (codes - 8), exact         | int4 g32, zero = -8 d, exact      |
| Q4_1      | int8 g32 + zero, exact              | int4 g32, exact                   |
| Q4_K      | int8 g32 + zero, scales in float16  | int4 g32, scales in float16       |
| Q5_0      | int8 g32 (codes - 16), exact        | int4 g32 requantized (lossy)      |
| Q5_1      | int8 g32 + zero, exact              | int4 g32 requantized (lossy)      |
| Q6_K, Q5_K, Q2_K, Q3_K, F16, F32 | int8 per-channel requantized | int4 g32 requantized   |

Q4_K's effective group scale d * sc and min dmin * m are rounded to float16 (relative error
2^-11, far below one int4 step). "Requantized" tensors are dequantized one at a time (never the
whole model) and quantized as model/quant/formats.py does for float weights. A parameter whose
layers
come in different GGML types (llama.cpp's Q4_K_M mixes in Q6_K) is requantized in every layer,
so its layer stack has one form. Numpy only; it reads blocks it is handed, never a file.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import quants as gq

from jaxserve.model.quant.formats import QuantizedTensor, pack_int4

# (type, target mode) that map without float: the table above.
EXACT = {(Q.Q8_0, "int8"), (Q.Q4_0, "int8"), (Q.Q4_1, "int8"), (Q.Q4_K, "int8"),
         (Q.Q5_0, "int8"), (Q.Q5_1, "int8"), (Q.Q4_0, "int4"), (Q.Q4_1, "int4"),
         (Q.Q4_K, "int4")}


def maps_exactly(tensor_type, mode: str) -> bool:
    return (tensor_type, mode) in EXACT


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[:, start:start + 2].copy().view(np.float16)[:, 0]


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32] codes: ggml puts element j in the low nibble of byte j and
    element j + 16 in its high nibble."""
    return np.concatenate([qs & 15, qs >> 4], axis=1)


def _codes(tensor_type, blocks: np.ndarray):
    """blocks [n, block bytes] -> (codes uint8 [n_groups, 32], scale f16 [n_groups], zero f16
    [n_groups] or None, offset): w = (codes - offset) * scale + zero."""
    if tensor_type == Q.Q8_0:
        return blocks[:, 2:].view(np.int8), _f16(blocks, 0), None, 0
    if tensor_type in (Q.Q4_0, Q.Q4_1):
        has_min = tensor_type == Q.Q4_1
        codes = _nibbles32(blocks[:, 4 if has_min else 2:])
        return codes, _f16(blocks, 0), _f16(blocks, 2) if has_min else None, 0 if has_min else 8
    if tensor_type in (Q.Q5_0, Q.Q5_1):
        has_min = tensor_type == Q.Q5_1
        start = 4 if has_min else 2
        high = blocks[:, start:start + 4].copy().view(np.uint32)[:, 0]
        high_bits = ((high[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        codes = _nibbles32(blocks[:, start + 4:]) | (high_bits << 4)
        return codes, _f16(blocks, 0), _f16(blocks, 2) if has_min else None, 0 if has_min else 16
    if tensor_type == Q.Q4_K:  # 256-element super-blocks of 8 groups of 32
        n = blocks.shape[0]
        d, dmin = _f16(blocks, 0).astype(np.float32), _f16(blocks, 2).astype(np.float32)
        sc, mn = gq.Q4_K.get_scale_min(blocks[:, 4:16])  # [n, 8] each
        qs = blocks[:, 16:].reshape(n, 4, 32)  # chunk j: groups 2j (low) and 2j + 1 (high)
        codes = np.stack([qs & 15, qs >> 4], axis=2).reshape(n * 8, 32)
        scale = (d[:, None] * sc).astype(np.float16).reshape(-1)
        zero = (-dmin[:, None] * mn).astype(np.float16).reshape(-1)
        return codes, scale, zero, 0
    raise ValueError(f"no exact mapping for GGML type {tensor_type.name}")


def map_tensor(tensor_type, data: np.ndarray, rows: int, cols: int, mode: str
               ) -> QuantizedTensor:
    """One GGUF tensor's raw blocks (uint8 [rows, row bytes]) as `mode`'s form, [rows, cols] =
    [out, in], exactly (maps_exactly must hold)."""
    block_elems = gq.GGML_QUANT_SIZES[tensor_type][0]
    blocks = np.ascontiguousarray(data).reshape(rows * cols // block_elems, -1)
    codes, scale, zero, offset = _codes(tensor_type, blocks)
    groups = cols // 32
    scale, zero = scale.reshape(rows, groups), None if zero is None else zero.reshape(rows, groups)
    codes = codes.reshape(rows, cols)
    if mode == "int8":
        q = (codes.astype(np.int16) - offset).astype(np.int8)
        return QuantizedTensor(q, scale, zero, 8, 32)
    if zero is None:  # Q4_0: (c - 8) d = c d + (-8 d); -8 d is exact in float16
        zero = (scale.astype(np.float32) * -offset).astype(np.float16)
    return QuantizedTensor(pack_int4(codes), scale, zero, 4, 32)


def dequantize_tensor(tensor_type, data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """One tensor in float32 (the requantized path)."""
    return np.array(gq.dequantize(data, tensor_type), dtype=np.float32).reshape(shape)
