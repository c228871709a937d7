"""Decode attention on the XLA path (CPU, GPUs without Pallas): one query row per request,
every request's KV tiles as one flat work list.

A step's decode rows are split into work items, one per (request, KV tile of `tile_pages`
pages); `decode_work` lists them once per step (and per sliding window), request-major, and each
layer walks the list `items_per_chunk` items at a time in one while loop: a chunk gathers its
items' K/V tiles, scores them against their own request's query, and merges each item's
partial softmax (running max, sum, weighted values) into its request's accumulators by
scatter. So the work follows the real contexts (no request pays for a longer one beside it,
no padding row costs anything), and a layer costs a few dozen XLA ops per chunk whatever the
number of requests: the reference path (pallas_kernels/reference.py, this module's oracle)
runs one small loop per 4 rows, ~700 ops a layer at 64 decode rows, which on the CPU cost
more than the arithmetic (measured: docs/host_loop.md). Where jaxserve's CPU kernel can
run (model/cpu/attention.py: a one-device CPU process, float32 or fp8 pages) attention.py sends
decode rows there instead. Pure jnp; no requests, no scheduling.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.reference import sink_state

NEG_INF = -1e30
# Up to this many KV heads, a chunk's scores are one plain batched matmul per item against the
# tile's K as stored ([tile, Hkv * D]) with each query head's row zero outside its own KV
# head's columns: Hkv times the (small) arithmetic, but no transposed copy of the gathered K/V
# tile, which on the CPU cost more than the matmuls (docs/host_loop.md). With more KV heads the
# wasted arithmetic outgrows that (8 heads of 128: 1.5-2x the reference's time), so
# model/decoder/attention.py keeps such models on the reference path.
WIDE_MAX_KV_HEADS = 4


class DecodeWork(NamedTuple):
    """The step's decode work list for one sliding window (made once per step)."""

    item_seq: jax.Array    # [M] i32 request of each item (padding: S, a dropped row)
    item_pages: jax.Array  # [M, tile_pages] i32 the item's KV pages (padding: scratch page 0)
    item_first: jax.Array  # [M] i32 position of the item's first KV row
    item_len: jax.Array    # [M] i32 its request's context (padding: 0)
    item_lo: jax.Array     # [M] i32 first position its request sees (sliding window)
    num_items: jax.Array   # [] i32 items in use


