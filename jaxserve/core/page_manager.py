"""Host-side page pool of the paged KV cache: ref counts, an O(1) LRU free list, a prefix cache.

The PageManager hands out ids of a fixed pool of pages (page 0 is reserved scratch that padded
tokens write to), shares pages between requests through ref counts, and remembers the token ids
of every full page whose KV is final, so a later request with the same prefix reuses its pages.
It is bookkeeping over integers only: it must not import jax or touch device memory (the runner
moves data; `fork` returns the page pairs to copy).

Prefix cache. A full page's key is `hash_fn(parent_key, page_token_ids)`, a chain over the whole
prefix. A key only names a candidate: a lookup also compares the page's stored token ids and the
registration serial of its parent page, so neither a hash collision nor a parent that was evicted
and re-registered with other tokens can return a page whose KV belongs to another prefix. A
request under a LoRA adapter starts its chain from its adapter's root (page_stats.prefix_root:
a key and a parent serial of its own), so KV computed under one adapter never serves another.

Free list. One OrderedDict in eviction order, taken from the head: uncached pages are put at the
head (reused first, nothing lost), cached pages appended at the tail (least recently used first).
A request's pages are released deepest first, so a chain is evicted from its leaves before its
root, whose loss would make the rest of the chain unreachable. `release_window` gives back pages
wholly before a sliding window (never read again; NULL_PAGE takes their table slots, and the
attention masks it out); they keep their prefix-cache entries: their KV is still that prefix's.

Host tier (optional, host_prefix_tier.py). An evicted cached page keeps its identity (key, token
ids, serial, parent serial) in the host tier, and its KV is copied there; a lookup that misses
on the device continues the chain there with the same checks. `take_prefix_ops` hands the
runner each step's copies: stores (device page -> host slot, before the step overwrites the
page) and loads (host slot -> the fresh device page a host hit was given, before the step
reads it). A host entry whose store is still pending this step does not match (its KV is not
on the host yet): that prefix is recomputed, never read wrong.

KV events (optional, kv_events.py): with a KVEventLog, every registration of a full page (on the
device: commit, or a host hit brought back), every removal (eviction, replacement) and a reset
are logged there, the host tier's own stores and drops too, for the engine to publish.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from jaxserve.core.host_prefix_tier import HostPrefixTier
from jaxserve.core.kv_events import KVEventLog
from jaxserve.core.page_invariants import check_invariants
from jaxserve.core.prefix_match import match_prefix
from jaxserve.core.page_stats import (  # noqa: F401 (HashFn, stable_page_hash: re-exports)
    _ROOT_SERIAL, NULL_PAGE, HashFn, PageStats, RequestPages, prefix_root, stable_page_hash)


class PageManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True,
                 hash_fn: HashFn | None = None, host_tier: HostPrefixTier | None = None,
                 events: KVEventLog | None = None):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self._hash_fn = hash_fn or stable_page_hash
        self._ref = [0] * num_pages
        self._key: list[int | None] = [None] * num_pages
        self._tokens: list[tuple[int, ...] | None] = [None] * num_pages
        self._serial = [0] * num_pages
        self._parent_serial = [_ROOT_SERIAL] * num_pages
        self._cached: dict[int, int] = {}  # key -> page
        self._live_serials: dict[int, int] = {}  # serial -> page
        self._next_serial = _ROOT_SERIAL + 1
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_pages))
        self._requests: dict[str, _RequestPages] = {}
        self._query_tokens = 0
        self._hit_tokens = 0
        if host_tier is not None and not enable_prefix_caching:
            raise ValueError("a host prefix tier needs enable_prefix_caching")
        self.host_tier, self.events = host_tier, events
        if host_tier is not None:
            host_tier.events = events
        self._pending_stores: dict[int, int] = {}  # host slot -> device page, this step
        self._pending_loads: list[tuple[int, int]] = []  # (host slot, device page), this step

    # ----------------------------------------------------------------- queries
    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def num_pages_for(self, num_slots: int) -> int:
        return -(-num_slots // self.page_size)

    def page_table(self, request_id: str) -> list[int]:
        return list(self._get(request_id).pages)

    def page_table_tuple(self, request_id: str) -> tuple[int, ...]:  # (no copy: RowLayout
        return self._get(request_id).pages  # compares it with the table it last sent)

    def num_slots(self, request_id: str) -> int:
        return self._get(request_id).num_slots

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def lookup_prefix(self, token_ids: Sequence[int], record_stats: bool = False,
                      lora_id: int = 0) -> list[int]:
        """Pages of the longest cached chain of full pages matching a prefix of token_ids
        (NULL_PAGE for a page found in the host tier: it gets a device page when allocated).

        Token ids and parent serials are compared at every hit, so a wrong page is never
        returned. At least the last token is left to compute. No ref count changes. The hit
        statistics count admissions (`allocate`), so a peek before allocating, or a request
        that waits several steps, is not counted again unless record_stats is set. lora_id:
        the adapter the prefix was computed under (0: none)."""
        pages = [page for page, _ in self._match(token_ids, lora_id)]
        if record_stats:
            self._record(len(token_ids), len(pages) * self.page_size)
        return pages

    def can_allocate(self, token_ids: Sequence[int], num_slots: int, lora_id: int = 0) -> bool:
        return self._can_take(self._match(token_ids, lora_id), num_slots)

    def take_prefix_ops(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's host-tier copies, cleared: stores [(device page, host slot)] and loads
        [(host slot, device page)]. The runner does the stores' device reads first, then the
        loads, all before the step; a load reads its slot before any later store writes it."""
        stores = [(page, slot) for slot, page in self._pending_stores.items()]
        loads, self._pending_stores, self._pending_loads = self._pending_loads, {}, []
        return stores, loads

    def stats(self) -> PageStats:
        total = self.num_pages - 1
        used = total - len(self._free)
        q, hit = self._query_tokens, self._hit_tokens
        return PageStats(total, len(self._free), used, len(self._cached), used / total,
                         q, hit, hit / q if q else 0.0,
                         None if self.host_tier is None else self.host_tier.stats())

    # ----------------------------------------------------------------- changes
    def allocate(self, request_id: str, token_ids: Sequence[int], num_slots: int, *,
                 num_released_pages: int = 0, lora_id: int = 0) -> int | None:
        """Admit a new request: reuse its cached prefix pages, then fresh pages up to num_slots.

        Returns the number of cached tokens reused (a multiple of page_size), or None with nothing
        changed when pages run out. The request holds max(num_slots, cached tokens) slots.
        Successful calls count toward the prefix hit statistics. num_released_pages (a window
        request swapped back in) NULL_PAGE entries come first; it registers no prefix pages.
        lora_id: the adapter its KV is computed under (0: none), whose chain it looks up and
        registers in."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already holds pages")
        if num_released_pages and (token_ids or num_released_pages * self.page_size > num_slots):
            raise ValueError(f"allocate({request_id!r}): released pages with token ids or slots")
        matched = self._match(token_ids, lora_id)
        if not self._can_take(matched, num_slots - num_released_pages * self.page_size):
            return None
        cached = self._take_matched(matched, lora_id)
        num_fresh = max(self.num_pages_for(num_slots) - len(cached) - num_released_pages, 0)
        num_cached_tokens = len(cached) * self.page_size
        root_key, root_serial = prefix_root(self._hash_fn, lora_id)
        req = RequestPages(tuple([NULL_PAGE] * num_released_pages + cached
                                 + [self._pop_free() for _ in range(num_fresh)]),
                           max(num_slots, num_cached_tokens), parent_key=root_key,
                           parent_serial=root_serial, can_register=not num_released_pages,
                           num_released_pages=num_released_pages, root_key=root_key,
                           root_serial=root_serial)
        if cached:
            req.num_hashed_pages = len(cached)
            req.parent_key = self._key[cached[-1]]
            req.parent_serial = self._serial[cached[-1]]
        self._requests[request_id] = req
        if self.enable_prefix_caching:
            self._record(len(token_ids), num_cached_tokens)
        return num_cached_tokens

    def append_slots(self, request_id: str, num_slots: int) -> bool:
        """Grow to >= num_slots slots in total; False, nothing changed, if pages run out."""
        req = self._requests.get(request_id) or self._get(request_id)  # (per request and step)
        num_new = -(-num_slots // self.page_size) - len(req.pages)
        if num_new <= 0:  # most calls: a decode within its last page
            req.num_slots = max(req.num_slots, num_slots)
            return True
        if num_new > len(self._free):
            return False
        req.pages += tuple([self._pop_free() for _ in range(num_new)])
        req.num_slots = max(req.num_slots, num_slots)
        return True

    def release_window(self, request_id: str, first_needed_slot: int) -> int:
        """Give back every page wholly before first_needed_slot (after commit), NULL_PAGE in
        their place; returns how many leading entries are NULL_PAGE now."""
        req = self._get(request_id)
        target = min(max(first_needed_slot, 0) // self.page_size, req.num_slots // self.page_size)
        first = req.num_released_pages
        for i in range(target - 1, first - 1, -1):  # deepest first
            self._release(req.pages[i])
        if target > first:
            req.pages = (NULL_PAGE,) * target + req.pages[target:]
        req.num_released_pages = max(first, target)
        return req.num_released_pages

    def truncate(self, request_id: str, num_slots: int) -> None:
        """Shrink to num_slots slots, releasing trailing pages (speculative-decoding rollback).

        Raises ValueError rather than dropping slots of a committed, prefix-cached page or of a
        page shared with another request: either would corrupt KV that others rely on."""
        req = self._get(request_id)
        if num_slots > req.num_slots:
            raise ValueError(f"truncate({request_id!r}, {num_slots}) would grow the request "
                             f"(it holds {req.num_slots} slots); use append_slots")
        first_touched = num_slots // self.page_size
        touched = req.pages[first_touched:]
        if first_touched < req.num_hashed_pages or any(self._key[p] is not None for p in touched):
            raise ValueError(f"truncate({request_id!r}, {num_slots}) would drop committed, "
                             f"prefix-cached slots (page {req.pages[first_touched]})")
        num_keep = self.num_pages_for(num_slots)
        if num_keep > first_touched and self._ref[req.pages[first_touched]] > 1:
            raise ValueError(f"truncate({request_id!r}, {num_slots}) would cut into page "
                             f"{req.pages[first_touched]}, which is shared with another request")
        for page in reversed(req.pages[num_keep:]):
            self._release(page)
        req.pages = req.pages[:num_keep]
        req.num_slots = num_slots

    def commit(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Register each full page of token_ids (all the request's final tokens) not yet registered.

        A key already cached for the same prefix by another page keeps that entry (no duplicate)."""
        req = self._get(request_id)
        if len(token_ids) > req.num_slots:
            raise ValueError(f"commit({request_id!r}) got {len(token_ids)} tokens but the request "
                             f"holds only {req.num_slots} slots")
        if not (self.enable_prefix_caching and req.can_register):
            return
        ps = self.page_size
        for i in range(req.num_hashed_pages, len(token_ids) // ps):
            page, page_tokens = req.pages[i], tuple(token_ids[i * ps:(i + 1) * ps])
            if self._key[page] is not None:
                # Registered by a request sharing this very page (fork): adopt its entry.
                if self._tokens[page] != page_tokens:
                    raise ValueError(f"commit({request_id!r}): tokens of page {page} differ from "
                                     "the ones it was registered with")
                key, holder = self._key[page], page
            else:
                key = self._hash_fn(req.parent_key, page_tokens)
                holder = self._register_or_find(page, key, page_tokens, req.parent_serial)
                if holder is None:
                    req.can_register = False  # a true hash collision: stop caching this request
                    return
                if holder == page and self.events is not None:  # registered just now
                    self.events.stored(key, req.parent_key if req.parent_serial > _ROOT_SERIAL
                                       else None, page_tokens, -req.root_serial)
            req.num_hashed_pages = i + 1
            req.parent_key, req.parent_serial = key, self._serial[holder]

    def fork(self, src_id: str, dst_id: str, num_slots: int) -> int:
        """dst shares (by ref count) src's pages that lie wholly inside its first num_slots
        slots, and continues src's prefix chain from there. Returns the slots dst holds, a
        multiple of page_size (0, holding nothing, when src has given pages back to a window);
        the caller grows dst with append_slots. Those slots of src must hold final KV."""
        src = self._get(src_id)
        if dst_id in self._requests:
            raise ValueError(f"request {dst_id!r} already holds pages")
        num_pages = 0 if src.num_released_pages else min(num_slots, src.num_slots) // self.page_size
        pages = src.pages[:num_pages]
        for page in pages:
            self._take_ref(page)
        num_hashed = min(src.num_hashed_pages, num_pages)
        last = pages[num_hashed - 1] if num_hashed else None
        self._requests[dst_id] = RequestPages(
            pages, num_pages * self.page_size, num_hashed,
            src.root_key if last is None else self._key[last],
            src.root_serial if last is None else self._serial[last], src.can_register,
            root_key=src.root_key, root_serial=src.root_serial)
        return num_pages * self.page_size

    def free(self, request_id: str) -> None:
        """Release all the request's pages, deepest first; an unknown id is a no-op."""
        req = self._requests.pop(request_id, None)
        if req is not None:
            for page in reversed(req.pages[req.num_released_pages:]):
                self._release(page)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix; running requests keep their pages but stop registering."""
        for page in list(self._cached.values()):
            self._unregister(page)
        if self.host_tier is not None:
            self.host_tier.clear()
            self._pending_stores.clear()  # pending loads stay: their pages count as computed
        if self.events is not None:
            self.events.cleared()
        for req in self._requests.values():
            req.can_register = False

    # ----------------------------------------------------------------- internals
    def _get(self, request_id: str) -> RequestPages:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} holds no pages") from None

    def _record(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self._query_tokens += num_query_tokens
        self._hit_tokens += num_hit_tokens

    def _match(self, token_ids: Sequence[int], lora_id: int = 0) -> list[tuple[int, int]]:
        return match_prefix(self, token_ids, lora_id)

    def _can_take(self, matched: list[tuple[int, int]], num_slots: int) -> bool:
        on_device = [page for page, _ in matched if page != NULL_PAGE]  # host hits need pages
        num_fresh = max(self.num_pages_for(num_slots) - len(on_device), 0)
        num_cached_free = sum(1 for p in on_device if self._ref[p] == 0)
        return num_fresh <= len(self._free) - num_cached_free

    def _take_matched(self, matched: list[tuple[int, int]], lora_id: int) -> list[int]:
        """Hold the matched chain: a ref on each device page, and for each host hit a fresh
        device page registered under the entry's identity, with its load pending."""
        for page, _ in matched:
            if page != NULL_PAGE:
                self._take_ref(page)
        # Off the host tier before any page is popped: those evictions must not drop them.
        entries = {key: self.host_tier.take(key) for page, key in matched if page == NULL_PAGE}
        pages = []
        for i, (page, key) in enumerate(matched):
            if page == NULL_PAGE:
                entry, page = entries[key], self._pop_free()
                self._adopt(page, key, entry.tokens, entry.serial, entry.parent_serial)
                self._pending_loads.append((entry.slot, page))
                if self.events is not None:
                    self.events.stored(key, matched[i - 1][1] if i else None, entry.tokens,
                                       lora_id)
            pages.append(page)
        return pages

    def _take_ref(self, page: int) -> None:
        if self._ref[page] == 0:
            del self._free[page]
        self._ref[page] += 1

    def _pop_free(self) -> int:
        page, _ = self._free.popitem(last=False)
        if self._key[page] is not None:  # eviction: to the host tier, when there is one
            # (not a page whose own load is pending this step: the store would read it first)
            if self.host_tier is not None and all(p != page for _, p in self._pending_loads):
                slot = self.host_tier.put(self._key[page], self._tokens[page], self._serial[page],
                                          self._parent_serial[page])
                if slot is not None:
                    self._pending_stores[slot] = page
            self._unregister(page)
        self._ref[page] = 1
        return page

    def _release(self, page: int) -> None:
        self._ref[page] -= 1
        if self._ref[page] == 0:
            self._free[page] = None
            if self._key[page] is None:
                self._free.move_to_end(page, last=False)

    def _register_or_find(self, page: int, key: int, page_tokens: tuple[int, ...],
                          parent_serial: int) -> int | None:
        """Register page under key; return the page now holding this prefix, None on a collision."""
        holder = self._cached.get(key)
        if holder is not None:
            if self._tokens[holder] == page_tokens and self._parent_serial[holder] == parent_serial:
                return holder  # the same prefix is cached already: keep that entry
            orphan_parent = self._parent_serial[holder]
            if orphan_parent <= _ROOT_SERIAL or orphan_parent in self._live_serials or (
                    self.host_tier is not None and self.host_tier.holds_serial(orphan_parent)):
                return None
            self._unregister(holder)  # its parent was evicted: unreachable, so replace it
        self._adopt(page, key, page_tokens, self._next_serial, parent_serial)
        self._next_serial += 1
        return page

    def _adopt(self, page: int, key: int, page_tokens: tuple[int, ...], serial: int,
               parent_serial: int) -> None:
        self._key[page], self._tokens[page] = key, page_tokens
        self._serial[page], self._parent_serial[page] = serial, parent_serial
        self._cached[key] = page
        self._live_serials[serial] = page

    def _unregister(self, page: int) -> None:
        if self.events is not None:
            self.events.removed(self._key[page])
        del self._cached[self._key[page]]
        del self._live_serials[self._serial[page]]
        self._key[page] = self._tokens[page] = None
        self._serial[page], self._parent_serial[page] = 0, _ROOT_SERIAL
        if self._ref[page] == 0 and page in self._free:
            self._free.move_to_end(page, last=False)  # uncached now: reuse before cached pages

    def check_invariants(self) -> None:
        """Raise AssertionError describing the first broken accounting rule."""
        check_invariants(self)
