"""Whether the Hopper (Mosaic GPU) attention kernel can run a model's shapes, by formula.

The kernel (pallas_kernels/ragged_paged_attention.py, `_gpu_call`) has limits that depend on
the model, not the device: WGMMA operands of 16 bits (bfloat16 / float16; fp8 pages are widened
to the query's dtype), head_dim a multiple of 64, page_size a multiple of 8, KV tiles a multiple
of 64 positions (head_dim a multiple of 128 with fp8 pages, whose raw tiles are 128 bytes
wide), at most one block's 64 rows of query heads per KV head, and its shared memory:
`hopper_call_fit` adds up the kernel's scratch list the way Pallas' Mosaic GPU lowering
allocates it (each buffer rounded up to SMEM_ALIGNMENT, one reduction scratch for the row max /
sum, 8 bytes per mbarrier) against the 227 KiB a Hopper block may opt into. Split-KV decode makes
the kernel's output float32 (with_stats: each split reports its log-sum-exp for the merge), and
so do attention sinks, which is what pushes head_dim 256 past the limit.

`hopper_fit` picks, for the two calls a step makes (ragged; decode with N splits), the largest
number of splits up to the wanted one whose call fits (1 split drops the float32 output unless
sinks need it), or the XLA path when even that does not fit, with a reason for the start-up log.
The sliding window only changes the kernel's mask, never its buffers.

tests/test_kernel_fit.py holds the formula to the kernel: it lowers the kernel for `cuda` on the
CPU and asserts the lowering succeeds exactly where this module says it fits (and, where JAX
exposes it, that the bytes are the lowering's). This module must stay pure arithmetic: no jax
device use, no tracing, no compiling, no kernel import.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pallas_kernels import tuning

HOPPER_MAX_SMEM_BYTES = 232448  # 227 KiB: the opt-in shared memory of one sm_90 block
SMEM_ALIGNMENT = 1024           # Pallas Mosaic GPU rounds each scratch buffer up to this
REDUCTION_SCRATCH_BYTES = 2048  # plgpu.CompilerParams.reduction_scratch_bytes' default
MBARRIER_BYTES = 8
KERNEL_BARRIERS = 5             # the Q barrier, then two slots each for K and V


@dataclass(frozen=True)
class KernelShape:
    """What the kernel's limits depend on, per device under tensor parallelism."""

    head_dim: int
    group: int                 # query heads per KV head
    num_kv_heads: int          # KV heads on one device (only the grid, never a limit)
    q_dtype: str               # the query's (compute) dtype, e.g. "bfloat16"
    kv_dtype: str              # the pages' dtype, e.g. "bfloat16", "float8_e4m3fn"
    page_size: int
    sliding_window: bool = False
    sinks: bool = False


@dataclass(frozen=True)
class CallFit:
    """One kernel call's verdict: runs or not, its shared memory (None where another limit
    refuses it first) and the limit it breaks."""

    fits: bool
    smem_bytes: int | None
    reason: str


@dataclass(frozen=True)
class KernelChoice:
    """impl "pallas" with at most max_kv_splits decode splits, or "xla"; reason for the log."""

    impl: str
    max_kv_splits: int
    reason: str


def dtype_name(dtype) -> str:
    """"bfloat16" for "bfloat16", jnp.bfloat16 or a jnp.dtype alike."""
    return dtype if isinstance(dtype, str) else np.dtype(dtype).name


def _itemsize(dtype: str) -> int:
    return np.dtype(dtype).itemsize


def is_fp8(dtype: str) -> bool:
    return dtype_name(dtype).startswith("float8")


