"""HostPrefixPool: the KV of the prefix cache's host tier, and its copies to and from the device.

The pool is two host numpy arrays (K and V), each `[layers, num_slots, page_size, kv_heads,
head_dim]`; slot numbers are the ones host_prefix_tier.py hands out. A step's copies come from
the PageManager (`take_prefix_ops`) through the plan, and run before the step, in this order:

1. stores still in flight from earlier steps land in the pool (only those already on the host,
   unless a load needs their slots: a load never reads a slot before its store landed);
2. loads read their slots from the pool, at once (a host copy), so a store made later into a
   slot freed by this step's load cannot change what the load moves;
3. stores gather their device pages (one jitted gather per page bucket, KVSwapper) and start the
   copy to pinned host memory where the device has it; it lands in the pool in a later step, so
   the engine's thread never waits on it;
4. loads put their pages on the device and scatter them into the fresh pages (KV donated).

Stores read before loads write because a load's fresh page may be a page evicted (and stored)
in the same step. Page counts over the largest page bucket are split, so nothing compiles after
warm-up. No accounting here (host_prefix_tier.py, page_manager.py); never decides what moves.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import numpy as np

from jaxserve.runner.swap import HostPages, KVCache, KVSwapper


class HostPrefixPool:
    def __init__(self, num_slots: int, kv: KVCache, swapper: KVSwapper):
        k, v = kv
        self.num_slots = num_slots
        # np.empty: the OS commits host memory as slots are first written, not up front.
        self.k = np.empty((k.shape[0], num_slots, *k.shape[2:]), k.dtype)
        self.v = np.empty((v.shape[0], num_slots, *v.shape[2:]), v.dtype)
        self.swapper = swapper
        self._in_flight: deque[tuple[np.ndarray, HostPages]] = deque()  # (slots, copies), in order

    def apply(self, kv: KVCache, stores: Sequence[tuple[int, int]],
              loads: Sequence[tuple[int, int]]) -> KVCache:
        """stores [(device page, slot)], loads [(slot, device page)]; kv is donated when there
        are loads: use the result."""
        self._land(all_of_them=bool(loads))
        read = [(self._read(group), group) for group in self._groups(loads)]
        for group in self._groups(stores):
            pages = [page for page, _ in group]
            slots = np.fromiter((slot for _, slot in group), np.int64, len(group))
            self._in_flight.append((slots, self.swapper.swap_out(kv, pages)))
        for host_pages, group in read:
            kv = self.swapper.swap_in(kv, host_pages, [page for _, page in group])
        return kv

    def discard_in_flight(self) -> None:
        """Forget stores not landed yet (their device copies are being deleted)."""
        self._in_flight.clear()

    def _land(self, all_of_them: bool) -> None:
        while self._in_flight:
            slots, host = self._in_flight[0]
            if not all_of_them and not (host.k.is_ready() and host.v.is_ready()):
                return  # in order: a later store to the same slot must land after this one
            self._in_flight.popleft()
            n = host.num_pages
            self.k[:, slots] = np.asarray(host.k)[:, :n]
            self.v[:, slots] = np.asarray(host.v)[:, :n]

    def _read(self, group: Sequence[tuple[int, int]]) -> HostPages:
        bucket = self.swapper.bucket_for(len(group))
        slots = np.zeros(bucket, np.int64)  # padding rows read slot 0 and scatter to page 0
        slots[:len(group)] = [slot for slot, _ in group]
        return HostPages(self.k[:, slots], self.v[:, slots], len(group))

    def _groups(self, pairs: Sequence[tuple[int, int]]) -> list[Sequence[tuple[int, int]]]:
        largest = self.swapper.page_buckets[-1]
        return [pairs[i:i + largest] for i in range(0, len(pairs), largest)]
