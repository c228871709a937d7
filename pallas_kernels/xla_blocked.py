"""The Pallas kernels' blocked paged attention in plain jnp: the XLA path for GPUs.

Same blocks as the kernels (metadata.py: ragged_blocks for prefill and multi-row requests,
kv_split_metadata for split-KV decode rows), same KernelConfig, same merge of splits and sinks
(ragged_paged_attention.sink_weight), but every block at once instead of one program per block:
each step of one lax.while_loop gathers tile t_lo + i of every block (the pages of a tile
gathered once, as a [NB, tile, Hkv, D] tensor), scores all blocks with one batched Q·Kᵀ einsum,
folds them into the blocks' online softmax and adds one batched P·V. The loop runs as many steps
as the step's longest block has tiles; a block past its own tiles reads scratch page 0 (cheap,
the same page every time) and is masked out. So it serves GPUs without a usable Pallas kernel
(before Hopper, or shapes kernel_fit.py refuses) with a fixed, small number of XLA ops per
layer, however many rows or requests the step has: no per-row Python or lax loop.

fp8 pages are widened to the query's dtype right after the gather (the model passes the query
already multiplied by k_scale and rescales the output by v_scale, model/quant/kv.py). Products
are accumulated in float32; with a float32 query they run at HIGHEST precision (no TF32).
Block sizes come from tuning.py's "xla" row. This module must stay pure jnp (it borrows the
kernels' static configuration and merge helpers, never a pallas_call) and must not touch engine
state; pallas_kernels/reference.py is its oracle.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import metadata, tuning
from pallas_kernels.paged_attention import decode_config, merge_splits
from pallas_kernels.ragged_paged_attention import KernelConfig, ragged_config, sink_weight
from pallas_kernels.reference import check_sinks

NEG_INF = -1e30


def attend_blocks(c: KernelConfig, layer, page_table, meta, q_blocks, k_pages, v_pages):
    """Every block's attention over its tiles [t_lo, t_hi) (meta [NB, 5]).

    q_blocks [NB, tokens, Hkv, G, D] -> out [NB, Hkv, G, tokens, D] float32, normalised over
    the block's visible positions, and lse [NB, Hkv, G, tokens] (NEG_INF where none was)."""
    num_blocks, tokens, num_kv_heads, group, head_dim = q_blocks.shape
    dtype = q_blocks.dtype
    precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None
    seq, first, n, t_lo, t_hi = (meta[:, i] for i in range(5))
    pages_per_seq = page_table.shape[1]
    table = page_table[seq]                                             # [NB, P]
    pos = first[:, None] + jnp.arange(tokens)                           # [NB, tokens]
    live = jnp.arange(tokens)[None, :] < n[:, None]                     # [NB, tokens]
    slots = jnp.arange(c.tile_pages)

    def body(i, carry):
        m, l, acc = carry
        t = t_lo + i                                                    # [NB]
        active = t < t_hi
        index = jnp.minimum(t[:, None] * c.tile_pages + slots, pages_per_seq - 1)
        pages = jnp.where(active[:, None], jnp.take_along_axis(table, index, axis=1), 0)
        k = k_pages[layer, pages].reshape(num_blocks, c.tile, num_kv_heads, head_dim)
        v = v_pages[layer, pages].reshape(num_blocks, c.tile, num_kv_heads, head_dim)
        s = jnp.einsum("bqhgd,bthd->bhgqt", q_blocks, k.astype(dtype), precision=precision,
                       preferred_element_type=jnp.float32) * c.sm_scale
        if c.soft_cap is not None:
            s = c.soft_cap * jnp.tanh(s / c.soft_cap)
        kv_pos = t[:, None, None] * c.tile + jnp.arange(c.tile)         # [NB, 1, tile]
        mask = active[:, None, None] & live[:, :, None] & (kv_pos <= pos[:, :, None])
        if c.sliding_window is not None:
            mask &= kv_pos > pos[:, :, None] - c.sliding_window
        mask = mask[:, None, None]                                      # [NB, 1, 1, tok, tile]
        s = jnp.where(mask, s, NEG_INF)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        pv = jnp.einsum("bhgqt,bthd->bhgqd", p.astype(dtype), v.astype(dtype),
                        precision=precision, preferred_element_type=jnp.float32)
        return m_new, alpha * l + p.sum(axis=-1), alpha[..., None] * acc + pv

    stats = (num_blocks, num_kv_heads, group, tokens)
    init = (jnp.full(stats, NEG_INF, jnp.float32), jnp.zeros(stats, jnp.float32),
            jnp.zeros((*stats, head_dim), jnp.float32))
    steps = jnp.maximum(jnp.max(t_hi - t_lo), 0)
    m, l, acc = lax.fori_loop(0, steps, body, init)
    l_safe = jnp.where(l > 0, l, 1.0)
    return acc / l_safe[..., None], jnp.where(l > 0, m + jnp.log(l_safe), NEG_INF)


