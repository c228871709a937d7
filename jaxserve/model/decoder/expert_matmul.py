"""The mixture-of-experts layer's expert matmuls: (token, expert) pairs through their experts'
matrices, float or quantized, in the forms model/decoder/moe.py meets them.

A float expert stack is [E, in, out]; a quantized one is a QArray [E, out, in]
(model/quant/formats.py's
layout, groups along `in`). Both forms return float32.
* `gathered` (few pairs): each pair gathers its own expert's rows of q / scale / zero, so a step
  reads, and dequantizes, only the experts it uses. Per-channel int8 multiplies the int8 values
  (converted to the activation dtype) and applies each output channel's scale to the product,
  which is [T, k, out] rather than [T, k, out, in] multiplies.
* `grouped` (pairs sorted by expert, one group per expert) picks its form by the platform the
  step is lowered for (`lax.platform_dependent`, so an ahead-of-time lowering for another
  platform gets that platform's form):
  - TPU: `ragged_dot`, which XLA's TPU backend keeps as a grouped matmul. It takes one dtype,
    so the integer stack is converted next to its use (tied to the activations:
    qlinear._after, so an unrolled step does not convert every layer's stack up front),
    written [E, in, out] as the float stack is. Per-channel int8 converts q alone and scales
    each row's output by its expert's channel scales after the ragged_dot; grouped forms
    (int4, GGUF blocks) are dequantized whole, int4 as its two nibble halves, each against the
    activations' even or odd inputs (no interleaving shuffle). The int8 forms were measured on
    the CPU: scripts/moe_quant_options.py, docs/moe.md.
  - CPU and GPU: `tiled`. XLA computes `ragged_dot` on both as one dot over every expert: the
    CPU as every group over every row (measured 8x a dense model of the same active
    parameters at 16 and 64 requests, docs/moe.md), and the GPU backend's RaggedDotRewriter
    (at XLA's default flags) rewrites it to the rows masked per expert, an [E, M, in]
    temporary contracted over (expert, in): E times the work, 34 GB at 8192 tokens of
    Qwen3-30B-A3B. (Its exceptions: XLA's experimental cuDNN ragged-dot fusion, off by
    default and only for a 16-bit result, and hipBLASLt's grouped GEMM on some ROCm parts.)
* `tiled`: each group padded to whole tiles of `tile` rows, so a tile belongs to one expert,
  and a loop over the tiles multiplies each by its expert's matrix: at most M + (E + 1) * tile
  rows of work, all shapes static. On the CPU one tile a loop step, through qlinear.linear as
  a dense layer (its int8 kernel included). On a GPU `tiles_at_once` tiles a loop step as one
  batched matmul (their experts' matrices gathered, TILE_WEIGHT_BYTES of them at most), with
  a float32 result as ragged_dot's. JAXSERVE_MOE_GROUPED=tiled|ragged_dot|batched_tiles
  overrides the choice on every platform (tests run each).
Pure functions of arrays: no routing, no weights held, no shardings.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp

from jaxserve.model.quant.qlinear import (QArray, _after, _dot, _int4_halves, dequantize, linear,
                                    per_channel_int8)


def _take(w: QArray, experts) -> QArray:
    """The experts' slices of a quantized stack: [E, ...] indexed by experts [T, k]."""
    return dataclasses.replace(w, q=w.q[experts], scale=w.scale[experts],
                               zero=None if w.zero is None else w.zero[experts])


