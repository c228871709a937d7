"""Which TPU kernel configurations follow the TPU's tiling, packing and memory rules, and why not.

ragged_tpu.py issues a fixed set of memory accesses for a configuration: whole-page DMAs of
K and V from the engine's [L, N, page_size, Hkv, D] pages into VMEM buffers [2, tile, Hkv, D],
a fold of a buffer to its 2-D view [tile * Hkv, D], a bitcast of a packed (bf16 / 8-bit) view
to 32-bit words, and strided sublane loads that pick one KV head's rows out of it. `accesses`
lists them for a configuration and `check` holds each against the rules below; the kernel
refuses a configuration `check` rejects (ValueError naming the limit), and the engine's
backend selection can ask `check(config)` (an empty list: the kernel runs).

The rules (tpu_tiling.py holds the tile arithmetic):
* DMA slices: the last two dimensions of an array are tiled ((8 * packing, 128)); a DMA may
  take a tiled dimension whole, or a slice that starts and ends on tile boundaries. Leading
  dimensions are free.
* Folds: viewing [..., R, S, D] as [..., R * S, D] moves no bytes only when the second-minor
  S carries no tile padding: S a multiple of its tile rows, or S a small dimension that XLA
  and Mosaic tile exactly (S a multiple of the packing with S / packing in 1, 2, 4, the
  rule of JAX's shipped kernel, get_min_heads_per_blk).
* Bitcasts of packed dtypes to 32-bit words need the second-minor to hold whole words.
* Strided VMEM loads step over whole 32-bit sublanes: the step must be a multiple of the
  dtype's packing. The kernel only strides over 32-bit views.
* VMEM: the kernel's buffers (double-buffered q / out blocks, K / V page buffers, widened
  copies, accumulators and the per-head temporaries) fit VMEM_BUDGET, the scoped limit the
  kernel requests; SMEM: the scalar-prefetched layer, page table and block metadata fit
  SMEM_BUDGET.
These are a model of the rules, checked here by arithmetic and by lowering to Mosaic on any
host; the Mosaic compiler in libtpu is the final judge (memref layouts, vector layouts and
VMEM allocation are decided there). Plain Python on shapes and dtypes: this module must not
import jax's TPU backend or touch arrays.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from pallas_kernels import tpu_tiling

# 32 MiB: twice v5e's 16 MiB scoped default, half of v7x's 64 MiB VMEM per core; the kernel
# asks for it explicitly (vmem_limit_bytes) so every chip from v5e on grants it.
VMEM_BUDGET = 32 * 2**20
SMEM_BUDGET = 2**20
WORD = np.dtype(np.uint32)
DYNAMIC = "dynamic"


@dataclasses.dataclass(frozen=True)
class TpuConfig:
    """What decides the TPU kernel's accesses: shapes per device, dtypes and block sizes."""

    head_dim: int
    num_kv_heads: int            # KV heads on this device
    kv_dtype: object
    q_dtype: object
    page_size: int
    tile_pages: int
    rows: int                    # query rows per block and KV head
    with_stats: bool = False     # float32 output and a log-sum-exp output
    num_blocks: int = 1          # blocks per call (SMEM metadata)
    page_table_entries: int = 1  # requests × pages per request (SMEM page table)

    @property
    def tile(self) -> int:
        return self.tile_pages * self.page_size


class Access(NamedTuple):
    """One memory access of the kernel. kind: dma | fold | bitcast | strided_load.
    index (dma): per dimension None (whole), an int (one element), (start, size) or DYNAMIC
    (an index known only at run time)."""

    kind: str
    what: str
    shape: tuple
    dtype: object
    index: tuple = ()
    step: int = 1


def _packing(dtype) -> int:
    return tpu_tiling.sublane_packing(dtype)


def exactly_tiled(rows: int, dtype) -> bool:
    """A second-minor dimension of `rows` that its tiling covers with no padding rows."""
    packing = _packing(dtype)
    if rows % packing:
        return False
    words = rows // packing
    return words in (1, 2, 4) or words % tpu_tiling.SUBLANES == 0


def head_access(c: TpuConfig) -> str:
    """How the kernel reads one KV head out of a page buffer [tile, Hkv, D].

    "fold": the buffer folds to [tile * Hkv, D] as it is (Hkv exactly tiled in the KV dtype);
    heads are strided loads of it (through 32-bit words for packed dtypes).
    "widen": Hkv sits inside one packed word (bf16 with 1 head, 8-bit with 1 or 2): the
    buffer is loaded whole, widened to float32 into a VMEM copy that does fold, and heads are
    strided loads of that copy."""
    return "fold" if exactly_tiled(c.num_kv_heads, c.kv_dtype) else "widen"


