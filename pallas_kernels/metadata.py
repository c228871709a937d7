"""Block metadata for the Pallas paged-attention kernels, computed once per step.

A step's layers all attend over the same ragged batch, so the blocks each kernel program works
on (request, first position, tokens, KV tile range) and the maps between token rows and blocks
depend only on the step's metadata, the kernel's block sizes and the sliding window: not on the
layer. The engine's attention backend computes them here once per step (per distinct window)
and every layer's kernel call reads them. Pure jnp over small int32 arrays: no Pallas, no cache
reads.

The decode split: requests 0..first_seq-1 are one-row decodes that the decode kernel takes, so
the ragged blocks cover only requests first_seq..num_seqs-1 (rows of the others come back
invalid), and the decode metadata covers only requests below first_seq.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp


class RaggedBlocks(NamedTuple):
    meta: jnp.ndarray         # [NB, 5] i32 request, first position, tokens, first tile, end tile
    token_index: jnp.ndarray  # [NB, tokens] i32 query row of each block slot (clamped)
    block_of_row: jnp.ndarray  # [T] i32 block holding each row
    slot_of_row: jnp.ndarray  # [T] i32 the row's index within its block
    valid: jnp.ndarray        # [T] bool rows this ragged call computes (others come back zero)


def num_ragged_blocks(num_tokens: int, num_seqs_max: int, tokens: int) -> int:
    return max(1, min(num_tokens, -(-num_tokens // tokens) + num_seqs_max))


def ragged_blocks(cu_q_lens, kv_lens, num_seqs, num_tokens: int, *, tokens: int, tile: int,
                  sliding_window: int | None, first_seq=0) -> RaggedBlocks:
    """Request s (first_seq <= s < num_seqs) gets ceil(q_len / tokens) consecutive blocks."""
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    kv_lens = kv_lens.astype(jnp.int32)
    num_seqs_max = kv_lens.shape[0]
    seq_range = jnp.arange(num_seqs_max)
    live = (seq_range < jnp.reshape(num_seqs, ())) & (seq_range >= jnp.reshape(first_seq, ()))
    q_lens = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    block_ends = jnp.cumsum(-(-q_lens // tokens))
    block_starts = block_ends - -(-q_lens // tokens)
    num_blocks = num_ragged_blocks(num_tokens, num_seqs_max, tokens)
    blocks = jnp.arange(num_blocks, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(block_ends, blocks, side="right"), num_seqs_max - 1)
    start = (blocks - block_starts[seq]) * tokens
    n = jnp.where(blocks < block_ends[-1], jnp.clip(q_lens[seq] - start, 0, tokens), 0)
    first = kv_lens[seq] - q_lens[seq] + start
    lo = (jnp.zeros_like(first) if sliding_window is None
          else jnp.maximum(first - sliding_window + 1, 0))
    t_lo = jnp.where(n > 0, lo // tile, 0)
    t_hi = jnp.where(n > 0, (first + n - 1) // tile + 1, 0)
    meta = jnp.stack([seq, first, n, t_lo, t_hi], axis=1).astype(jnp.int32)
    token_index = cu_q_lens[seq][:, None] + start[:, None] + jnp.arange(tokens)
    token_index = jnp.clip(token_index, 0, num_tokens - 1)

    # Token row t of request s sits in block block_starts[s] + local // tokens.
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    seq_t = jnp.minimum(jnp.searchsorted(cu_q_lens[1:], rows, side="right"), num_seqs_max - 1)
    local = rows - cu_q_lens[seq_t]
    block_of_row = jnp.minimum(block_starts[seq_t] + local // tokens, num_blocks - 1)
    valid = ((rows < cu_q_lens[jnp.reshape(num_seqs, ())])
             & (rows >= cu_q_lens[jnp.reshape(first_seq, ())]))
    return RaggedBlocks(meta, token_index.astype(jnp.int32), block_of_row.astype(jnp.int32),
                        (local % tokens).astype(jnp.int32), valid)


def kv_split_metadata(kv_lens, num_splits: int, tile: int, sliding_window: int | None):
    """Block metadata [S * num_splits, 5] for decode rows: split k of request s is block
    s * num_splits + k and covers its k-th run of the tiles the row can see."""
    kv_lens = kv_lens.astype(jnp.int32)
    num_seqs = kv_lens.shape[0]
    position = kv_lens - 1
    live = kv_lens > 0
    lo = (jnp.zeros_like(position) if sliding_window is None
          else jnp.maximum(position - sliding_window + 1, 0))
    first_tile = jnp.where(live, lo // tile, 0)
    end_tile = jnp.where(live, position // tile + 1, 0)
    per_split = -(-(end_tile - first_tile) // num_splits)                        # [S]
    t_lo = first_tile[:, None] + jnp.arange(num_splits) * per_split[:, None]    # [S, K]
    t_hi = jnp.minimum(t_lo + per_split[:, None], end_tile[:, None])
    t_lo = jnp.minimum(t_lo, t_hi)
    per_request = [jnp.arange(num_seqs), position, live.astype(jnp.int32)]
    fields = [jnp.broadcast_to(x[:, None], t_lo.shape) for x in per_request] + [t_lo, t_hi]
    return jnp.stack(fields, axis=-1).reshape(num_seqs * num_splits, -1).astype(jnp.int32)
