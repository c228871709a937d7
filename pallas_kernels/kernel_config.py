"""The static configuration and the masking/score math shared by both paged-attention lowerings.

ragged_tpu.py (Mosaic TPU) and ragged_gpu.py (Mosaic GPU) run the same algorithm over the same
blocks; what a block is, which (query row, KV position) pairs may attend and how a raw score
becomes a logit live here once. Pure functions of static configuration and traced arrays: this
module must not launch kernels, touch pages or import either lowering.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

NEG_INF = -1e30
META_FIELDS = 5  # request, first position, tokens, first tile, end tile


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static description of one kernel instance (anything here recompiles)."""

    group: int           # query heads per KV head
    tokens: int          # query tokens per block (power of two)
    rows: int            # rows per block ≥ group * tokens
    page_size: int
    tile_pages: int      # pages per KV tile
    pages_per_seq: int   # page-table width P
    sm_scale: float
    soft_cap: float | None
    sliding_window: int | None
    with_stats: bool     # also return log-sum-exp per row (for split-KV decode)

    @property
    def tile(self) -> int:
        return self.tile_pages * self.page_size


def visible(c: KernelConfig, row, kv_pos, first, n):
    """Mask of (query row, KV position) pairs that attend; rows are head-major in the block."""
    tok = row & (c.tokens - 1)
    pos = first + tok
    mask = (row < c.group * c.tokens) & (tok < n) & (kv_pos <= pos)
    if c.sliding_window is not None:
        mask &= kv_pos > pos - c.sliding_window
    return mask


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def widen(x, dtype):  # through float32: Hopper converts fp8 straight to f16 only
    return x.astype(jnp.float32).astype(dtype)


def scores(c: KernelConfig, s):
    s = s * c.sm_scale
    return s if c.soft_cap is None else c.soft_cap * jnp.tanh(s / c.soft_cap)