def gathered(h, w, experts) -> jax.Array:
    """h [T, k, in], each pair through its expert experts [T, k] of w (float [E, in, out] or a
    QArray [E, out, in]) -> [T, k, out] float32."""
    f32 = jnp.float32
    if not isinstance(w, QArray):
        return jnp.einsum("tki,tkio->tko", h, w[experts].astype(h.dtype),
                          preferred_element_type=f32)
    pairs = _take(w, experts)                                     # [T, k, out, in*]
    if per_channel_int8(pairs):
        out = jnp.einsum("tki,tkoi->tko", h, pairs.q.astype(h.dtype),
                         preferred_element_type=f32)
        return out * pairs.scale[..., 0].astype(f32)
    if pairs.bits == 8:
        return jnp.einsum("tki,tkoi->tko", h, dequantize(pairs, h.dtype),
                          preferred_element_type=f32)
    even, odd = _int4_halves(pairs, h.dtype)                      # each [T, k, out, in // 2]
    halves = h.reshape(*h.shape[:-1], h.shape[-1] // 2, 2)
    return (jnp.einsum("tki,tkoi->tko", halves[..., 0], even, preferred_element_type=f32)
            + jnp.einsum("tki,tkoi->tko", halves[..., 1], odd, preferred_element_type=f32))


GROUPED = os.environ.get("JAXSERVE_MOE_GROUPED", "auto")

# Expert matrices (dequantized, in the activations' dtype) one GPU loop step gathers for its
# tiles: a bound on that temporary, not a tuned figure (no GPU has timed the choice).
TILE_WEIGHT_BYTES = 1 << 27


def grouped(rows, w, group_sizes, expert_of_row) -> jax.Array:
    """rows [M, in] sorted by expert, group_sizes [E] (rows per expert; rows past their sum
    belong to no group and come back as anything), expert_of_row [M]; w: float [E, in, out] or
    a QArray [E, out, in] -> [M, out] float32."""
    forms = {"tiled": lambda r, w_, s, _: tiled(r, w_, s),
             "ragged_dot": ragged,
             "batched_tiles": lambda r, w_, s, _: tiled(r, w_, s, tiles_at_once=None)}
    if GROUPED != "auto":
        return forms[GROUPED](rows, w, group_sizes, expert_of_row)
    return jax.lax.platform_dependent(rows, w, group_sizes, expert_of_row,
                                      cpu=forms["tiled"], tpu=forms["ragged_dot"],
                                      default=forms["batched_tiles"])


def ragged(rows, w, group_sizes, expert_of_row) -> jax.Array:
    """grouped's result by jax.lax.ragged_dot (see the module docstring)."""
    f32 = jnp.float32
    if not isinstance(w, QArray):
        return jax.lax.ragged_dot(rows, w.astype(rows.dtype), group_sizes,
                                  preferred_element_type=f32)

    def dot(lhs, stack):  # lhs [M, n] x stack [E, out, n], written [E, n, out] -> [M, out]
        return jax.lax.ragged_dot(lhs, jnp.swapaxes(stack, -1, -2), group_sizes,
                                  preferred_element_type=f32)

    if per_channel_int8(w):
        values = (w.q.astype(f32) + _after(rows)).astype(rows.dtype)  # [E, out, in]
        return dot(rows, values) * w.scale[expert_of_row, :, 0].astype(f32)
    if w.bits == 8:
        return dot(rows, dequantize(w, rows.dtype, after=rows))
    even, odd = _int4_halves(w, rows.dtype, after=rows)           # each [E, out, in // 2]
    halves = rows.reshape(rows.shape[0], rows.shape[-1] // 2, 2)
    return dot(halves[..., 0], even) + dot(halves[..., 1], odd)


def _expert(w, e):
    """Expert e's matrix: float [in, out], or a QArray [out, in]."""
    if not isinstance(w, QArray):
        return jnp.asarray(w)[e]
    return dataclasses.replace(w, q=jnp.asarray(w.q)[e], scale=jnp.asarray(w.scale)[e],
                               zero=None if w.zero is None else jnp.asarray(w.zero)[e])


def _linear(h, w_e) -> jax.Array:
    """h [tile, in] through one expert's matrix as a dense layer multiplies (the CPU's form)."""
    return linear(h, w_e).astype(jnp.float32)


def _dot_f32(h, w_e) -> jax.Array:
    """h [tile, in] through one expert's matrix (float [in, out] or a QArray [out, in]) ->
    [tile, out] float32, accumulated and returned in float32 as `ragged` does."""
    f32 = jnp.float32
    if not isinstance(w_e, QArray):
        return jnp.dot(h, w_e.astype(h.dtype), preferred_element_type=f32)
    if per_channel_int8(w_e):
        out = jnp.einsum("ti,oi->to", h, w_e.q.astype(h.dtype), preferred_element_type=f32)
        return out * w_e.scale[:, 0].astype(f32)
    return _dot(h, w_e, preferred=f32)


def _tile_budget(rows, w) -> int:
    """Tiles a GPU loop step takes: as many experts' matrices as fit TILE_WEIGHT_BYTES."""
    inp, out = (w.shape[-2:] if not isinstance(w, QArray)
                else (w.q.shape[-1] * (8 // w.bits), w.q.shape[-2]))
    return max(1, TILE_WEIGHT_BYTES // (inp * out * jnp.dtype(rows.dtype).itemsize))


def tiled(rows, w, group_sizes, tile: int | None = None, tiles_at_once: int | None = 1):
    """grouped's result by a loop over tiles of one expert each (see the module docstring).
    tile: rows per tile (default M // E, at least 1: about 2E tiles, at most 2M rows).
    tiles_at_once: 1, one tile a loop step through qlinear.linear (the CPU's form); else that
    many tiles a step as one batched float32 matmul (None: as many as TILE_WEIGHT_BYTES
    allows), the GPU's form."""
    num_rows, num_experts = rows.shape[0], group_sizes.shape[0]
    tile = tile or max(1, num_rows // num_experts)
    # padded layout: each group from a tile boundary; one more tile for rows of no group
    padded = (group_sizes + tile - 1) // tile * tile
    padded_end = jnp.cumsum(padded)
    start, padded_start = jnp.cumsum(group_sizes) - group_sizes, padded_end - padded
    num_tiles = -(-(num_rows + num_experts * (tile - 1)) // tile) + 1
    index = jnp.arange(num_rows)
    group = jnp.minimum(jnp.searchsorted(jnp.cumsum(group_sizes), index, side="right"),
                        num_experts - 1)
    in_group = index < jnp.sum(group_sizes)
    slot = jnp.where(in_group, padded_start[group] + index - start[group],
                     (num_tiles - 1) * tile + index % tile)
    buf = jnp.zeros((num_tiles * tile, rows.shape[-1]), rows.dtype).at[slot].set(rows)
    tile_expert = jnp.minimum(jnp.searchsorted(padded_end, jnp.arange(num_tiles) * tile,
                                               side="right"), num_experts - 1)
    tiles = buf.reshape(num_tiles, tile, -1)                      # [num_tiles, tile, in]
    if tiles_at_once == 1:
        out = jax.lax.map(lambda a: _linear(a[0], _expert(w, a[1])), (tiles, tile_expert))
    else:
        batch = min(num_tiles, tiles_at_once or _tile_budget(rows, w))
        # (lax.map vmaps each step: the step's experts' matrices are gathered, [batch, in, out])
        out = jax.lax.map(lambda a: _dot_f32(a[0], _expert(w, a[1])), (tiles, tile_expert),
                          batch_size=batch)
    return out.reshape(num_tiles * tile, -1)[slot]                 # [M, out]
