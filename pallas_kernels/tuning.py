"""Block sizes for the Pallas paged-attention kernels, one table keyed by backend.

Every tunable number of both kernels lives in BLOCK_SIZES; the kernels ask `block_sizes()` and
derive pages per KV tile and query tokens per block from it. This module must not import the
kernels or touch device arrays: it is plain arithmetic on static shapes, so a different choice
here means a different compiled kernel, never a different answer.
"""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tunables of one backend.

    kv_tile_tokens: KV positions per tile (one online-softmax step); a tile is
        kv_tile_tokens // page_size whole pages. On GPU the tile is also the K dimension of the
        P·V WGMMA, so it must be a multiple of 64 (bf16 swizzle width).
    q_block_rows: query rows per block (rows = query tokens × query heads of one KV head).
    gpu_rows: fixed rows of a GPU block: the WGMMA M dimension (None on other backends).
    max_kv_splits: most KV splits of one decode request (flash-decoding); 1 = never split.
    target_programs: decode splits a request until kv_heads × requests × splits reaches this
        (enough programs to fill the chip).
    """

    kv_tile_tokens: int
    q_block_rows: int
    gpu_rows: int | None
    max_kv_splits: int
    target_programs: int


BLOCK_SIZES = {
    # TPU: 128-wide MXU; programs run in order on one TensorCore (ragged_tpu.py prefetches
    # across them), so decode never splits. Tiles of 128 tokens keep the double-buffered
    # whole-page K/V buffers within tpu_rules.VMEM_BUDGET for up to 16 KV heads of 256.
    "tpu": BlockSizes(kv_tile_tokens=128, q_block_rows=128, gpu_rows=None, max_kv_splits=1,
                      target_programs=1),
    # Hopper: one warpgroup per block of 64 rows; 132 SMs want a few hundred programs.
    "gpu": BlockSizes(kv_tile_tokens=64, q_block_rows=64, gpu_rows=64, max_kv_splits=16,
                      target_programs=2 * 132),
    # The XLA blocked path (xla_blocked.py): a tile is one gather and one einsum step of every
    # block at once, so tiles are longer than a kernel's and decode splits until the step's
    # blocks reach the GPU kernel's program count, shortening the tile loop. 64 query rows per
    # block: per KV position and KV head a tile step gathers K and V (2 x D x 2 bytes) and
    # writes scores and probabilities (rows x 6 bytes), comparable at 64-128 rows for head_dim
    # 128; fewer rows gather more, more rows pad more. Reasoned, not yet measured on a GPU.
    "xla": BlockSizes(kv_tile_tokens=128, q_block_rows=64, gpu_rows=None, max_kv_splits=16,
                      target_programs=2 * 132),
    # Interpret mode on the CPU: small blocks keep the simulated loops short.
    "cpu": BlockSizes(kv_tile_tokens=32, q_block_rows=32, gpu_rows=None, max_kv_splits=4,
                      target_programs=1),
}


def backend() -> str:
    """The backend the kernels compile for: "tpu", "gpu" or "cpu" (tests may patch this)."""
    name = jax.default_backend()
    return "gpu" if name in ("cuda", "rocm") else name


def block_sizes(backend_name: str | None = None) -> BlockSizes:
    """The row of BLOCK_SIZES for a backend (default: backend())."""
    return BLOCK_SIZES.get(backend_name or backend(), BLOCK_SIZES["cpu"])


def pages_per_tile(page_size: int, sizes: BlockSizes) -> int:
    """Whole pages per KV tile: at least one page, about kv_tile_tokens positions."""
    return max(1, sizes.kv_tile_tokens // page_size)


def tokens_per_block(group: int, rows: int) -> int:
    """Query tokens per block: the largest power of two with tokens × group ≤ rows.

    A power of two lets a kernel find a row's token as `row & (tokens - 1)` (rows are ordered
    head-major inside a block), with no vector integer division.
    """
    if group > rows:
        raise ValueError(f"{group} query heads per KV head exceed a block of {rows} rows")
    tokens = 1
    while tokens * 2 * group <= rows:
        tokens *= 2
    return tokens


def num_kv_splits(num_kv_heads: int, num_seqs: int, max_tiles: int, sizes: BlockSizes) -> int:
    """Decode KV splits per request so that enough programs run, bounded by the table."""
    programs = max(1, num_kv_heads * num_seqs)
    wanted = -(-sizes.target_programs // programs)
    return max(1, min(wanted, sizes.max_kv_splits, max_tiles))


def block_rows(group: int, tokens: int, sizes: BlockSizes) -> int:
    """Rows of a block: the WGMMA M on GPU, else group × tokens rounded up to 8 sublanes."""
    return sizes.gpu_rows or -(-(group * tokens) // 8) * 8


def plan(interpret, backend_name: str | None = None) -> tuple[str, BlockSizes, object]:
    """(kernel formulation, block sizes, pallas `interpret` argument) for an interpret setting.

    A Mosaic GPU InterpretGPUParams selects the GPU formulation in its simulator; any other
    truthy value (True, pltpu.InterpretParams) the TPU formulation in an interpreter; False
    the compiled kernel of `backend_name` (default: backend(); another one for a step lowered
    ahead of time for it).
    """
    if type(interpret).__name__ == "InterpretGPUParams":
        return "gpu", block_sizes("gpu"), interpret
    if interpret:
        return "tpu", block_sizes("cpu"), interpret
    name = backend_name or backend()
    if name not in ("tpu", "gpu"):
        raise ValueError(f"Pallas paged attention needs a TPU or GPU, not {name!r}: pass "
                         "interpret=True, or use pallas_kernels.reference")
    return name, block_sizes(name), None if name == "gpu" else False
