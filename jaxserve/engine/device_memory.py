"""A device's memory as the KV pool plan (memory_profile.py) counts it: the card's total, the
share of it XLA's allocator holds, a KV page's bytes as the device lays them out, and the TPU
kernels' scalar memory.

* GPU allocator. JAX's CUDA client gives XLA's allocator XLA_PYTHON_CLIENT_MEM_FRACTION (newer
  spelling XLA_CLIENT_MEM_FRACTION; JAX_DEFAULT_FRACTION, 0.75, when neither is set) of the
  card's total memory, read once when the backend starts, and preallocates it unless
  XLA_PYTHON_CLIENT_PREALLOCATE is false. memory_stats()["bytes_limit"] is that share
  (XLA sizes the allocator as total x fraction). gpu_memory_utilization is, as in vLLM, a share
  of the whole card, so where jaxserve starts the process (the CLI, the check scripts)
  `claim_device_memory` sets the allocator's fraction to it before the backend starts; where a
  caller started the backend (library use) the plan finds the card's total with `card_bytes`
  (bytes_limit over the fraction the environment names, or the device table's nominal size when
  that disagrees) and says when the allocator holds less than gpu_memory_utilization asks.
  A TPU reports its whole usable HBM as bytes_limit; the environment variables do not apply.
* TPU tile padding. A TPU pads the last two dimensions of every array to whole tiles
  (pallas_kernels/tpu_tiling.py); KV pages [L, N, page_size, Hkv, D] tile over (Hkv, D), so a
  page's bytes are `kv_page_bytes` of the padded shape there (head_dim 64: 2x; one KV head per
  device under tensor parallelism in bfloat16: 16x). The CPU and GPUs store pages unpadded.
* TPU scalar memory. The Pallas TPU kernels scalar-prefetch the step's whole page table
  [S, P] int32 (flattened), the layer index and the block metadata [blocks, 5] int32 into SMEM
  (TPU_SMEM_BYTES, 1 MiB up to v6e, as vLLM's TPU backend states); `check_tpu_scalar_memory`
  refuses settings whose largest bucket does not fit, before anything compiles.

Arithmetic on figures JAX reports and on shapes: this module must not import jax at module
level (the CLI calls claim_device_memory before any backend starts), compile or hold arrays.
"""

from __future__ import annotations

import logging
import math
import os
from typing import MutableMapping

import numpy as np

log = logging.getLogger(__name__)
GIB = float(1 << 30)

FRACTION_VAR = "XLA_PYTHON_CLIENT_MEM_FRACTION"
NEW_FRACTION_VAR = "XLA_CLIENT_MEM_FRACTION"     # JAX >= 0.10 reads either; both set is an error
PREALLOCATE_VAR = "XLA_PYTHON_CLIENT_PREALLOCATE"
ALLOCATOR_VAR = "XLA_PYTHON_CLIENT_ALLOCATOR"
JAX_DEFAULT_FRACTION = 0.75
TPU_SMEM_BYTES = 1 << 20
# a nominal size within these bounds of bytes_limit / fraction confirms the fraction read now is
# the one the backend started with (vendors' sizes are rounded, in GB or GiB)
_NOMINAL_BAND = (0.85, 1.05)