def decode_work(kv_lens, num_decode, page_table, page_size: int, *, tile_pages: int,
                sliding_window: int | None = None) -> DecodeWork:
    """Work items of requests 0..num_decode-1 (one query row each, at position kv_len - 1).

    kv_lens: [S] i32; page_table: [S, P] i32. M = S * ceil(P / tile_pages)."""
    num_seqs, max_pages = page_table.shape
    tile = tile_pages * page_size
    tiles_per_seq = -(-max_pages // tile_pages)
    seq = jnp.arange(num_seqs, dtype=jnp.int32)
    lens = jnp.where(seq < jnp.reshape(num_decode, ()), kv_lens.astype(jnp.int32), 0)
    lo = jnp.zeros_like(lens) if sliding_window is None else jnp.maximum(
        lens - sliding_window, 0)
    first = lo // tile
    count = jnp.where(lens > 0, -(-lens // tile) - first, 0)  # [S] items of each request
    ends = jnp.cumsum(count).astype(jnp.int32)
    items = jnp.arange(num_seqs * tiles_per_seq, dtype=jnp.int32)
    # (S past the end) an unrolled binary search: no while loop, whose per-iteration dispatch
    # cost ~20 us a step on the CPU at 64 requests, more than the search itself
    item_seq = jnp.searchsorted(ends, items, side="right",
                                method="scan_unrolled").astype(jnp.int32)
    valid = item_seq < num_seqs
    safe = jnp.minimum(item_seq, num_seqs - 1)
    item_tile = jnp.where(valid, first[safe] + items - (ends - count)[safe], 0)
    table = jnp.pad(page_table, ((0, 0), (0, tiles_per_seq * tile_pages - max_pages)))
    pages = table[safe[:, None], item_tile[:, None] * tile_pages + jnp.arange(tile_pages)]
    return DecodeWork(item_seq, jnp.where(valid[:, None], pages, 0), item_tile * tile,
                      jnp.where(valid, lens[safe], 0), jnp.where(valid, lo[safe], 0), ends[-1])


def decode_attention(q, k_pages, v_pages, layer, work: DecodeWork, *, sm_scale: float,
                     items_per_chunk: int, soft_cap: float | None = None, sinks=None):
    """q: [S, Hq, D], row s the query of request s; k_pages, v_pages: [L, N, page_size, Hkv,
    D]; sinks: None or [Hq] float32 attention sinks, each request's accumulators starting
    from its heads' sinks (reference.sink_state), so a sink counts once however many items
    its request has. Returns [S, Hq, D] (requests without work: zero)."""
    num_seqs, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_pages.shape[2], k_pages.shape[3]
    group = num_heads // num_kv_heads
    num_items, tile_pages = work.item_pages.shape
    tile = tile_pages * page_size
    # A chunk costs its size whether its items are real or padding: few requests, few items.
    chunk = min(items_per_chunk, num_items, max(4, num_seqs))
    pad = -(-num_items // chunk) * chunk - num_items  # whole chunks; pads read scratch page 0
    item_seq = jnp.pad(work.item_seq, (0, pad), constant_values=num_seqs)
    item_pages = jnp.pad(work.item_pages, ((0, pad), (0, 0)))
    item_first, item_len, item_lo = (jnp.pad(a, (0, pad)) for a in
                                     (work.item_first, work.item_len, work.item_lo))
    qg = (q.astype(jnp.float32) * sm_scale).reshape(num_seqs, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, 1), (0, 0), (0, 0), (0, 0)))                         # [S + 1, ...]
    offsets = jnp.arange(tile, dtype=jnp.int32)
    wide = num_kv_heads <= WIDE_MAX_KV_HEADS
    eye = jnp.eye(num_kv_heads, dtype=jnp.float32)
    q_wide = (qg[:, :, :, None, :] * eye[None, :, None, :, None]).reshape(
        num_seqs + 1, num_heads, num_kv_heads * head_dim)  # [S + 1, Hq, Hkv * D]

    def body(carry):
        c, m, l, acc = carry
        take = lambda a: jax.lax.dynamic_slice_in_dim(a, c * chunk, chunk)
        seqs, pages = take(item_seq), take(item_pages)                      # [C], [C, tp]
        k = k_pages[layer, pages].reshape(chunk, tile, num_kv_heads, head_dim)
        v = v_pages[layer, pages].reshape(chunk, tile, num_kv_heads, head_dim)
        if wide:
            s = jnp.einsum("cyx,ctx->cyt", q_wide[seqs],
                           k.reshape(chunk, tile, -1).astype(jnp.float32))
            s = s.reshape(chunk, num_kv_heads, group, tile)
        else:
            s = jnp.einsum("chgd,cthd->chgt", qg[seqs], k.astype(jnp.float32))
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kv_pos = take(item_first)[:, None] + offsets                         # [C, tile]
        mask = (kv_pos < take(item_len)[:, None]) & (kv_pos >= take(item_lo)[:, None])
        s = jnp.where(mask[:, None, None, :], s, NEG_INF)
        m_item = s.max(axis=-1)                                             # [C, Hkv, G]
        p = jnp.where(mask[:, None, None, :], jnp.exp(s - m_item[..., None]), 0.0)
        if wide:  # [C, Hq, Hkv * D], of which each head keeps its own KV head's block
            full = jnp.einsum("cyt,ctx->cyx", p.reshape(chunk, num_heads, tile),
                              v.reshape(chunk, tile, -1).astype(jnp.float32))
            g, d = group, head_dim
            pv = jnp.stack([full[:, h * g:(h + 1) * g, h * d:(h + 1) * d]
                            for h in range(num_kv_heads)], axis=1)      # [C, Hkv, G, D]
        else:
            pv = jnp.einsum("chgt,cthd->chgd", p, v.astype(jnp.float32))       # [C, Hkv, G, D]
        m_new = m.at[seqs].max(m_item)
        rescale = jnp.exp(m - m_new)
        weight = jnp.exp(m_item - m_new[seqs])
        l = (l * rescale).at[seqs].add(p.sum(axis=-1) * weight)
        acc = (acc * rescale[..., None]).at[seqs].add(pv * weight[..., None])
        return c + 1, m_new, l, acc

    shape = (num_seqs + 1, num_kv_heads, group)
    m0, l0 = sink_state(sinks, shape)
    init = (jnp.int32(0), m0, l0, jnp.zeros((*shape, head_dim), jnp.float32))
    num_chunks = -(-work.num_items // chunk)
    _, _, l, acc = jax.lax.while_loop(lambda c: c[0] < num_chunks, body, init)
    out = acc[:num_seqs] / jnp.where(l[:num_seqs] > 0, l[:num_seqs], 1.0)[..., None]
    return out.reshape(num_seqs, num_heads, head_dim).astype(q.dtype)
