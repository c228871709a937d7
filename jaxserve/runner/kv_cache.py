"""DeviceKV: one paged KV cache on device, the pages of swapped-out requests in host memory, and
the prefix cache's host tier (runner/host_prefix_pool.py) when it has slots.

It applies a plan's swaps and host-tier copies (runner/swap.py does the copies: every read of
the device pages before any write into them) and holds the current arrays: a
compiled step donates them and puts its result back here, so every step that reads the same
cache (a plain step, a speculative verify step) shares one DeviceKV. No page accounting here
(that is the scheduler's PageManager and HostSwapSpace).
"""

from __future__ import annotations

from jaxserve.core.plan import StepPlan
from jaxserve.runner.buckets import powers_of_two
from jaxserve.runner.host_prefix_pool import HostPrefixPool
from jaxserve.runner.swap import HostPages, KVCache, KVSwapper


class DeviceKV:
    def __init__(self, arrays: KVCache, max_pages_per_request: int, host_prefix_slots: int = 0):
        self.arrays = arrays  # (K, V), each [layers, num_pages, page_size, kv_heads, head_dim]
        self.swapper = KVSwapper(powers_of_two(1, max_pages_per_request))
        self._host_pages: dict[str, HostPages] = {}
        self.prefix_pool = (HostPrefixPool(host_prefix_slots, arrays, self.swapper)
                            if host_prefix_slots else None)

    @property
    def num_host_swapped(self) -> int:
        return len(self._host_pages)

    def warmup(self) -> None:
        self.swapper.warmup(self.arrays)

    def release(self) -> None:
        """Delete the device pages, the swapped-out requests' host copies and the host tier's
        stores still in flight (sleep: the page manager forgets what they held)."""
        for array in self.arrays:
            array.delete()
        for pages in self._host_pages.values():
            pages.k.delete()
            pages.v.delete()
        self._host_pages.clear()
        if self.prefix_pool is not None:
            self.prefix_pool.discard_in_flight()

    def restore(self, arrays: KVCache) -> None:
        """A new pool in place of a released one (zeroed, same shapes, dtypes, shardings)."""
        self.arrays = arrays

    def apply_swaps(self, plan: StepPlan) -> None:
        """Before the plan's step runs: drop, copy out and copy back pages as it says."""
        for request_id in plan.dropped_swaps:
            self._host_pages.pop(request_id, None)
        for op in plan.swap_out:
            self._host_pages[op.request_id] = self.swapper.swap_out(self.arrays, op.page_ids)
        if plan.prefix_stores or plan.prefix_loads:
            self.arrays = self.prefix_pool.apply(self.arrays, plan.prefix_stores,
                                                 plan.prefix_loads)
        for op in plan.swap_in:
            self.arrays = self.swapper.swap_in(self.arrays, self._host_pages.pop(op.request_id),
                                               op.page_ids)
