"""How a TPU lays an array out in HBM and VMEM: the tiling of its last two dimensions.

A TPU stores an array of rank >= 2 in tiles over its last two dimensions: 128 lanes by
8 sublanes of 32 bits. A narrower dtype packs `32 // bits` values into one 32-bit sublane
word, so its tile is (8 * packing, 128): (8, 128) for float32, (16, 128) for bfloat16,
(32, 128) for 8-bit types. A dimension that is not a multiple of its tile is padded up to
one, in HBM as in VMEM (XLA's default TPU layout, and what Mosaic expects of a kernel's
refs). Both the kernels (which slices of a ref are legal copies) and the KV pool plan (how
many bytes a page really takes) read these rules from here.

Plain arithmetic on shapes and dtypes: this module must not import jax's TPU backend,
touch device arrays or decide anything about the engine.
"""

from __future__ import annotations

import math

import numpy as np

LANES = 128          # minor dimension of a tile
SUBLANES = 8         # 32-bit rows of a tile


def sublane_packing(dtype) -> int:
    """Values of `dtype` in one 32-bit sublane word: 1 (32-bit), 2 (16-bit), 4 (8-bit)."""
    bits = np.dtype(dtype).itemsize * 8
    if bits > 32:
        raise ValueError(f"TPU tiles hold 32-bit words; {np.dtype(dtype)} is {bits}-bit")
    return 32 // bits


def tile_shape(dtype) -> tuple[int, int]:
    """(second-minor, minor) tile of `dtype`: (8 * packing, 128)."""
    return SUBLANES * sublane_packing(dtype), LANES


def padded_shape(shape: tuple[int, ...], dtype) -> tuple[int, ...]:
    """`shape` with its last two dimensions rounded up to whole tiles (rank 1: lanes only)."""
    shape = tuple(int(d) for d in shape)
    if not shape:
        return shape
    rows, lanes = tile_shape(dtype)
    last = -(-shape[-1] // lanes) * lanes
    if len(shape) == 1:
        return (last,)
    return shape[:-2] + (-(-shape[-2] // rows) * rows, last)


def padded_bytes(shape: tuple[int, ...], dtype) -> int:
    """Bytes an array of `shape` and `dtype` occupies on a TPU, tile padding included."""
    return math.prod(padded_shape(shape, dtype)) * np.dtype(dtype).itemsize


def padding_factor(shape: tuple[int, ...], dtype) -> float:
    """Padded over unpadded bytes (1.0: no padding)."""
    return math.prod(padded_shape(shape, dtype)) / max(1, math.prod(shape))
