"""MXFP4 (the OCP microscaling 4-bit float format) to float32, for gpt-oss's expert weights.

A checkpoint stores each [.., out, in] matrix as `*_blocks` (uint8 [..., out, in / 32, 16]: 32
e2m1 values per block, two per byte, the low nibble first) and `*_scales` (uint8 [..., out,
in / 32]: one power-of-two exponent per block, biased by 127). Dequantized on load, the result
is what transformers' gpt-oss module multiplies by: [..., in, out]. Numpy only; it must not
import jax or read files.
"""

from __future__ import annotations

import numpy as np

# The 16 values of an e2m1 nibble (sign bit 3, exponent bits 2-1, mantissa bit 0).
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8 [..., out, G, 16], scales uint8 [..., out, G] -> float32 [..., G * 32, out]
    (the matrix transposed to [in, out])."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.dtype}{list(blocks.shape)} and scales "
                         f"{scales.dtype}{list(scales.shape)} do not pair (uint8 [..., G, 16] "
                         f"and uint8 [..., G])")
    values = np.empty((*blocks.shape[:-1], 32), np.float32)
    values[..., 0::2] = E2M1[blocks & 0x0F]
    values[..., 1::2] = E2M1[blocks >> 4]
    values = np.ldexp(values, (scales.astype(np.int32) - 127)[..., None])
    matrix = values.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)  # [..., out, in]
    return np.ascontiguousarray(np.swapaxes(matrix, -1, -2))