def accesses(c: TpuConfig) -> list[Access]:
    """Every DMA, fold, bitcast and strided load of a configuration (one per distinct shape)."""
    hkv, d, ps = c.num_kv_heads, c.head_dim, c.page_size
    out = []
    for name in ("K", "V"):
        out.append(Access("dma", f"{name} page read", (1, 1, ps, hkv, d), c.kv_dtype,
                          (0, 0, None, None, None)))
        for j in range(c.tile_pages):
            out.append(Access("dma", f"{name} page {j} of a tile written", (2, c.tile, hkv, d),
                              c.kv_dtype, (0, (j * ps, ps), None, None)))
    folded = (c.tile * hkv, d)
    if head_access(c) == "fold":
        out.append(Access("fold", "page buffer", (c.tile, hkv, d), c.kv_dtype))
        packing = _packing(c.kv_dtype)
        if packing > 1:
            out.append(Access("bitcast", "folded page buffer", folded, c.kv_dtype))
        if hkv > packing:
            words = WORD if packing > 1 else c.kv_dtype
            out.append(Access("strided_load", "one KV head", (c.tile * hkv // packing, d), words,
                              step=hkv // packing))
    else:
        out.append(Access("fold", "widened page buffer", (c.tile, hkv, d), np.float32))
        if hkv > 1:
            out.append(Access("strided_load", "one KV head", folded, np.float32, step=hkv))
    return out


def dma_problems(a: Access) -> list[str]:
    """A DMA may cut a tiled dimension only on tile boundaries."""
    tiled = a.shape[-2:]
    tiles = tpu_tiling.tile_shape(a.dtype)[-len(tiled):]
    problems = []
    for dim, index, tile in zip(tiled, a.index[-len(tiled):], tiles):
        if index is None:
            continue
        if index is DYNAMIC or index == DYNAMIC:
            problems.append(f"{a.what}: DMA index of a tiled dimension of {dim} is known only "
                            "at run time, so nothing keeps it on tile boundaries")
            continue
        start, size = (index, 1) if isinstance(index, int) else index
        if start == 0 and size == dim:
            continue
        end = start + size
        if start % tile or (end % tile and end != dim):
            problems.append(
                f"{a.what}: DMA slice [{start}:{end}] of a tiled dimension of {dim} "
                f"({np.dtype(a.dtype).name} tile of {tile}) is not whole tiles")
    return problems


def fold_problems(a: Access) -> list[str]:
    rows = a.shape[-2]
    if exactly_tiled(rows, a.dtype):
        return []
    return [f"{a.what}: folding {a.shape} to 2-D moves bytes: {rows} rows of "
            f"{np.dtype(a.dtype).name} are padded to a tile of "
            f"{tpu_tiling.tile_shape(a.dtype)[0]}"]


def bitcast_problems(a: Access) -> list[str]:
    rows, packing = a.shape[-2], _packing(a.dtype)
    if rows % (tpu_tiling.SUBLANES * packing) == 0 or exactly_tiled(rows, a.dtype):
        return []
    return [f"{a.what}: {rows} rows of {np.dtype(a.dtype).name} are not whole 32-bit tiles "
            f"to bitcast"]


def strided_load_problems(a: Access) -> list[str]:
    packing = _packing(a.dtype)
    if a.step % packing == 0:
        return []
    return [f"{a.what}: strided load of step {a.step} on {np.dtype(a.dtype).name} splits "
            f"{packing}-row packed sublanes (step must be a multiple of {packing})"]


RULES = {"dma": dma_problems, "fold": fold_problems, "bitcast": bitcast_problems,
         "strided_load": strided_load_problems}


def vmem_bytes(c: TpuConfig) -> int:
    """VMEM the kernel needs, tile padding included (tpu_tiling's full tiles: an upper bound)."""
    hkv, d, rows, tile = c.num_kv_heads, c.head_dim, c.rows, c.tile
    out_dtype = np.float32 if c.with_stats else c.q_dtype
    b = tpu_tiling.padded_bytes
    total = 2 * b((hkv, rows, d), c.q_dtype) + 2 * b((hkv, rows, d), out_dtype)
    if c.with_stats:
        total += 2 * b((hkv, rows, 1), np.float32)
    total += 2 * b((2, tile, hkv, d), c.kv_dtype)                     # K and V page buffers
    if head_access(c) == "widen":
        total += 2 * b((tile, hkv, d), np.float32)
    total += 2 * b((hkv, rows, 128), np.float32) + b((hkv, rows, d), np.float32)  # m, l, acc
    # One head at a time: scores and probabilities [rows, tile], K and V rows [tile, D].
    total += 2 * b((rows, tile), np.float32) + 2 * b((tile, d), np.float32)
    return total


def smem_bytes(c: TpuConfig) -> int:
    """Scalar prefetch: layer, page table, metadata [NB, 5] and first buffer slot [NB]."""
    return 4 * (1 + c.page_table_entries + 6 * c.num_blocks)


def check(c: TpuConfig) -> list[str]:
    """Why the TPU kernel cannot run this configuration; empty when every rule holds."""
    problems = []
    if not 1 <= c.num_kv_heads:
        problems.append(f"num_kv_heads must be positive, got {c.num_kv_heads}")
        return problems
    if head_access(c) == "widen" and not exactly_tiled(c.num_kv_heads, np.float32):
        problems.append(
            f"{c.num_kv_heads} KV heads per device: neither {np.dtype(c.kv_dtype).name} nor "
            "float32 tiles them exactly (1, 2, 4 or a multiple of 8 heads, times the packing)")
    for a in accesses(c):
        problems += RULES[a.kind](a)
    if (used := vmem_bytes(c)) > VMEM_BUDGET:
        problems.append(f"VMEM: the kernel needs {used / 2**20:.1f} MiB, over the "
                        f"{VMEM_BUDGET / 2**20:.0f} MiB budget")
    if (used := smem_bytes(c)) > SMEM_BUDGET:
        problems.append(f"SMEM: page table and metadata take {used / 2**10:.0f} KiB, over the "
                        f"{SMEM_BUDGET / 2**10:.0f} KiB of scalar memory")
    return list(dict.fromkeys(problems))