def claim_device_memory(fraction: float | None,
                        environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Before the JAX backend starts: give XLA's GPU allocator `fraction` of the card
    (gpu_memory_utilization; None: the pool is sized explicitly, JAX's defaults stay), and keep
    it preallocated. A variable the environment already sets is left as it is (the plan then
    reads what it gives). Returns the variables set."""
    if fraction is None:
        return {}
    chosen = {}
    if FRACTION_VAR not in environ and NEW_FRACTION_VAR not in environ:
        chosen[FRACTION_VAR] = repr(float(fraction))
    if PREALLOCATE_VAR not in environ:
        chosen[PREALLOCATE_VAR] = "true"
    environ.update(chosen)
    return chosen


def allocator_fraction(environ: MutableMapping[str, str] = os.environ) -> float | None:
    """The share of a GPU XLA's allocator was given, as the environment names it (JAX's 0.75
    when unset); None when the allocator is not sized by a fraction (the platform allocator)."""
    if environ.get(ALLOCATOR_VAR, "default").lower() == "platform":
        return None
    value = environ.get(NEW_FRACTION_VAR) or environ.get(FRACTION_VAR)
    return float(value) if value else JAX_DEFAULT_FRACTION


def fraction_source(environ: MutableMapping[str, str] = os.environ) -> str:
    """Where allocator_fraction's figure comes from, for messages."""
    for name in (NEW_FRACTION_VAR, FRACTION_VAR):
        if environ.get(name):
            return f"{name}={environ[name]}"
    return f"{FRACTION_VAR} unset: JAX's default {JAX_DEFAULT_FRACTION}"


def platform_of(device) -> str | None:
    """"cpu", "gpu" (cuda or rocm) or "tpu"; None for an object that is no device."""
    platform = getattr(device, "platform", None)
    return "gpu" if platform in ("cuda", "rocm", "gpu") else platform


def nominal_bytes(device) -> int | None:
    """The device table's nominal memory for the device's kind; None where the table has none
    or the kind alone does not decide the class (an A100 that does not name its size)."""
    from jaxserve.model.device import defaults as device_defaults
    from jaxserve.model.device.select import DeviceDescription

    kind = getattr(device, "device_kind", None)
    if kind is None or platform_of(device) is None:
        return None
    description = DeviceDescription(platform_of(device), kind)
    smallest, largest = (device_defaults.chip(description, size) for size in (0, 1 << 50))
    if smallest is not largest or smallest.memory_gib is None:
        return None
    return int(smallest.memory_gib * GIB)


def card_bytes(device, stats: dict, environ: MutableMapping[str, str] = os.environ) -> int:
    """The device's total memory, that gpu_memory_utilization is a share of. A GPU's
    bytes_limit is total x the allocator's fraction: total is bytes_limit over the fraction the
    environment names, unless the device table's nominal size for the kind disagrees (the
    environment changed since the backend started), then the nominal size. Elsewhere (TPU,
    devices of unknown platform) bytes_limit is the whole device."""
    limit = int(stats["bytes_limit"])
    if platform_of(device) != "gpu":
        return limit
    fraction, nominal = allocator_fraction(environ), nominal_bytes(device)
    derived = None if fraction is None else int(limit / fraction)
    if derived is None or (nominal is not None and not
                           _NOMINAL_BAND[0] * nominal <= derived <= _NOMINAL_BAND[1] * nominal):
        return nominal if nominal is not None else limit
    return derived


def short_allocator_message(fraction: float, card: int, limit: int, strict: bool,
                            environ: MutableMapping[str, str] = os.environ) -> str:
    """What to say when fraction x card exceeds what XLA's allocator holds (bytes_limit)."""
    most = math.floor(limit / card * 100) / 100
    head = (f"gpu_memory_utilization={fraction} of this {card / GIB:.2f} GiB device is "
            f"{fraction * card / GIB:.2f} GiB, but XLA's allocator holds {limit / GIB:.2f} GiB "
            f"({fraction_source(environ)}, read when the JAX backend started)")
    fix = (f"set {FRACTION_VAR}={fraction} in the environment before JAX starts its backend "
           f"(`jaxserve serve` does), or gpu_memory_utilization={most} or less")
    if strict:
        return f"{head}: {fix}"
    return (f"{head}; the KV pool is sized from the {limit / GIB:.2f} GiB it holds. To use "
            f"more, {fix}")


def kv_page_bytes(num_layers: int, page_size: int, kv_heads_per_device: int, head_dim: int,
                  dtype, platform: str | None, num_devices: int = 1) -> int:
    """Device bytes of one KV page of every layer's K and V over num_devices devices, each
    holding kv_heads_per_device heads: one layer's page on one device is
    [page_size, kv_heads_per_device, head_dim], tile-padded on a TPU."""
    shape = (page_size, kv_heads_per_device, head_dim)
    if platform == "tpu":
        from pallas_kernels import tpu_tiling

        one = tpu_tiling.padded_bytes(shape, dtype)
    else:
        one = math.prod(shape) * np.dtype(dtype).itemsize
    return 2 * num_layers * one * num_devices


def heads_per_device(num_kv_heads: int, num_devices: int) -> int:
    """KV heads on each device when the pool's head axis is split over num_devices (the mesh's
    KV sharding splits heads over every device)."""
    return num_kv_heads // num_devices if num_kv_heads % num_devices == 0 else num_kv_heads


def tpu_scalar_prefetch_bytes(shapes, pages_per_seq: int, tokens_per_block: int,
                              decode_splits: int = 1) -> tuple[int, tuple[int, int]]:
    """(most SMEM bytes one kernel call prefetches over the step buckets, that bucket (T, S)):
    the layer index, the page table [S, P] and the block metadata [blocks, 5], all int32; the
    ragged kernel's blocks (metadata.num_ragged_blocks) or the decode kernel's S x splits."""
    from pallas_kernels.metadata import num_ragged_blocks

    most, where = 0, None
    for num_tokens, num_seqs in shapes:
        blocks = max(num_ragged_blocks(num_tokens, num_seqs, tokens_per_block),
                     num_seqs * decode_splits)
        need = 4 * (1 + num_seqs * pages_per_seq + 5 * blocks)
        if need > most:
            most, where = need, (num_tokens, num_seqs)
    return most, where


def check_tpu_scalar_memory(shapes, pages_per_seq: int, page_size: int, max_model_len: int,
                            max_num_seqs: int, tokens_per_block: int,
                            decode_splits: int = 1) -> int:
    """The SMEM bytes the Pallas TPU kernels need at the largest bucket; a ValueError naming
    max_model_len and max_num_seqs when that exceeds TPU_SMEM_BYTES."""
    need, (num_tokens, num_seqs) = tpu_scalar_prefetch_bytes(shapes, pages_per_seq,
                                                             tokens_per_block, decode_splits)
    if need > TPU_SMEM_BYTES:
        table = 4 * num_seqs * pages_per_seq
        raise ValueError(
            f"the TPU attention kernels keep a step's page table in scalar memory (SMEM, "
            f"{TPU_SMEM_BYTES} bytes): with max_num_seqs={max_num_seqs} and max_model_len="
            f"{max_model_len} ({pages_per_seq} pages of {page_size} tokens per request) the "
            f"bucket (T, S)=({num_tokens}, {num_seqs}) needs a {num_seqs} x {pages_per_seq} "
            f"int32 page table ({table} bytes) plus {need - table} bytes of layer index and "
            f"block metadata, {need} bytes in all. Lower max_model_len or max_num_seqs so that "
            f"max_num_seqs x ceil(max_model_len / page_size) x 4 bytes stays well under "
            f"{TPU_SMEM_BYTES}, or raise page_size")
    return need
