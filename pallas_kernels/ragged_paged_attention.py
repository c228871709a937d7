"""Ragged paged attention in Pallas: the engine step's mixed decode/prefill batch in one call.

The kernels work on *blocks*: a block is up to `tokens` consecutive query tokens of one request
(a decode row, a slice of a prefill chunk, or speculative-verification rows) times the query
heads of one KV head, ordered head-major (row = g * tokens + j). Each program attends one
(KV head, block) pair to the tiles of its own request's pages, so a short decode row never pays
for a long prefill. Per block, a metadata row [request, first position, tokens, first tile,
end tile] (int32) says what to do; the KV tile range lets paged_attention.py reuse the kernels
for split-KV decode, with `with_stats` adding the log-sum-exp each split needs. Attention sinks
(gpt-oss: one extra softmax logit per query head, with no value) use the same statistics: with
sinks the kernels also report log-sum-exp and `sink_weight` scales their output, so neither
lowering's kernel body has a sink path of its own.

Two lowerings of the same algorithm (online softmax over KV tiles of whole pages, double-buffered
page copies, causal and sliding-window masks from positions, soft cap):
* Mosaic TPU: PrefetchScalarGridSpec puts the layer, page table (flattened) and metadata in
  SMEM, K/V stay in HBM and each page of one KV head ([page_size, D], a strided slice) is DMA'd
  into VMEM with make_async_copy; pages the block cannot see are skipped (their V rows are
  zeroed so stale VMEM never reaches the sum).
* Mosaic GPU (Hopper, plgpu.kernel): one warpgroup per program, pages copied by TMA into swizzled
  SMEM, Q·Kᵀ and P·V on WGMMA with 64-row blocks; bf16/f16 only, head_dim a multiple of 64,
  page_size a multiple of 8. A tile always copies all its pages (clamped to the page table), so
  K/V must be finite in every page the table names (true for a pool that starts zeroed and only
  ever stores real K/V). The deprecated Pallas Triton backend is not used.
fp8 pages (kv_cache_dtype fp8) are widened in the kernel: on TPU each tile to the query's dtype
in VMEM (P never rounds to fp8), on GPU from 8-bit shared memory into the tile WGMMA reads.
Interpret mode: `interpret=True` runs the TPU formulation in Pallas' generic interpreter (any
host); `pltpu.InterpretParams()` runs it in the TPU simulator; a Mosaic GPU `InterpretGPUParams`
runs the GPU formulation in the GPU simulator, where Q·Kᵀ is a plain dot because that simulator
lacks transposed WGMMA operands. This module must not hold engine state, allocate pages or
import the engine; it only reads the cache.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import metadata, tuning
from pallas_kernels.reference import check_sinks

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


def _visible(c: KernelConfig, row, kv_pos, first, n):
    """Mask of (query row, KV position) pairs that attend; rows are head-major in the block."""
    tok = row & (c.tokens - 1)
    pos = first + tok
    mask = (row < c.group * c.tokens) & (tok < n) & (kv_pos <= pos)
    if c.sliding_window is not None:
        mask &= kv_pos > pos - c.sliding_window
    return mask


def _is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def _widen(x, dtype):  # through float32: Hopper converts fp8 straight to f16 only
    return x.astype(jnp.float32).astype(dtype)


def _scores(c: KernelConfig, s):
    s = s * c.sm_scale
    return s if c.soft_cap is None else c.soft_cap * jnp.tanh(s / c.soft_cap)


def _tpu_kernel(layer_ref, pages_ref, meta_ref, q_ref, k_hbm, v_hbm, *refs, c: KernelConfig):
    o_ref, lse_ref = (refs[0], refs[1]) if c.with_stats else (refs[0], None)
    k_buf, v_buf, sems = refs[-3:]
    h, b = pl.program_id(0), pl.program_id(1)
    seq, first, n, t_lo, t_hi = (meta_ref[b * META_FIELDS + i] for i in range(META_FIELDS))
    layer = layer_ref[0]
    lo = jnp.int32(0) if c.sliding_window is None else jnp.maximum(first - c.sliding_window + 1, 0)
    # lax.div truncates, fine for these non-negative values; `//` would add a sign fix-up.
    lo_page, hi_page = lax.div(lo, c.page_size), lax.div(first + n - 1, c.page_size)

    def copies(t, slot):
        for j in range(c.tile_pages):
            index = t * c.tile_pages + j
            page = pages_ref[seq * c.pages_per_seq + jnp.minimum(index, c.pages_per_seq - 1)]
            dst = pl.ds(j * c.page_size, c.page_size)
            yield (index >= lo_page) & (index <= hi_page), [
                pltpu.make_async_copy(src.at[layer, page, :, h, :], buf.at[slot, dst],
                                      sems.at[i, slot])
                for i, (src, buf) in enumerate(((k_hbm, k_buf), (v_hbm, v_buf)))]

    def run(t, slot, action):
        for needed, descriptors in copies(t, slot):
            @pl.when(needed)
            def _():
                for d in descriptors:
                    getattr(d, action)()

    def start(t, slot):
        run(t, slot, "start")

    pl.when(t_lo < t_hi)(lambda: start(t_lo, 0))
    q = q_ref[...]                                                   # [rows, D]
    row = lax.broadcasted_iota(jnp.int32, (c.rows, 1), 0)
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

    def body(t, carry):
        m, l, acc = carry
        slot = lax.rem(t - t_lo, 2)
        pl.when(t + 1 < t_hi)(lambda: start(t + 1, 1 - slot))
        run(t, slot, "wait")
        kv_pos = t * c.tile + lax.broadcasted_iota(jnp.int32, (1, c.tile), 1)
        mask = _visible(c, row, kv_pos, first, n)                    # [rows, tile]
        s = lax.dot_general(q, k_buf[slot].astype(q.dtype), (((1,), (1,)), ((), ())),
                            precision=precision,
                            preferred_element_type=jnp.float32)
        s = jnp.where(mask, _scores(c, s), NEG_INF)
        m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
        p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m - m_new)
        kv_row = t * c.tile + lax.broadcasted_iota(jnp.int32, (c.tile, 1), 0)
        fetched = (kv_row >= lo_page * c.page_size) & (kv_row < (hi_page + 1) * c.page_size)
        v = v_buf[slot]                                              # [tile, D]
        if _is_fp8(v.dtype):  # fp8 pages: P·V in the query's dtype, never P in fp8
            v = v.astype(q.dtype)
        v = jnp.where(fetched, v, 0).astype(v.dtype)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             precision=precision, preferred_element_type=jnp.float32)
        return m_new, alpha * l + p.sum(axis=1, keepdims=True), alpha * acc + pv

    init = (jnp.full((c.rows, 1), NEG_INF, jnp.float32), jnp.zeros((c.rows, 1), jnp.float32),
            jnp.zeros(o_ref.shape, jnp.float32))
    m, l, acc = lax.fori_loop(t_lo, t_hi, body, init)
    l_safe = jnp.where(l > 0, l, 1.0)
    o_ref[...] = (acc / l_safe).astype(o_ref.dtype)
    if lse_ref is not None:
        lse_ref[...] = jnp.where(l > 0, m + jnp.log(l_safe), NEG_INF)


def _tpu_call(c, layer, page_table, meta, q_blocks, k_pages, v_pages, out_dtype, interpret):
    num_kv_heads, num_blocks, rows, head_dim = q_blocks.shape
    block = pl.BlockSpec((None, None, rows, head_dim), lambda h, b, *_: (h, b, 0, 0))
    out_specs, out_shape = [block], [jax.ShapeDtypeStruct(q_blocks.shape, out_dtype)]
    if c.with_stats:
        out_specs.append(pl.BlockSpec((None, None, rows, 1), lambda h, b, *_: (h, b, 0, 0)))
        out_shape.append(jax.ShapeDtypeStruct((num_kv_heads, num_blocks, rows, 1), jnp.float32))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=(num_kv_heads, num_blocks),
        in_specs=[block, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((2, c.tile, head_dim), k_pages.dtype),
                        pltpu.VMEM((2, c.tile, head_dim), v_pages.dtype),
                        pltpu.SemaphoreType.DMA((2, 2))])
    outs = pl.pallas_call(
        functools.partial(_tpu_kernel, c=c), grid_spec=grid_spec, out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret, name="ragged_paged_attention_tpu",
    )(layer, page_table.reshape(-1), meta.reshape(-1), q_blocks, k_pages, v_pages)
    return outs[0], (outs[1][..., 0] if c.with_stats else None)


def _gpu_call(c, layer, page_table, meta, q_blocks, k_pages, v_pages, out_dtype, interpret):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    num_kv_heads, num_blocks, rows, head_dim = q_blocks.shape
    fp8, tile = _is_fp8(k_pages.dtype), c.tile
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

    def widen(raw):
        """An fp8 tile [tile, D] in shared memory -> the operands' dtype, WGMMA-laid-out."""
        if simulated:
            return _widen(raw[...], dtype)
        return layout(_widen(plgpu.load(raw, (), layout=plgpu.Layout.WGMMA_UPCAST_2X), dtype),
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
                k_smem[slot] = widen(k_raw.at[slot])
                plgpu.commit_smem()
            if simulated:
                s = lax.dot_general(q_smem[...], k_smem[slot], (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32)
            else:
                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                    return acc_ref[...]
                s = pl.run_scoped(qk, plgpu.ACC((rows, tile), jnp.float32))
            mask = _visible(c, row, t * tile + col, first, n)
            s = jnp.where(mask, _scores(c, s), NEG_INF)
            m_new = jnp.maximum(m, s.max(axis=1))
            p = jnp.where(mask, jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)
            alpha = jnp.exp(m - m_new)
            p_smem[...] = p.astype(dtype)
            plgpu.commit_smem()
            plgpu.barrier_wait(v_bar.at[slot])
            if fp8:
                v_smem[slot] = widen(v_raw.at[slot])
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


def attend_blocks(c: KernelConfig, formulation, interpret, layer, page_table, meta, q_blocks,
                  k_pages, v_pages, out_dtype):
    """Run the kernel of `formulation` over blocks: o [Hkv, NB, rows, D], lse [Hkv, NB, rows]."""
    call = _gpu_call if formulation == "gpu" else _tpu_call
    layer = jnp.reshape(layer, (1,)).astype(jnp.int32)
    return call(c, layer, page_table.astype(jnp.int32), meta.astype(jnp.int32), q_blocks,
                k_pages, v_pages, out_dtype, interpret)


def sink_weight(lse, sinks):
    """The factor that adds attention sinks to outputs normalised without them.

    A sink is one more softmax term, of logit `sinks` and value zero: for an output o over
    terms of log-sum-exp lse, the output with the sink is o * e^lse / (e^lse + e^sink) =
    o * sigmoid(lse - sink) (0 where no term was visible: lse = NEG_INF). So the kernels stay
    as they are for both lowerings and only report lse (with_stats), and a split-KV decode
    adds its sink once, after merging its splits. lse, sinks: broadcastable float32."""
    return jax.nn.sigmoid(lse - sinks)


def gather_q_blocks(q, token_index, group: int, rows: int):
    """q [T, Hq, D] and token_index [NB, tokens] -> [Hkv, NB, rows, D], rows head-major."""
    num_blocks, tokens = token_index.shape
    head_dim = q.shape[-1]
    q5 = q.reshape(q.shape[0], -1, group, head_dim)[token_index]     # [NB, tokens, Hkv, G, D]
    blocks = q5.transpose(2, 0, 3, 1, 4).reshape(-1, num_blocks, group * tokens, head_dim)
    return jnp.pad(blocks, ((0, 0), (0, 0), (0, rows - group * tokens), (0, 0)))


def ragged_config(group: int, page_size: int, pages_per_seq: int, sizes, *, sm_scale: float,
                  soft_cap: float | None, sliding_window: int | None, q_block: int | None = None,
                  tile_pages: int | None = None) -> KernelConfig:
    """The ragged kernel's static configuration for these shapes (tuning.py's sizes)."""
    tokens = q_block or tuning.tokens_per_block(group, sizes.q_block_rows)
    if tokens & (tokens - 1):
        raise ValueError(f"q_block must be a power of two, got {tokens}")
    return KernelConfig(group, tokens, tuning.block_rows(group, tokens, sizes), page_size,
                        tile_pages or tuning.pages_per_tile(page_size, sizes), pages_per_seq,
                        sm_scale, soft_cap, sliding_window, with_stats=False)


def ragged_paged_attention(q, k_pages, v_pages, layer, kv_lens, page_table, cu_q_lens, num_seqs,
                           *, sm_scale: float, soft_cap: float | None = None,
                           sliding_window: int | None = None, sinks=None, interpret=False,
                           q_block: int | None = None, tile_pages: int | None = None):
    """Mixed prefill/decode attention over a ragged token batch (see reference.py).

    q: [T, Hq, D]; k_pages, v_pages: [L, N, page_size, Hkv, D]; layer: i32 scalar; kv_lens: [S];
    page_table: [S, P]; cu_q_lens: [S+1]; num_seqs: i32 scalar or [1]; sinks: None or [Hq]
    float32 attention sinks. Rows past cu_q_lens[num_seqs] come back zero. interpret: False
    (compiled for the default backend), True (generic Pallas interpreter), or a TPU / GPU
    interpret-params object. q_block (query tokens per block, a power of two) and tile_pages
    (pages per KV tile) override tuning.py. Returns [T, Hq, D]. The engine computes the block
    metadata once per step instead (metadata.ragged_blocks) and calls ragged_attend per layer.
    """
    formulation, sizes, interpret = tuning.plan(interpret)
    c = ragged_config(q.shape[1] // k_pages.shape[3], k_pages.shape[2], page_table.shape[1],
                      sizes, sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
                      q_block=q_block, tile_pages=tile_pages)
    blocks = metadata.ragged_blocks(cu_q_lens, kv_lens, num_seqs, q.shape[0], tokens=c.tokens,
                                    tile=c.tile, sliding_window=sliding_window)
    return ragged_attend(q, k_pages, v_pages, layer, page_table, blocks, sinks, c=c,
                         formulation=formulation, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("c", "formulation", "interpret"))
def ragged_attend(q, k_pages, v_pages, layer, page_table, blocks: metadata.RaggedBlocks,
                  sinks=None, *, c: KernelConfig, formulation: str, interpret):
    """One layer's ragged attention over precomputed blocks; rows not blocks.valid are zero.
    sinks: None, or [Hq] float32 (the kernel then also reports lse, and its float32 output
    is scaled by sink_weight before the one rounding to q's dtype)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[3]
    group, tokens = c.group, c.tokens
    num_blocks = blocks.meta.shape[0]
    q_blocks = gather_q_blocks(q, blocks.token_index, group, c.rows)
    if sinks is not None:
        check_sinks(sinks, num_heads)
        c = dataclasses.replace(c, with_stats=True)
    out, lse = attend_blocks(c, formulation, interpret, layer, page_table, blocks.meta,
                             q_blocks, k_pages, v_pages,
                             q.dtype if sinks is None else jnp.float32)
    out = out[:, :, :group * tokens].reshape(num_kv_heads, num_blocks, group, tokens, head_dim)
    out_t = out[:, blocks.block_of_row, :, blocks.slot_of_row]          # [T, Hkv, G, D]
    if sinks is not None:
        lse = lse[:, :, :group * tokens].reshape(num_kv_heads, num_blocks, group, tokens)
        lse_t = lse[:, blocks.block_of_row, :, blocks.slot_of_row]      # [T, Hkv, G]
        weight = sink_weight(lse_t, sinks.astype(jnp.float32).reshape(num_kv_heads, group))
        out_t = (out_t * weight[..., None]).astype(q.dtype)
    out_t = jnp.where(blocks.valid[:, None, None, None], out_t, 0)
    return out_t.reshape(num_tokens, num_heads, head_dim)
