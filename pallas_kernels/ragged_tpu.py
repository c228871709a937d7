"""Ragged paged attention's Mosaic TPU lowering: one program per block, all KV heads in it.

Layout: the engine's pages stay [L, N, page_size, Hkv, D] (K and V apart). On a TPU the last
two dimensions (Hkv, D) are tiled, so one KV head of a page is one sublane out of each tile;
copying it alone is a strided DMA of partial tiles (tpu_rules.py refuses it). Instead every
DMA copies a whole page with all its heads (`k_hbm.at[layer, page]`, [page_size, Hkv, D]) into
a VMEM buffer [2, tile, Hkv, D] (two slots: double buffering), and the program that owns the
block attends every KV head to that tile before the next one:
* one DMA per page and K/V instead of one per page, K/V and head (Hkv times fewer issues);
* a head's rows [tile, D] are a strided sublane load of the buffer folded to [tile * Hkv, D]
  (step Hkv); bf16 / 8-bit buffers are read as 32-bit words (step Hkv / packing) and the head
  taken out of its half / byte of each word, so no load ever strides over packed rows;
* where Hkv heads share one packed word (bf16 with one KV head, 8-bit with one or two) the
  buffer is widened whole to float32 into a VMEM copy, which folds, and heads are read there.
tpu_rules.head_access picks between the two; tpu_rules.check must pass or the call raises.
JAX's TPU simulator (pltpu.InterpretParams) interprets no ref reshape or bitcast, so there
(and only there) a head is read by indexing the 3-D buffer: the simulator checks the copy
schedule and semaphores, Pallas' generic interpreter (interpret=True) the head reads.
The grid runs blocks in order ("arbitrary"): the last tile of a block starts the copy of the
next block's first tile, so a decode block (often one tile) does not wait for its first
copy. The price: a megacore chip (v5p, v7x) runs the grid on one of its two cores.

Why not JAX's shipped TPU kernel (jax.experimental.pallas.ops.tpu.ragged_paged_attention):
it reads one array of interleaved K/V heads per page without a layer axis, has no attention
sinks and reports no log-sum-exp (split-KV decode needs it), and refuses 8-bit KV with one KV
head per device; the engine keeps separate K/V pages per layer.

Pages a block cannot see are not copied; their V rows are zeroed so stale VMEM never reaches
the sum. fp8 pages are widened to float32 before the query's dtype (P never rounds to fp8).
This module must not hold engine state or write the cache; the GPU lowering is ragged_gpu.py.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import tpu_rules
from pallas_kernels.kernel_config import (META_FIELDS, NEG_INF, KernelConfig, is_fp8, scores,
                                          visible)

LANES = 128


def rules_config(c: KernelConfig, q_blocks, k_pages, page_table) -> tpu_rules.TpuConfig:
    num_kv_heads, num_blocks, rows, head_dim = q_blocks.shape
    return tpu_rules.TpuConfig(head_dim, num_kv_heads, k_pages.dtype, q_blocks.dtype,
                               c.page_size, c.tile_pages, rows, with_stats=c.with_stats,
                               num_blocks=num_blocks, page_table_entries=page_table.size)


def head_rows(folded, h: int, num_kv_heads: int):
    """KV head h of a folded buffer [tile * Hkv, D] -> [tile, D] float32."""
    dtype = folded.dtype
    packing = 4 // jnp.dtype(dtype).itemsize
    if packing == 1:
        rows = folded[h::num_kv_heads] if num_kv_heads > 1 else folded[...]
        return rows.astype(jnp.float32)
    words = folded.bitcast(jnp.uint32)                   # [tile * Hkv / packing, D]
    step = num_kv_heads // packing
    w = words[h // packing::step] if step > 1 else words[...]   # [tile, D] words
    part = h % packing                                   # row h sits in bits [part * bits, ...)
    if dtype == jnp.bfloat16:  # a bf16 moved to the top half of a word is that float32
        top = w << 16 if part == 0 else w & jnp.uint32(0xFFFF0000)
        return lax.bitcast_convert_type(top, jnp.float32)
    bits = 32 // packing
    narrow = jnp.dtype(f"uint{bits}")
    value = lax.bitcast_convert_type((w >> (part * bits)).astype(narrow), dtype)
    return value.astype(jnp.float32)


class _Block(NamedTuple):
    seq: jax.Array
    first: jax.Array
    n: jax.Array
    t_lo: jax.Array
    t_hi: jax.Array
    lo_page: jax.Array
    hi_page: jax.Array


def _block(c: KernelConfig, meta_ref, b) -> _Block:
    seq, first, n, t_lo, t_hi = (meta_ref[b * META_FIELDS + i] for i in range(META_FIELDS))
    lo = jnp.int32(0) if c.sliding_window is None else jnp.maximum(first - c.sliding_window + 1, 0)
    # lax.div truncates, fine for these non-negative values; `//` would add a sign fix-up.
    return _Block(seq, first, n, t_lo, t_hi, lax.div(lo, c.page_size),
                  lax.div(first + n - 1, c.page_size))


def _kernel(layer_ref, pages_ref, meta_ref, slot_ref, q_ref, k_hbm, v_hbm, *refs,
            c: KernelConfig, access: str):
    o_ref, lse_ref = (refs[0], refs[1]) if c.with_stats else (refs[0], None)
    scratch = refs[2 if c.with_stats else 1:]
    k_buf, v_buf = scratch[:2]
    wide = scratch[2:4] if access == "widen" else None
    sems, m_ref, l_ref, acc_ref = scratch[-4:]
    num_kv_heads, rows, head_dim = q_ref.shape
    b, num_blocks = pl.program_id(0), pl.num_programs(0)
    layer = layer_ref[0]
    cur = _block(c, meta_ref, b)
    nxt = _block(c, meta_ref, jnp.minimum(b + 1, num_blocks - 1))
    prev = _block(c, meta_ref, jnp.maximum(b - 1, 0))

    def run(blk: _Block, t, slot, action):
        """Start or wait for the whole-page copies of tile t of a block into a buffer slot."""
        for j in range(c.tile_pages):
            index = t * c.tile_pages + j
            page = pages_ref[blk.seq * c.pages_per_seq + jnp.minimum(index, c.pages_per_seq - 1)]
            dst = pl.ds(j * c.page_size, c.page_size)

            @pl.when((index >= blk.lo_page) & (index <= blk.hi_page))
            def _():
                for i, (src, buf) in enumerate(((k_hbm, k_buf), (v_hbm, v_buf))):
                    copy = pltpu.make_async_copy(src.at[layer, page], buf.at[slot, dst],
                                                 sems.at[i, slot])
                    getattr(copy, action)()

    # The previous block's last tile already started this block's first copy (if both ran).
    slot0 = slot_ref[b]
    prefetched = (b > 0) & (prev.t_lo < prev.t_hi)
    pl.when((cur.t_lo < cur.t_hi) & ~prefetched)(lambda: run(cur, cur.t_lo, slot0, "start"))
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    m_ref[...] = jnp.full(m_ref.shape, NEG_INF, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    row = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    q_dtype, kv_dtype = q_ref.dtype, k_buf.dtype
    v_dtype = q_dtype if is_fp8(kv_dtype) else kv_dtype  # fp8: P·V never rounds P to fp8
    precision = lax.Precision.HIGHEST if q_dtype == jnp.float32 else None

    def body(t, carry):
        slot = lax.rem(slot0 + t - cur.t_lo, 2)
        pl.when(t + 1 < cur.t_hi)(lambda: run(cur, t + 1, 1 - slot, "start"))
        pl.when((t + 1 == cur.t_hi) & (b + 1 < num_blocks) & (nxt.t_lo < nxt.t_hi))(
            lambda: run(nxt, nxt.t_lo, 1 - slot, "start"))
        run(cur, t, slot, "wait")
        kv_pos = t * c.tile + lax.broadcasted_iota(jnp.int32, (1, c.tile), 1)
        mask = visible(c, row, kv_pos, cur.first, cur.n)             # [rows, tile]
        kv_row = t * c.tile + lax.broadcasted_iota(jnp.int32, (c.tile, 1), 0)
        fetched = ((kv_row >= cur.lo_page * c.page_size)
                   & (kv_row < (cur.hi_page + 1) * c.page_size))     # [tile, 1]
        sources = []
        for i, buf in enumerate((k_buf, v_buf)):
            if access == "indexed":
                sources.append(buf.at[slot])
            elif wide is None:
                sources.append(buf.at[slot].reshape(c.tile * num_kv_heads, head_dim))
            else:
                wide[i][...] = buf[slot].astype(jnp.float32)          # [tile, Hkv, D]
                sources.append(wide[i].reshape(c.tile * num_kv_heads, head_dim))
        k_src, v_src = sources                                       # [tile * Hkv, D]
        def head(src, h):                                            # [tile, D] float32
            if access == "indexed":
                return src[:, h, :].astype(jnp.float32)
            return head_rows(src, h, num_kv_heads)

        for h in range(num_kv_heads):
            k = head(k_src, h).astype(q_dtype)                       # [tile, D]
            s = lax.dot_general(q_ref[h], k, (((1,), (1,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32)  # [rows, tile]
            s = jnp.where(mask, scores(c, s), NEG_INF)
            m_prev, l_prev = m_ref[h][:, :1], l_ref[h][:, :1]        # [rows, 1]
            m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
            p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
            alpha = jnp.exp(m_prev - m_new)
            v = jnp.where(fetched, head(v_src, h), 0).astype(v_dtype)
            pv = lax.dot_general(p.astype(v_dtype), v, (((1,), (0,)), ((), ())),
                                 precision=precision, preferred_element_type=jnp.float32)
            acc_ref[h] = alpha * acc_ref[h] + pv
            m_ref[h] = jnp.broadcast_to(m_new, (rows, LANES))
            l_ref[h] = jnp.broadcast_to(alpha * l_prev + p.sum(axis=1, keepdims=True),
                                        (rows, LANES))
        return carry

    lax.fori_loop(cur.t_lo, cur.t_hi, body, 0)
    for h in range(num_kv_heads):
        m, l = m_ref[h][:, :1], l_ref[h][:, :1]
        l_safe = jnp.where(l > 0, l, 1.0)
        o_ref[h] = (acc_ref[h] / l_safe).astype(o_ref.dtype)
        if lse_ref is not None:
            lse_ref[h] = jnp.where(l > 0, m + jnp.log(l_safe), NEG_INF)


def tpu_call(c: KernelConfig, layer, page_table, meta, q_blocks, k_pages, v_pages, out_dtype,
             interpret):
    """o [Hkv, NB, rows, D] (and lse [Hkv, NB, rows] with stats) for q_blocks [Hkv, NB, rows, D]."""
    num_kv_heads, num_blocks, rows, head_dim = q_blocks.shape
    config = rules_config(c, q_blocks, k_pages, page_table)
    problems = tpu_rules.check(config)
    if problems:
        raise ValueError("the TPU paged-attention kernel cannot run this configuration: "
                         + "; ".join(problems))
    access = tpu_rules.head_access(config)
    if isinstance(interpret, pltpu.InterpretParams):
        access = "indexed"  # the TPU simulator interprets no ref reshape or bitcast
    tiles = meta[:, 4] - meta[:, 3]
    first_slot = ((jnp.cumsum(tiles) - tiles) % 2).astype(jnp.int32)  # [NB]: tiles before, mod 2
    block = pl.BlockSpec((num_kv_heads, None, rows, head_dim), lambda b, *_: (0, b, 0, 0))
    out_specs, out_shape = [block], [jax.ShapeDtypeStruct(q_blocks.shape, out_dtype)]
    if c.with_stats:
        out_specs.append(pl.BlockSpec((num_kv_heads, None, rows, 1),
                                      lambda b, *_: (0, b, 0, 0)))
        out_shape.append(jax.ShapeDtypeStruct((num_kv_heads, num_blocks, rows, 1), jnp.float32))
    buffers = [pltpu.VMEM((2, c.tile, num_kv_heads, head_dim), pages.dtype)
               for pages in (k_pages, v_pages)]
    if access == "widen":
        buffers += [pltpu.VMEM((c.tile, num_kv_heads, head_dim), jnp.float32)] * 2
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4, grid=(num_blocks,),
        in_specs=[block, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=out_specs,
        scratch_shapes=buffers + [
            pltpu.SemaphoreType.DMA((2, 2)),
            pltpu.VMEM((num_kv_heads, rows, LANES), jnp.float32),       # running max
            pltpu.VMEM((num_kv_heads, rows, LANES), jnp.float32),       # running sum
            pltpu.VMEM((num_kv_heads, rows, head_dim), jnp.float32)])   # output accumulator
    outs = pl.pallas_call(
        functools.partial(_kernel, c=c, access=access), grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                             vmem_limit_bytes=tpu_rules.VMEM_BUDGET),
        interpret=interpret, name="ragged_paged_attention_tpu",
    )(layer, page_table.reshape(-1), meta.reshape(-1), first_slot, q_blocks, k_pages, v_pages)
    return outs[0], (outs[1][..., 0] if c.with_stats else None)
