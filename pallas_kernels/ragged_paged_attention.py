"""Ragged paged attention in Pallas: the engine step's mixed decode/prefill batch in one call.

The kernels work on *blocks*: a block is up to `tokens` consecutive query tokens of one request
(a decode row, a slice of a prefill chunk, or speculative-verification rows) times the query
heads of one KV head, ordered head-major (row = g * tokens + j), so a short decode row never
pays for a long prefill. Per block, a metadata row [request, first position, tokens, first
tile, end tile] (int32) says what to do; the KV tile range lets paged_attention.py reuse the
kernels for split-KV decode, with `with_stats` adding the log-sum-exp each split needs.
Attention sinks (gpt-oss: one extra softmax logit per query head, with no value) use the same
statistics: with sinks the kernels also report log-sum-exp and `sink_weight` scales their
output, so neither lowering's kernel body has a sink path of its own.

Two lowerings of the same algorithm (online softmax over KV tiles of whole pages, double-buffered
page copies, causal and sliding-window masks from positions, soft cap; kernel_config.py holds
what they share):
* Mosaic TPU (ragged_tpu.py): one program per block attends all KV heads; each DMA copies a
  whole page with all its heads, heads are read out of VMEM by strided loads that follow the
  TPU's tiling and packing rules (tpu_rules.py), and a call the rules refuse raises.
* Mosaic GPU (ragged_gpu.py, Hopper): one warpgroup per (KV head, block), pages by TMA into
  swizzled SMEM, WGMMA; bf16/f16 only.
Interpret mode: `interpret=True` runs the TPU formulation in Pallas' generic interpreter (any
host); `pltpu.InterpretParams()` runs it in the TPU simulator; a Mosaic GPU `InterpretGPUParams`
runs the GPU formulation in the GPU simulator. This module keeps the shared configuration and
entry points; it must not hold engine state, allocate pages or import the engine, and it only
reads the cache.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import metadata, tuning
from pallas_kernels.kernel_config import KernelConfig
from pallas_kernels.ragged_gpu import gpu_call
from pallas_kernels.ragged_tpu import tpu_call
from pallas_kernels.reference import check_sinks

__all__ = ["KernelConfig", "attend_blocks", "gather_q_blocks", "ragged_attend", "ragged_config",
           "ragged_paged_attention", "sink_weight"]


def attend_blocks(c: KernelConfig, formulation, interpret, layer, page_table, meta, q_blocks,
                  k_pages, v_pages, out_dtype):
    """Run the kernel of `formulation` over blocks: o [Hkv, NB, rows, D], lse [Hkv, NB, rows]."""
    call = gpu_call if formulation == "gpu" else tpu_call
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
