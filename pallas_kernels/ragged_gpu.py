"""Ragged paged attention's Mosaic GPU (Hopper) lowering: one warpgroup per (KV head, block).

Pages are copied by TMA into swizzled SMEM, Q·Kᵀ and P·V run on WGMMA with 64-row blocks;
bf16/f16 only, head_dim a multiple of 64, page_size a multiple of 8. A tile always copies all
its pages (clamped to the page table), so K/V must be finite in every page the table names
(true for a pool that starts zeroed and only ever stores real K/V). fp8 pages are widened from
8-bit shared memory into the tile WGMMA reads. In the GPU simulator (a Mosaic GPU
InterpretGPUParams) Q·Kᵀ is a plain dot because that simulator lacks transposed WGMMA operands.
The deprecated Pallas Triton backend is not used. This module must not hold engine state,
write the cache or know about the TPU lowering.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kernel_config import META_FIELDS, NEG_INF, is_fp8, scores, visible, widen


def gpu_call(c, layer, page_table, meta, q_blocks, k_pages, v_pages, out_dtype, interpret):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    num_kv_heads, num_blocks, rows, head_dim = q_blocks.shape
    fp8, tile = is_fp8(k_pages.dtype), c.tile
    # WGMMA operands share one dtype; fp8 pages are widened to the query's in shared memory
    dtype = q_blocks.dtype if fp8 else k_pages.dtype
    q_blocks = q_blocks.astype(dtype)
    simulated = interpret is not None
    if not simulated and jnp.dtype(dtype).itemsize != 2:
        # tf32 WGMMA cannot take the transposed K operand that Q·Kᵀ needs.
        raise ValueError(f"the Mosaic GPU kernel takes bfloat16/float16, not {dtype}")
    if head_dim % 64 or c.page_size % 8 or tile % 64:
        raise ValueError(f"the Mosaic GPU kernel needs head_dim % 64 == 0 (got "
                                  f"{head_dim}), page_size % 8 == 0 (got {c.page_size}) and "
                                  f"KV tiles of a multiple of 64 positions (got {tile})")
    # The GPU simulator has no layout_cast; layouts only matter to the compiler anyway.
    layout = (lambda x, _: x) if simulated else plgpu.layout_cast
    wgmma_rows, reduced_rows = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1)

    def smem(shape, dt):
        itemsize = jnp.dtype(dt).itemsize
        return plgpu.SMEM(shape, dt, transforms=(plgpu.TilingTransform((8, 128 // itemsize)),
                                                 plgpu.SwizzleTransform(128)))

    def widen_tile(raw):
        """An fp8 tile [tile, D] in shared memory -> the operands' dtype, WGMMA-laid-out."""
        if simulated:
            return widen(raw[...], dtype)
        return layout(widen(plgpu.load(raw, (), layout=plgpu.Layout.WGMMA_UPCAST_2X), dtype),
                      wgmma_rows)

    def kernel(layer_ref, pages_ref, meta_ref, q_ref, k_ref, v_ref, *refs):
        o_ref, lse_ref = (refs[0], refs[1]) if c.with_stats else (refs[0], None)
        if fp8:  # pages land in k_raw / v_raw and are widened into k_smem / v_smem
            *refs, k_raw, v_raw = refs
        q_smem, k_smem, v_smem, p_smem, o_smem, lse_smem, q_bar, k_bar, v_bar = refs[-9:]
        k_dst, v_dst = (k_raw, v_raw) if fp8 else (k_smem, v_smem)
        h, b = lax.axis_index("kv_head"), lax.axis_index("block")
        seq, first, n, t_lo, t_hi = (meta_ref[b, i] for i in range(META_FIELDS))
        layer = layer_ref[0]
        plgpu.copy_gmem_to_smem(q_ref.at[h, b], q_smem, q_bar)

        def fetch(t, slot):
            for j in range(c.tile_pages):
                page = pages_ref[seq, jnp.minimum(t * c.tile_pages + j, c.pages_per_seq - 1)]
                dst = pl.ds(j * c.page_size, c.page_size)
                plgpu.copy_gmem_to_smem(k_ref.at[layer, page, :, h, :], k_dst.at[slot, dst],
                                        k_bar.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[layer, page, :, h, :], v_dst.at[slot, dst],
                                        v_bar.at[slot])

        for i in range(2):
            pl.when(t_lo + i < t_hi)(lambda i=i: fetch(t_lo + i, i))
        plgpu.barrier_wait(q_bar)
        row = layout(lax.broadcasted_iota(jnp.int32, (rows, tile), 0), wgmma_rows)
        col = layout(lax.broadcasted_iota(jnp.int32, (rows, tile), 1), wgmma_rows)

        def body(t, carry):
            acc, m, l = carry
            slot = lax.rem(t - t_lo, 2)
            plgpu.barrier_wait(k_bar.at[slot])
            if fp8:
                k_smem[slot] = widen_tile(k_raw.at[slot])
                plgpu.commit_smem()
            if simulated:
                s = lax.dot_general(q_smem[...], k_smem[slot], (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32)
            else:
                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                    return acc_ref[...]
                s = pl.run_scoped(qk, plgpu.ACC((rows, tile), jnp.float32))
            mask = visible(c, row, t * tile + col, first, n)
            s = jnp.where(mask, scores(c, s), NEG_INF)
            m_new = jnp.maximum(m, s.max(axis=1))
            p = jnp.where(mask, jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)
            alpha = jnp.exp(m - m_new)
            p_smem[...] = p.astype(dtype)
            plgpu.commit_smem()
            plgpu.barrier_wait(v_bar.at[slot])
            if fp8:
                v_smem[slot] = widen_tile(v_raw.at[slot])
                plgpu.commit_smem()

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
                return acc_ref[...]
            pv_out = pl.run_scoped(pv, plgpu.ACC((rows, head_dim), jnp.float32))
            pl.when(t + 2 < t_hi)(lambda: fetch(t + 2, slot))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv_out
            return acc, m_new, l * alpha + p.sum(axis=1)

        init = (layout(jnp.zeros((rows, head_dim), jnp.float32), wgmma_rows),
                layout(jnp.full((rows,), NEG_INF, jnp.float32), reduced_rows),
                layout(jnp.zeros((rows,), jnp.float32), reduced_rows))
        acc, m, l = lax.fori_loop(t_lo, t_hi, body, init)
        l_safe = jnp.where(l > 0, l, 1.0)
        o_smem[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(out_dtype)
        if lse_ref is not None:
            lse_smem[...] = jnp.where(l > 0, m + jnp.log(l_safe), NEG_INF)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[h, b])
        if lse_ref is not None:
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[h, b])
        plgpu.wait_smem_to_gmem(0)

    out_type = [jax.ShapeDtypeStruct(q_blocks.shape, out_dtype)]
    if c.with_stats:
        out_type.append(jax.ShapeDtypeStruct((num_kv_heads, num_blocks, rows), jnp.float32))
    scratch = [smem((rows, head_dim), dtype), smem((2, tile, head_dim), dtype),
               smem((2, tile, head_dim), dtype), smem((rows, tile), dtype),
               smem((rows, head_dim), out_dtype), plgpu.SMEM((rows,), jnp.float32),
               plgpu.Barrier(), plgpu.Barrier(num_arrivals=c.tile_pages, num_barriers=2),
               plgpu.Barrier(num_arrivals=c.tile_pages, num_barriers=2)]
    if fp8:
        scratch += [smem((2, tile, head_dim), k_pages.dtype) for _ in range(2)]
    outs = plgpu.kernel(
        kernel, out_type=out_type, scratch_types=scratch, grid=(num_kv_heads, num_blocks),
        grid_names=("kv_head", "block"), **({"interpret": interpret} if simulated else {}),
    )(layer, page_table, meta, q_blocks, k_pages, v_pages)
    return outs[0], (outs[1] if c.with_stats else None)