@functools.partial(jax.jit, static_argnames=("c",))
def ragged_attend(q, k_pages, v_pages, layer, page_table, blocks: metadata.RaggedBlocks,
                  sinks=None, *, c: KernelConfig):
    """One layer over precomputed ragged blocks (ragged_paged_attention.ragged_attend's
    contract): q [T, Hq, D] -> [T, Hq, D], rows not blocks.valid zero."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[3]
    check_sinks(sinks, num_heads)
    q5 = q.reshape(num_tokens, num_kv_heads, c.group, head_dim)[blocks.token_index]
    out, lse = attend_blocks(c, layer, page_table, blocks.meta, q5, k_pages, v_pages)
    out_t = out[blocks.block_of_row, :, :, blocks.slot_of_row]          # [T, Hkv, G, D]
    if sinks is not None:
        lse_t = lse[blocks.block_of_row, :, :, blocks.slot_of_row]      # [T, Hkv, G]
        sink = sinks.astype(jnp.float32).reshape(num_kv_heads, c.group)
        out_t = out_t * sink_weight(lse_t, sink)[..., None]
    out_t = jnp.where(blocks.valid[:, None, None, None], out_t, 0.0)
    return out_t.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("c", "num_splits"))
def decode_attend(q, k_pages, v_pages, layer, page_table, kv_lens, meta, sinks=None, *,
                  c: KernelConfig, num_splits: int):
    """One layer's decode rows over split metadata (kv_split_metadata; the contract of
    paged_attention.decode_attend): q [S, Hq, D] -> [S, Hq, D], rows with kv_lens 0 zero."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[3]
    check_sinks(sinks, num_heads)
    q5 = q.reshape(num_seqs, 1, num_kv_heads, c.group, head_dim)
    q_blocks = jnp.repeat(q5, num_splits, axis=0)                  # [S * K, 1, Hkv, G, D]
    out, lse = attend_blocks(c, layer, page_table, meta, q_blocks, k_pages, v_pages)
    out = out[..., 0, :].reshape(num_seqs, num_splits, num_kv_heads, c.group, head_dim)
    lse = lse[..., 0].reshape(num_seqs, num_splits, num_kv_heads, c.group)
    # merge_splits takes the split axis third: [Hkv, S, K, G(, D)]
    out, lse = merge_splits(out.transpose(2, 0, 1, 3, 4), lse.transpose(2, 0, 1, 3))
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(num_kv_heads, 1, c.group)
        out = out * sink_weight(lse, sink)[..., None]
    out = out.transpose(1, 0, 2, 3).reshape(num_seqs, num_heads, head_dim)
    return jnp.where((kv_lens > 0)[:, None, None], out, 0.0).astype(q.dtype)


def ragged_paged_attention(q, k_pages, v_pages, layer, kv_lens, page_table, cu_q_lens, num_seqs,
                           *, sm_scale: float, soft_cap: float | None = None,
                           sliding_window: int | None = None, sinks=None,
                           q_block: int | None = None, tile_pages: int | None = None):
    """reference.ragged_paged_attention's contract, blocked: q [T, Hq, D] -> [T, Hq, D]."""
    c = ragged_config(q.shape[1] // k_pages.shape[3], k_pages.shape[2], page_table.shape[1],
                      tuning.block_sizes("xla"), sm_scale=sm_scale, soft_cap=soft_cap,
                      sliding_window=sliding_window, q_block=q_block, tile_pages=tile_pages)
    blocks = metadata.ragged_blocks(cu_q_lens, kv_lens, num_seqs, q.shape[0], tokens=c.tokens,
                                    tile=c.tile, sliding_window=sliding_window)
    return ragged_attend(q, k_pages, v_pages, layer, page_table, blocks, sinks, c=c)


def paged_attention(q, k_pages, v_pages, layer, kv_lens, page_table, *, sm_scale: float,
                    soft_cap: float | None = None, sliding_window: int | None = None,
                    sinks=None, tile_pages: int | None = None, num_kv_splits: int | None = None):
    """reference.paged_attention's contract (one query row per request), split-KV blocked."""
    num_seqs, num_heads, _ = q.shape
    c, num_splits = decode_config(num_heads // k_pages.shape[3], k_pages.shape[2],
                                  page_table.shape[1], k_pages.shape[3], num_seqs,
                                  tuning.block_sizes("xla"), sm_scale=sm_scale,
                                  soft_cap=soft_cap, sliding_window=sliding_window,
                                  tile_pages=tile_pages, num_kv_splits=num_kv_splits)
    meta = metadata.kv_split_metadata(kv_lens, num_splits, c.tile, sliding_window)
    return decode_attend(q, k_pages, v_pages, layer, page_table, kv_lens, meta, sinks, c=c,
                         num_splits=num_splits)
