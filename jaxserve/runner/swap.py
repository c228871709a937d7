"""Device side of KV page swapping: pages to pinned host memory and back, and page copies.

The KV cache is a pair `(k_pages, v_pages)`, each `[layers, num_pages, page_size, kv_heads,
head_dim]`. Swap-out gathers a preempted request's pages on device (one jitted gather) and
`jax.device_put`s the result to the same sharding with memory_kind='pinned_host' (never
unpinned_host: pinned memory is what the DMA engines read without a staging copy). Swap-in puts
the host arrays back in device memory and scatters them into newly allocated pages, donating the
cache so XLA updates it in place. `copy_pages` does fork's copy-on-write copies.

Page counts are padded to a page bucket (padding reads and writes scratch page 0), and every
(function, bucket, cache shape) executable is compiled once ahead of time and kept in a dict; a
count over the largest bucket is an error, never a silent recompile. This module does no page
accounting (that is PageManager's and HostSwapSpace's job) and never blocks on device results.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, Sequence

import jax
import numpy as np

KVCache = tuple[jax.Array, jax.Array]  # each [layers, num_pages, page_size, kv_heads, head_dim]


@dataclass(frozen=True)
class HostPages:
    """Swapped-out pages of one request, in pinned host memory."""
    k: jax.Array  # [layers, bucket, page_size, kv_heads, head_dim], memory_kind pinned_host
    v: jax.Array  # [layers, bucket, page_size, kv_heads, head_dim], memory_kind pinned_host
    num_pages: int  # real pages; the rest of the bucket is padding copied from page 0

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def _gather(k_pages, v_pages, page_ids):  # page_ids [bucket]
    return k_pages[:, page_ids], v_pages[:, page_ids]  # [layers, bucket, page_size, heads, dim]


def _scatter(k_pages, v_pages, k_new, v_new, page_ids):  # k_new, v_new [layers, bucket, ...]
    return k_pages.at[:, page_ids].set(k_new), v_pages.at[:, page_ids].set(v_new)


def _copy(k_pages, v_pages, src_ids, dst_ids):  # src_ids, dst_ids [bucket]
    return (k_pages.at[:, dst_ids].set(k_pages[:, src_ids]),
            v_pages.at[:, dst_ids].set(v_pages[:, src_ids]))


class KVSwapper:
    def __init__(self, page_buckets: Sequence[int], device: jax.Device | None = None):
        buckets = sorted({int(b) for b in page_buckets})
        if not buckets or buckets[0] < 1:
            raise ValueError(f"page_buckets must be positive page counts, got {list(page_buckets)}")
        self.page_buckets = tuple(buckets)
        self.device = device if device is not None else jax.devices()[0]
        kinds = {m.kind for m in self.device.addressable_memories()}
        if "pinned_host" not in kinds:
            raise RuntimeError(f"{self.device} has no pinned_host memory (it has {sorted(kinds)}); "
                               "use recompute preemption instead of swap")
        self._executables: dict[tuple, jax.stages.Compiled] = {}
        self._num_compilations = 0

    @property
    def num_compilations(self) -> int:
        """Executables compiled by this swapper; constant after warmup for a fixed cache shape."""
        return self._num_compilations

    def bucket_for(self, num_pages: int) -> int:
        i = bisect.bisect_left(self.page_buckets, num_pages)
        if i == len(self.page_buckets):
            raise ValueError(f"cannot move {num_pages} pages at once: the largest page bucket "
                             f"is {self.page_buckets[-1]}")
        return self.page_buckets[i]

    def swap_out(self, kv: KVCache, page_ids: Sequence[int]) -> HostPages:
        """Gather page_ids on device and start their copy to pinned host memory."""
        bucket = self.bucket_for(len(page_ids))
        k_pages, v_pages = kv
        ids = _padded(page_ids, bucket)
        gather = self._executable("gather", _gather, (), bucket, kv, (k_pages, v_pages, ids))
        k_out, v_out = gather(k_pages, v_pages, ids)
        return HostPages(jax.device_put(k_out, k_out.sharding.with_memory_kind("pinned_host")),
                         jax.device_put(v_out, v_out.sharding.with_memory_kind("pinned_host")),
                         len(page_ids))

    def swap_in(self, kv: KVCache, host: HostPages, new_page_ids: Sequence[int]) -> KVCache:
        """Copy host pages back to the device into new_page_ids; kv is donated, use the result."""
        if len(new_page_ids) != host.num_pages:
            raise ValueError(f"swap_in got {len(new_page_ids)} page ids for {host.num_pages} "
                             "swapped-out pages")
        bucket = host.k.shape[1]
        if bucket not in self.page_buckets:
            raise ValueError(f"host pages padded to {bucket}, not one of {self.page_buckets}")
        k_pages, v_pages = kv
        k_new = jax.device_put(host.k, k_pages.sharding)
        v_new = jax.device_put(host.v, v_pages.sharding)
        ids = _padded(new_page_ids, bucket)
        scatter = self._executable("scatter", _scatter, (0, 1), bucket, kv,
                                   (k_pages, v_pages, k_new, v_new, ids))
        return scatter(k_pages, v_pages, k_new, v_new, ids)

    def copy_pages(self, kv: KVCache, pairs: Sequence[tuple[int, int]]) -> KVCache:
        """Copy page src to page dst for each (src, dst) pair; kv is donated, use the result."""
        if not pairs:
            return kv
        bucket = self.bucket_for(len(pairs))
        src_ids = _padded([src for src, _ in pairs], bucket)
        dst_ids = _padded([dst for _, dst in pairs], bucket)
        k_pages, v_pages = kv
        copy = self._executable("copy", _copy, (0, 1), bucket, kv,
                                (k_pages, v_pages, src_ids, dst_ids))
        return copy(k_pages, v_pages, src_ids, dst_ids)

    def warmup(self, kv: KVCache) -> None:
        """Compile gather, scatter and copy for every page bucket of this cache shape."""
        k_pages, v_pages = kv
        for bucket in self.page_buckets:
            ids = np.zeros(bucket, np.int32)
            self._executable("gather", _gather, (), bucket, kv, (k_pages, v_pages, ids))
            moved = [jax.ShapeDtypeStruct((x.shape[0], bucket, *x.shape[2:]), x.dtype,
                                          sharding=x.sharding) for x in kv]
            self._executable("scatter", _scatter, (0, 1), bucket, kv,
                             (k_pages, v_pages, *moved, ids))
            self._executable("copy", _copy, (0, 1), bucket, kv, (k_pages, v_pages, ids, ids))

    def _executable(self, name: str, fn: Callable, donate: tuple[int, ...], bucket: int,
                    kv: KVCache, args: tuple) -> jax.stages.Compiled:
        key = (name, bucket, *((x.shape, x.dtype, x.sharding) for x in kv))
        executable = self._executables.get(key)
        if executable is None:
            executable = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
            self._executables[key] = executable
            self._num_compilations += 1
        return executable


def _padded(page_ids: Sequence[int], bucket: int) -> np.ndarray:
    ids = np.zeros(bucket, np.int32)  # [bucket]; padding points at scratch page 0
    ids[:len(page_ids)] = page_ids
    return ids
