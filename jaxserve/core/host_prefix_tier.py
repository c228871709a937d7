"""Bookkeeping of the host tier of the prefix cache: which evicted prefix pages sit in which
host slot, in LRU order, within a bounded number of slots.

When the PageManager evicts a cached full page from the device pool, it `put`s the page's
identity here (its chain key, token ids, registration serial and parent serial, unchanged) and
the runner copies the page's KV to host slot `slot`. A later lookup that misses on the device
finds the page here by the same key and checks the same token ids and parent serial, so a
hash collision can never return another prefix's KV; `take` then moves the entry back to the
device side (the runner copies the slot into a fresh device page). An entry lives in one tier
at a time; a full tier drops its least recently stored entry to make room.

Only integers and token tuples: this module must not import jax or hold KV (the runner's
HostPrefixPool does, runner/host_prefix_pool.py). Its byte budget follows the swap space's
rules (swap_space.py): bytes over `kv_bytes_per_page`, rounded down to whole pages. With a
KVEventLog in `events` (set by the PageManager), each store and drop is logged as medium "CPU".
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from jaxserve.core.kv_events import MEDIUM_HOST


@dataclass(slots=True)
class HostEntry:
    slot: int                  # row of the runner's host pool holding this page's KV
    tokens: tuple[int, ...]    # the page's token ids (checked at every hit)
    serial: int                # registration serial, kept from the device registration
    parent_serial: int         # serial of the previous page of its prefix (0: the root)


@dataclass(frozen=True)
class HostTierStats:
    num_slots: int             # capacity in pages
    num_used: int              # pages held now
    hit_tokens: int            # prompt tokens found here (and copied back) at admission
    stored_pages: int          # pages copied device -> host since start
    loaded_pages: int          # pages copied host -> device since start
    bytes_per_page: int

    @property
    def bytes_to_host(self) -> int:
        return self.stored_pages * self.bytes_per_page

    @property
    def bytes_to_device(self) -> int:
        return self.loaded_pages * self.bytes_per_page


class HostPrefixTier:
    def __init__(self, capacity_bytes: int, bytes_per_page: int):
        if capacity_bytes < 0 or bytes_per_page <= 0:
            raise ValueError(f"need capacity_bytes >= 0 and bytes_per_page > 0, got "
                             f"{capacity_bytes} and {bytes_per_page}")
        self.bytes_per_page = bytes_per_page
        self.num_slots = capacity_bytes // bytes_per_page
        self._entries: OrderedDict[int, HostEntry] = OrderedDict()  # key -> entry, LRU first
        self._serials: set[int] = set()
        self._free_slots = list(range(self.num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self.hit_tokens = 0
        self.stored_pages = 0
        self.loaded_pages = 0
        self.events = None  # a KVEventLog (kv_events.py), or None

    @property
    def num_used(self) -> int:
        return len(self._entries)

    def get(self, key: int) -> HostEntry | None:
        return self._entries.get(key)

    def holds_serial(self, serial: int) -> bool:
        """Whether a page registered under this serial is alive here (its children reachable)."""
        return serial in self._serials

    def put(self, key: int, tokens: tuple[int, ...], serial: int, parent_serial: int) -> int | None:
        """Store an evicted page's identity; returns the host slot its KV goes to, or None when
        the tier has no slots. An entry already under key (a stale duplicate) is replaced; a full
        tier drops its least recently stored entry first."""
        if self.num_slots == 0:
            return None
        if key in self._entries:
            self._drop(key)
        elif not self._free_slots:
            self._drop(next(iter(self._entries)))
        entry = HostEntry(self._free_slots.pop(), tokens, serial, parent_serial)
        self._entries[key] = entry
        self._serials.add(serial)
        self.stored_pages += 1
        if self.events is not None:
            self.events.copied(key, tokens, MEDIUM_HOST)
        return entry.slot

    def take(self, key: int) -> HostEntry:
        """Remove an entry that is moving back to the device; its slot is free again (the runner
        reads the slot before it writes any later store to it)."""
        entry = self._drop(key)
        self.loaded_pages += 1
        self.hit_tokens += len(entry.tokens)
        return entry

    def clear(self) -> None:
        for key in list(self._entries):
            self._drop(key)

    def stats(self) -> HostTierStats:
        return HostTierStats(self.num_slots, len(self._entries), self.hit_tokens,
                             self.stored_pages, self.loaded_pages, self.bytes_per_page)

    def _drop(self, key: int) -> HostEntry:
        entry = self._entries.pop(key)
        self._serials.discard(entry.serial)
        self._free_slots.append(entry.slot)
        if self.events is not None:
            self.events.removed(key, MEDIUM_HOST)
        return entry

    def check_invariants(self) -> None:
        slots = [e.slot for e in self._entries.values()]
        if len(set(slots)) != len(slots):
            raise AssertionError("two host prefix entries share a slot")
        if set(slots) & set(self._free_slots) or len(slots) + len(self._free_slots) != self.num_slots:
            raise AssertionError(f"host slots: {len(slots)} used + {len(self._free_slots)} free "
                                 f"!= {self.num_slots}, or a used slot is free")
        if {e.serial for e in self._entries.values()} != self._serials:
            raise AssertionError("host serials out of step with host entries")
