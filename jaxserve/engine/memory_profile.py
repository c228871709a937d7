"""The KV pool's size from the device's memory: what gpu_memory_utilization of the card leaves
once the weights are on the device and one step of the largest bucket has its temporary memory.

vLLM profiles a forward pass before it sizes its KV cache; here XLA says it without running
anything: the largest bucket's executable's memory_analysis() gives its peak temporary bytes
(per device under a mesh), compiled against a two-page pool before the real pool exists
(runner: profile_step_memory). The pool then gets, on each device,

    min(fraction x card, bytes_limit) - bytes_in_use - that step's temporaries and outputs

card: the device's total memory (device_memory.card_bytes); bytes_limit: what XLA's allocator
holds (on a GPU a share of the card set by XLA_PYTHON_CLIENT_MEM_FRACTION; below fraction x
card it is a warning, or a ValueError when gpu_memory_utilization was given); bytes_in_use: the
weights and the runner's small state, read after they are placed. The pool is split evenly over
its devices, so the tightest device decides; pages are counted as the device lays them out
(device_memory.kv_page_bytes: tile-padded on a TPU). Only this process's devices are read
(local_devices); with several processes all take the smallest pool (agree_across_processes).
When that leaves less than one request of max_model_len needs, start-up is refused with a
ValueError naming the settings that change it (before anything serves).

Nothing else in a step grows with the pool, so the two-page profile is the step's whole
temporary memory at any pool size: the pool is donated and written in place (its update aliases
the argument), the attention reads pages through the page table [S, P], whose size follows
max_num_seqs and max_model_len, never num_pages. (The swap and host-tier programs, outside the
step, gather pages or write them into the donated pool: their sizes follow page-count buckets.)
tests/test_memory_plan.py checks it on the CPU (the same temporary bytes with 2 and 64 pages);
a GPU's or TPU's compile was not measured here.

`memory_stats(device)` is the one place device memory figures are read (tests replace it to
pretend a device of a given size). This module decides sizes only: it compiles nothing itself
and holds no arrays.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from jaxserve.engine import device_memory

log = logging.getLogger(__name__)
GIB = float(1 << 30)


def memory_stats(device) -> dict | None:
    """The device's memory figures (bytes_limit, bytes_in_use, ...); None where the backend
    reports none (the CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return stats if stats and "bytes_limit" in stats else None


def device_memory_bytes(device) -> int | None:
    """The card's total memory (device_memory.card_bytes: not XLA's allocator limit, which is a
    share of it), None where unknown: the per-device defaults' memory figure
    (model/device/defaults.py)."""
    stats = memory_stats(device)
    return None if stats is None else device_memory.card_bytes(device, stats)


def local_devices(devices, process_index: int) -> list:
    """The devices of `devices` this process owns: the only ones whose memory_stats() it may
    read (another host's devices answer only on their own host)."""
    return [d for d in devices if getattr(d, "process_index", process_index) == process_index]


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
    card_bytes: int          # the tightest device's total memory
    budget_bytes: int        # min(fraction x card_bytes, bytes_limit) of the tightest device
    bytes_limit: int         # XLA's allocator's limit on the tightest device
    bytes_in_use: int        # of the tightest device, weights placed
    step: StepMemory
    pool_bytes: int          # over all devices
    bytes_per_page: int      # over all devices, as the devices lay pages out

    def describe(self) -> str:
        capped = "" if self.budget_bytes >= int(self.fraction * self.card_bytes) else (
            f", capped at XLA's allocator limit {self.bytes_limit / GIB:.2f} GiB")
        return (f"KV pool from gpu_memory_utilization={self.fraction}: {self.fraction} x "
                f"{self.card_bytes / GIB:.2f} GiB (the device){capped} - "
                f"{self.bytes_in_use / GIB:.2f} GiB in use (weights) - "
                f"{self.step.reserve_bytes / GIB:.3f} GiB for one step of the largest bucket "
                f"(T, S)={self.step.shape} = {self.pool_bytes / GIB:.2f} GiB, "
                f"{self.num_pages} pages of {self.bytes_per_page} bytes")


def plan_pool(fraction: float, devices, step: StepMemory, bytes_per_page: int, page_size: int,
              max_model_len: int, *, num_devices: int | None = None,
              strict: bool = False) -> PoolPlan | None:
    """The pool for `fraction` of each device's total memory (device_memory.card_bytes), after
    the weights (already placed: bytes_in_use) and one step of the largest bucket.

    devices: this process's devices of the pool (local_devices); num_devices: all of them, over
    every process (default: len(devices)); the pool is split evenly, so the tightest local
    device decides. bytes_per_page: one page of every layer's K and V over all devices, as the
    devices lay it out (device_memory.kv_page_bytes). Where fraction x the card exceeds what
    XLA's allocator holds (bytes_limit), the budget is bytes_limit, with a warning, or a
    ValueError when `strict` (gpu_memory_utilization was given explicitly); both name
    XLA_PYTHON_CLIENT_MEM_FRACTION and gpu_memory_utilization. None where a device reports no
    memory figures. ValueError naming gpu_memory_utilization, max_num_batched_tokens and
    max_model_len when the pool could not hold one request of max_model_len."""
    devices = list(devices)
    num_devices = num_devices or len(devices)
    tightest, figures = None, None
    for device in devices:
        stats = memory_stats(device)
        if stats is None:
            return None
        card, limit = device_memory.card_bytes(device, stats), int(stats["bytes_limit"])
        budget = int(fraction * card)
        if budget > limit + (1 << 20):  # beyond rounding: the allocator holds less
            message = device_memory.short_allocator_message(fraction, card, limit, strict)
            if strict:
                raise ValueError(message)
            log.warning("%s", message)
            budget = limit
        free = budget - stats.get("bytes_in_use", 0) - step.reserve_bytes
        if tightest is None or free < tightest:
            tightest, figures = free, (card, budget, limit, stats.get("bytes_in_use", 0))
    card, budget, limit, in_use = figures
    pool_bytes = max(0, tightest) * num_devices
    num_pages = pool_bytes // bytes_per_page
    need_pages = -(-max_model_len // page_size) + 1  # one full-length request, page 0 reserved
    if num_pages < need_pages:
        raise ValueError(
            f"the model does not fit: gpu_memory_utilization={fraction} of "
            f"{card / GIB:.2f} GiB per device ({budget / GIB:.2f} GiB), less "
            f"{in_use / GIB:.2f} GiB in use (the weights) and {step.reserve_bytes / GIB:.3f} GiB "
            f"for one step of the largest bucket (T, S)={step.shape}, leaves "
            f"{max(0, tightest) / GIB:.3f} GiB for the KV pool: {num_pages} pages of "
            f"{bytes_per_page} bytes, fewer than the {need_pages} one request of "
            f"max_model_len={max_model_len} needs. Raise gpu_memory_utilization, lower "
            f"max_num_batched_tokens (a smaller largest bucket) or lower max_model_len")
    return PoolPlan(int(num_pages), fraction, int(card), int(budget), int(limit), int(in_use),
                    step, int(pool_bytes), int(bytes_per_page))


def agree_across_processes(num_pages: int) -> int:
    """Several JAX processes (multi-host) size their pools from their own devices: every
    process takes the smallest, so the page tables the leader broadcasts fit every pool."""
    import jax

    if jax.process_count() == 1:
        return num_pages
    import numpy as np
    from jax.experimental import multihost_utils

    return int(np.min(multihost_utils.process_allgather(np.int64(num_pages))))
