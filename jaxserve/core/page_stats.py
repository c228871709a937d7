"""The page pool's plain values: PageStats (a snapshot for metrics), a request's pages
(RequestPages), the stable prefix hash and each LoRA adapter's prefix root.

No jax, no logic beyond a hash: page_manager.py uses them and re-exports stable_page_hash.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Callable

from jaxserve.core.host_prefix_tier import HostTierStats

HashFn = Callable[[int | None, tuple[int, ...]], int]
_ROOT_SERIAL = 0  # parent serial of a prefix's first page; registrations count from 1
NULL_PAGE = 0  # scratch page: what padding writes to, and the stand-in for released pages


@dataclass(slots=True)
class RequestPages:
    """The pages one request holds, and where its prefix-cache chain stands."""
    pages: tuple[int, ...]  # replaced when they change: a chunk holds it as is, no copy
    num_slots: int
    num_hashed_pages: int = 0  # leading full pages already registered (or found cached)
    parent_key: int | None = None  # key of page num_hashed_pages - 1
    parent_serial: int = _ROOT_SERIAL  # its registration serial
    can_register: bool = True  # False after a hash collision or a prefix-cache reset
    num_released_pages: int = 0  # leading pages given back by release_window (NULL_PAGE now)
    root_key: int | None = None  # its chain's root (prefix_root of its LoRA adapter)
    root_serial: int = _ROOT_SERIAL


def prefix_root(hash_fn: HashFn, lora_id: int) -> tuple[int | None, int]:
    """(parent key, parent serial) of a prefix's first page under LoRA adapter lora_id: the
    base model's (None, 0), else a key hashed from the adapter id and the serial -lora_id,
    which no registration has (they count from 1), so a first page matches only a request of
    the same adapter even when keys collide."""
    if lora_id == 0:
        return None, _ROOT_SERIAL
    return hash_fn(None, (-1, lora_id)), -lora_id


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
