"""Accounting of the bounded host memory that swapped-out KV pages occupy.

The scheduler asks `can_reserve` before choosing swap over recompute for a preempted request,
`reserve`s the pages when it swaps out and `release`s them when the request swaps back in or
ends. This module only counts bytes: it must not import jax or hold the host arrays (the runner's
KVSwapper does). Swap-outs are padded to a page bucket, so when the buckets are given a
reservation is rounded up to its bucket, which is what host memory really holds.
"""

from __future__ import annotations

import bisect
from typing import Sequence


def kv_bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                      dtype_bytes: int) -> int:
    """Bytes of one page of K plus V over all layers."""
    return 2 * num_layers * page_size * num_kv_heads * head_dim * dtype_bytes


class HostSwapSpace:
    def __init__(self, capacity_bytes: int, bytes_per_page: int,
                 page_buckets: Sequence[int] | None = None):
        if capacity_bytes < 0 or bytes_per_page <= 0:
            raise ValueError(f"need capacity_bytes >= 0 and bytes_per_page > 0, "
                             f"got {capacity_bytes} and {bytes_per_page}")
        self.capacity_bytes = capacity_bytes
        self.bytes_per_page = bytes_per_page
        self._buckets = sorted(set(page_buckets)) if page_buckets else None
        self._reserved_pages: dict[str, int] = {}  # request id -> pages held on host (bucketed)
        self._used_pages = 0

    @property
    def used_bytes(self) -> int:
        return self._used_pages * self.bytes_per_page

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    @property
    def num_requests(self) -> int:
        return len(self._reserved_pages)

    def host_pages_for(self, num_pages: int) -> int:
        """Pages of host memory a swap-out of num_pages occupies (rounded up to its bucket)."""
        if self._buckets is None:
            return num_pages
        i = bisect.bisect_left(self._buckets, num_pages)
        if i == len(self._buckets):
            raise ValueError(f"cannot swap {num_pages} pages: the largest page bucket is "
                             f"{self._buckets[-1]}")
        return self._buckets[i]

    def can_reserve(self, num_pages: int) -> bool:
        if self._buckets is not None and num_pages > self._buckets[-1]:
            return False
        return self.host_pages_for(num_pages) * self.bytes_per_page <= self.free_bytes

    def reserve(self, request_id: str, num_pages: int) -> bool:
        """Reserve host room for a request's pages; False, nothing changed, if it does not fit."""
        if request_id in self._reserved_pages:
            raise ValueError(f"request {request_id!r} already holds swap space")
        if not self.can_reserve(num_pages):
            return False
        host_pages = self.host_pages_for(num_pages)
        self._reserved_pages[request_id] = host_pages
        self._used_pages += host_pages
        return True

    def release(self, request_id: str) -> None:
        """Give back a request's host room; an unknown id is a no-op."""
        self._used_pages -= self._reserved_pages.pop(request_id, 0)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._reserved_pages
