"""The page pool's plain values: PageStats (a snapshot for metrics) and the stable prefix hash.

No jax, no state: page_manager.py uses them and re-exports stable_page_hash.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Callable

from jaxserve.core.host_prefix_tier import HostTierStats

HashFn = Callable[[int | None, tuple[int, ...]], int]


def stable_page_hash(parent_key: int | None, token_ids: tuple[int, ...]) -> int:
    """64-bit blake2b of (parent key, token ids); stable across processes, unlike salted hash()."""
    h = hashlib.blake2b(digest_size=8)
    if parent_key is None:
        h.update(b"\x00")
    else:
        h.update(b"\x01" + (parent_key & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "little"))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest(), "little")


@dataclass(frozen=True)
class PageStats:
    num_pages: int  # allocatable pages (page 0 excluded)
    num_free: int  # allocatable now, evictable cached pages included
    num_used: int
    num_cached: int  # pages holding a prefix-cache key, in use or not
    usage: float  # num_used / num_pages
    prefix_query_tokens: int
    prefix_hit_tokens: int
    prefix_hit_rate: float
    host: HostTierStats | None = None  # the host tier's, when there is one