def _aligned(nbytes: int) -> int:
    return -(-nbytes // SMEM_ALIGNMENT) * SMEM_ALIGNMENT


def _tile(page_size: int, sizes: tuning.BlockSizes) -> int:
    return tuning.pages_per_tile(page_size, sizes) * page_size


def hopper_smem_bytes(shape: KernelShape, with_stats: bool,
                      sizes: tuning.BlockSizes | None = None) -> int:
    """Shared memory of one block of `_gpu_call`, from its scratch list:
    Q [rows, D], K and V [2, tile, D] each (two slots), P [rows, tile] in the operands' dtype;
    the output [rows, D] (float32 with stats, else the query's dtype); the lse [rows] float32;
    with fp8 pages, the raw K and V slots [2, tile, D] before widening; then the reduction
    scratch and the barriers."""
    sizes = sizes or tuning.block_sizes("gpu")
    rows, tile, d = sizes.gpu_rows, _tile(shape.page_size, sizes), shape.head_dim
    q_dt, kv_dt = dtype_name(shape.q_dtype), dtype_name(shape.kv_dtype)
    operand = _itemsize(q_dt if is_fp8(kv_dt) else kv_dt)
    out = 4 if with_stats else _itemsize(q_dt)
    buffers = [rows * d * operand, 2 * tile * d * operand, 2 * tile * d * operand,
               rows * tile * operand, rows * d * out, rows * 4]
    if is_fp8(kv_dt):
        buffers += [2 * tile * d * _itemsize(kv_dt)] * 2
    return (sum(_aligned(b) for b in buffers) + REDUCTION_SCRATCH_BYTES
            + KERNEL_BARRIERS * MBARRIER_BYTES)


def hopper_call_fit(shape: KernelShape, with_stats: bool,
                    sizes: tuning.BlockSizes | None = None) -> CallFit:
    """Whether one call of the Hopper kernel (float32 output with stats) lowers."""
    sizes = sizes or tuning.block_sizes("gpu")
    q_dt, kv_dt = dtype_name(shape.q_dtype), dtype_name(shape.kv_dtype)
    operand = q_dt if is_fp8(kv_dt) else kv_dt
    if _itemsize(operand) != 2:
        return CallFit(False, None, f"the Mosaic GPU kernel's WGMMA takes bfloat16/float16 "
                                    f"operands, not {operand}")
    tile = _tile(shape.page_size, sizes)
    if shape.head_dim % 64 or shape.page_size % 8 or tile % 64:
        return CallFit(False, None, f"the Mosaic GPU kernel needs head_dim % 64 == 0 (got "
                                    f"{shape.head_dim}), page_size % 8 == 0 (got "
                                    f"{shape.page_size}) and KV tiles of a multiple of 64 "
                                    f"positions (got {tile})")
    if is_fp8(kv_dt) and shape.head_dim % 128:
        # fp8 pages land in shared memory tiled (8, 128 // itemsize) = (8, 128) before
        # widening, so a row of the raw tile needs 128 elements per swizzle tile.
        return CallFit(False, None, f"fp8 pages in the Mosaic GPU kernel need head_dim % 128 == "
                                    f"0 (got {shape.head_dim}): the raw tile is 128 fp8 wide")
    if shape.group > sizes.gpu_rows:
        return CallFit(False, None, f"{shape.group} query heads per KV head exceed the kernel's "
                                    f"block of {sizes.gpu_rows} rows")
    smem = hopper_smem_bytes(shape, with_stats, sizes)
    if smem > HOPPER_MAX_SMEM_BYTES:
        why = " (its output is float32 for the split / sink stats)" if with_stats else ""
        return CallFit(False, smem, f"the Mosaic GPU kernel needs {smem} bytes of shared memory "
                                    f"per block{why}, over Hopper's {HOPPER_MAX_SMEM_BYTES}")
    return CallFit(True, smem, f"{smem} of {HOPPER_MAX_SMEM_BYTES} bytes of shared memory")


def decode_fit(shape: KernelShape, num_splits: int,
               sizes: tuning.BlockSizes | None = None) -> CallFit:
    """The decode call with `num_splits` KV splits: stats whenever it splits or has sinks."""
    return hopper_call_fit(shape, num_splits > 1 or shape.sinks, sizes)


def ragged_fit(shape: KernelShape, sizes: tuning.BlockSizes | None = None) -> CallFit:
    """The ragged call: stats only for sinks."""
    return hopper_call_fit(shape, shape.sinks, sizes)


def hopper_fit(shape: KernelShape, max_kv_splits: int | None = None) -> KernelChoice:
    """The Hopper kernel with the most decode splits (up to max_kv_splits, default the
    tuning table's) whose calls all fit, else the XLA path; with the reason."""
    sizes = tuning.block_sizes("gpu")
    wanted = max_kv_splits or sizes.max_kv_splits
    ragged = ragged_fit(shape, sizes)
    if not ragged.fits:
        return KernelChoice("xla", 1, f"the ragged call can't run: {ragged.reason}")
    for splits in range(wanted, 0, -1):
        decode = decode_fit(shape, splits, sizes)
        if decode.fits:
            if splits == wanted:
                return KernelChoice("pallas", splits, f"Hopper: the Mosaic GPU kernel, up to "
                                                      f"{splits} decode KV splits "
                                                      f"({decode.reason})")
            refused = decode_fit(shape, wanted, sizes).reason
            return KernelChoice("pallas", splits, f"Hopper: the Mosaic GPU kernel with "
                                                  f"{splits} decode KV split(s), not {wanted}: "
                                                  f"{refused}")
    return KernelChoice("xla", 1, f"the decode call can't run even unsplit: "
                                  f"{decode_fit(shape, 1, sizes).reason}")


def tpu_fit(shape: KernelShape) -> KernelChoice:
    """The TPU kernel's ragged and decode calls against pallas_kernels/tpu_rules.py (tiling,
    packing, VMEM), else the XLA path with the rule that refuses it. The page table's scalar
    memory depends on the buckets: start-up checks it (engine/device_memory.py)."""
    from pallas_kernels import tpu_rules

    sizes = tuning.block_sizes("tpu")
    tile_pages = tuning.pages_per_tile(shape.page_size, sizes)
    for call, tokens in (("ragged", tuning.tokens_per_block(shape.group, sizes.q_block_rows)),
                         ("decode", 1)):
        config = tpu_rules.TpuConfig(
            shape.head_dim, shape.num_kv_heads, np.dtype(shape.kv_dtype),
            np.dtype(shape.q_dtype), shape.page_size, tile_pages,
            tuning.block_rows(shape.group, tokens, sizes), with_stats=shape.sinks)
        problems = tpu_rules.check(config)
        if problems:
            return KernelChoice("xla", 1, f"the TPU kernel's {call} call can't run: "
                                          f"{'; '.join(problems)}")
    return KernelChoice("pallas", 1, "the Pallas TPU (Mosaic) kernels: whole-page copies, "
                                     "heads read by strided loads (tpu_rules.py)")
