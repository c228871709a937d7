"""Paged decode attention in Pallas: one query row per request, split over KV pages.

Each request's visible KV range is cut into `num_kv_splits` runs of whole tiles (a tile is
`tile_pages` pages); one program per (request, split) on TPU (all KV heads in it), per (KV head,
request, split) on GPU, runs an online softmax over its tiles with the same block kernels as
ragged_paged_attention.py (a block here is one token times the query heads of one KV head), and
the splits are merged by their log-sum-exp. Splitting (flash-decoding) gives a GPU enough
programs when few long requests decode; tuning.py decides how many from the static shapes, and
a TPU never splits. Lowerings, interpret modes and the
caveats on cache contents are those of ragged_paged_attention.py.

This module must not keep state or read pages past a request's context other than the rest of
its last tile; it never writes the cache.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import tuning
from pallas_kernels.metadata import kv_split_metadata
from pallas_kernels.reference import check_sinks
from pallas_kernels.ragged_paged_attention import (KernelConfig, attend_blocks, gather_q_blocks,
                                                   sink_weight)


def merge_splits(out, lse):
    """Merge split results: out [Hkv, S, K, G, D] normalized per split, lse [Hkv, S, K, G].
    Returns the merged out [Hkv, S, G, D] and its lse [Hkv, S, G]."""
    top = lse.max(axis=2, keepdims=True)
    weight = jnp.exp(lse - top)                               # the best split weighs 1
    total = weight.sum(axis=2)
    return (out * weight[..., None]).sum(axis=2) / total[..., None], top[:, :, 0] + jnp.log(total)


def paged_attention(q, k_pages, v_pages, layer, kv_lens, page_table, *, sm_scale: float,
                    soft_cap: float | None = None, sliding_window: int | None = None,
                    sinks=None, interpret=False, tile_pages: int | None = None,
                    num_kv_splits: int | None = None):
    """Decode attention: one query row per request (see reference.py).

    q: [S, Hq, D]; k_pages, v_pages: [L, N, page_size, Hkv, D]; layer: i32 scalar;
    kv_lens: [S] context including the current token (0 = unused row, output zero);
    page_table: [S, P]; sinks: None or [Hq] float32 attention sinks. interpret: False
    (compiled for the default backend), True (generic Pallas interpreter), or a TPU / GPU
    interpret-params object. tile_pages and num_kv_splits override tuning.py.
    Returns [S, Hq, D].
    """
    formulation, sizes, interpret = tuning.plan(interpret)
    return _decode(q, k_pages, v_pages, layer, kv_lens, page_table, sinks, sm_scale=sm_scale,
                   soft_cap=soft_cap, sliding_window=sliding_window, formulation=formulation,
                   sizes=sizes, interpret=interpret, tile_pages=tile_pages,
                   num_kv_splits=num_kv_splits)


def decode_config(group: int, page_size: int, pages_per_seq: int, num_kv_heads: int,
                  num_seqs: int, sizes, *, sm_scale: float, soft_cap: float | None,
                  sliding_window: int | None, tile_pages: int | None = None,
                  num_kv_splits: int | None = None) -> tuple[KernelConfig, int]:
    """(kernel configuration, KV splits per request) of the decode kernel for these shapes."""
    tile_pages = tile_pages or tuning.pages_per_tile(page_size, sizes)
    num_splits = num_kv_splits or tuning.num_kv_splits(
        num_kv_heads, num_seqs, -(-pages_per_seq // tile_pages), sizes)
    c = KernelConfig(group, 1, tuning.block_rows(group, 1, sizes), page_size, tile_pages,
                     pages_per_seq, sm_scale, soft_cap, sliding_window,
                     with_stats=num_splits > 1)
    return c, num_splits


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window",
                                             "formulation", "sizes", "interpret", "tile_pages",
                                             "num_kv_splits"))
def _decode(q, k_pages, v_pages, layer, kv_lens, page_table, sinks, *, sm_scale, soft_cap,
            sliding_window, formulation, sizes, interpret, tile_pages, num_kv_splits):
    num_seqs, num_heads, _ = q.shape
    c, num_splits = decode_config(num_heads // k_pages.shape[3], k_pages.shape[2],
                                  page_table.shape[1], k_pages.shape[3], num_seqs, sizes,
                                  sm_scale=sm_scale, soft_cap=soft_cap,
                                  sliding_window=sliding_window, tile_pages=tile_pages,
                                  num_kv_splits=num_kv_splits)
    meta = kv_split_metadata(kv_lens, num_splits, c.tile, sliding_window)
    return decode_attend(q, k_pages, v_pages, layer, page_table, kv_lens, meta, sinks, c=c,
                         num_splits=num_splits, formulation=formulation, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("c", "num_splits", "formulation", "interpret"))
def decode_attend(q, k_pages, v_pages, layer, page_table, kv_lens, meta, sinks=None, *,
                  c: KernelConfig, num_splits: int, formulation: str, interpret):
    """One layer's decode attention over precomputed split metadata (kv_split_metadata).
    q: [S, Hq, D]; sinks: None or [Hq] float32, added once to the merged splits
    (sink_weight); rows with kv_lens 0 come back zero. Returns [S, Hq, D]."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[3]
    group = c.group
    if sinks is not None:
        check_sinks(sinks, num_heads)
        c = dataclasses.replace(c, with_stats=True)
    requests = jnp.repeat(jnp.arange(num_seqs, dtype=jnp.int32), num_splits)[:, None]
    q_blocks = gather_q_blocks(q, requests, group, c.rows)          # [Hkv, S*K, rows, D]
    out_dtype = jnp.float32 if c.with_stats else q.dtype
    out, lse = attend_blocks(c, formulation, interpret, layer, page_table, meta, q_blocks,
                             k_pages, v_pages, out_dtype)
    out = out[:, :, :group].reshape(num_kv_heads, num_seqs, num_splits, group, head_dim)
    if c.with_stats:
        lse = lse[:, :, :group].reshape(num_kv_heads, num_seqs, num_splits, group)
        out, lse = merge_splits(out, lse)                       # [Hkv, S, G, D], [Hkv, S, G]
        if sinks is not None:
            sink = sinks.astype(jnp.float32).reshape(num_kv_heads, 1, group)
            out = out * sink_weight(lse, sink)[..., None]
    else:
        out = out[:, :, 0]
    out = out.transpose(1, 0, 2, 3).reshape(num_seqs, num_heads, head_dim)
    return jnp.where((kv_lens > 0)[:, None, None], out, 0).astype(q.dtype)
