"""The KV pool's size from the device's memory: what gpu_memory_utilization leaves once the
weights are on the device and one step of the largest bucket has its temporary memory.

vLLM profiles a forward pass before it sizes its KV cache; here XLA says it without running
anything: the largest bucket's executable's memory_analysis() gives its peak temporary bytes
(per device under a mesh), compiled before the pool exists (runner: profile_step_memory). The
pool then gets, on each device, fraction * bytes_limit - bytes_in_use (the weights and the
runner's small state, read after they are placed) - that step's temporaries; the pool is split
evenly over its devices, so the tightest device decides. When that leaves less than one
request of max_model_len needs, start-up is refused with a ValueError naming the settings that
change it (before anything serves).

`memory_stats(device)` is the one place device memory figures are read (tests replace it to
pretend a device of a given size). This module decides sizes only: it compiles nothing itself
and holds no arrays.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)
GIB = float(1 << 30)


def memory_stats(device) -> dict | None:
    """The device's memory figures (bytes_limit, bytes_in_use, ...); None where the backend
    reports none (the CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return stats if stats and "bytes_limit" in stats else None


def device_memory_bytes(device) -> int | None:
    """The device's usable memory (bytes_limit), None where unknown: the per-device defaults'
    memory figure (model/device_defaults.py)."""
    stats = memory_stats(device)
    return None if stats is None else int(stats["bytes_limit"])


@dataclass(frozen=True)
class StepMemory:
    """What one compiled step needs beside its arguments, per device (memory_analysis())."""
    shape: tuple[int, int]   # the bucket (T, S)
    temp_bytes: int          # peak temporaries
    output_bytes: int        # outputs not aliased to a donated argument (packed tokens, ...)

    @property
    def reserve_bytes(self) -> int:
        return self.temp_bytes + self.output_bytes

    @classmethod
    def of(cls, shape: tuple[int, int], compiled) -> "StepMemory":
        stats = compiled.memory_analysis()
        out = max(0, stats.output_size_in_bytes - stats.alias_size_in_bytes)
        return cls(tuple(shape), int(stats.temp_size_in_bytes), int(out))


@dataclass(frozen=True)
class PoolPlan:
    """The KV pool's bytes and how they were found (for the start-up log and the tests)."""
    num_pages: int
    fraction: float
    bytes_limit: int         # of the tightest device
    bytes_in_use: int        # of the tightest device, weights placed
    step: StepMemory
    pool_bytes: int          # over all devices

    def describe(self) -> str:
        return (f"KV pool from gpu_memory_utilization={self.fraction}: {self.fraction} x "
                f"{self.bytes_limit / GIB:.2f} GiB - {self.bytes_in_use / GIB:.2f} GiB in use "
                f"(weights) - {self.step.reserve_bytes / GIB:.3f} GiB for one step of the "
                f"largest bucket (T, S)={self.step.shape} = {self.pool_bytes / GIB:.2f} GiB, "
                f"{self.num_pages} pages")


def plan_pool(fraction: float, devices, step: StepMemory, bytes_per_page: int, page_size: int,
              max_model_len: int) -> PoolPlan | None:
    """The pool for `fraction` of each device's memory, after the weights (already placed:
    bytes_in_use) and one step of the largest bucket. bytes_per_page: one page of every layer's
    K and V over all devices. None where a device reports no memory figures. ValueError naming
    gpu_memory_utilization, max_num_batched_tokens and max_model_len when the pool could not
    hold one request of max_model_len."""
    devices = list(devices)
    tightest, figures = None, None
    for device in devices:
        stats = memory_stats(device)
        if stats is None:
            return None
        free = int(fraction * stats["bytes_limit"]) - stats.get("bytes_in_use", 0) \
            - step.reserve_bytes
        if tightest is None or free < tightest:
            tightest, figures = free, stats
    pool_bytes = max(0, tightest) * len(devices)
    num_pages = pool_bytes // bytes_per_page
    need_pages = -(-max_model_len // page_size) + 1  # one full-length request, page 0 reserved
    if num_pages < need_pages:
        in_use = figures.get("bytes_in_use", 0)
        raise ValueError(
            f"the model does not fit: gpu_memory_utilization={fraction} of "
            f"{figures['bytes_limit'] / GIB:.2f} GiB per device, less "
            f"{in_use / GIB:.2f} GiB in use (the weights) and {step.reserve_bytes / GIB:.3f} GiB "
            f"for one step of the largest bucket (T, S)={step.shape}, leaves "
            f"{max(0, tightest) / GIB:.3f} GiB for the KV pool: {num_pages} pages, fewer than "
            f"the {need_pages} one request of max_model_len={max_model_len} needs. Raise "
            f"gpu_memory_utilization, lower max_num_batched_tokens (a smaller largest bucket) "
            f"or lower max_model_len")
    return PoolPlan(int(num_pages), fraction, int(figures["bytes_limit"]),
                    int(figures.get("bytes_in_use", 0)), step, int(pool_bytes))


def agree_across_processes(num_pages: int) -> int:
    """Several JAX processes (multi-host) size their pools from their own devices: every
    process takes the smallest, so the page tables the leader broadcasts fit every pool."""
    import jax

    if jax.process_count() == 1:
        return num_pages
    import numpy as np
    from jax.experimental import multihost_utils

    return int(np.min(multihost_utils.process_allgather(np.int64(num_pages))))
