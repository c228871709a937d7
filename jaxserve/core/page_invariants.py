"""Accounting rules of a PageManager, checked: ref counts against owners, the free list's
order, the prefix cache's keys, serials and token ids, and the host tier's slots.

Tests and debug runs call `PageManager.check_invariants()`; nothing on the serving path does.
Plain integers only: no jax.
"""

from __future__ import annotations

NULL_PAGE = 0


def check_invariants(pm) -> None:
    """Raise AssertionError describing the first broken accounting rule of `pm`, a PageManager.

    Read through its fields only: page_manager.py imports this module, so this one does not
    import page_manager.py, not even for the annotation (that would be an import loop)."""
    def require(ok: bool, msg: str) -> None:
        if not ok:
            raise AssertionError(msg)

    ps, owners = pm.page_size, [0] * pm.num_pages
    for rid, req in pm._requests.items():
        require(len(req.pages) == pm.num_pages_for(req.num_slots),
                f"{rid!r} holds {len(req.pages)} pages for {req.num_slots} slots")
        released, held = req.pages[:req.num_released_pages], req.pages[req.num_released_pages:]
        require(set(released) <= {NULL_PAGE}, f"{rid!r} has a live page among released ones")
        require(len(set(held)) == len(held), f"{rid!r} holds a page twice")
        require(req.num_hashed_pages * ps <= req.num_slots,
                f"{rid!r} has {req.num_hashed_pages} hashed pages beyond its slots")
        for page in held:
            require(0 < page < pm.num_pages, f"{rid!r} holds invalid page {page}")
            owners[page] += 1
        for page in req.pages[req.num_slots // ps:]:
            require(pm._ref[page] == 1, f"partly filled page {page} of {rid!r} is shared")
    require(pm._ref[0] == 0 and 0 not in pm._free, "scratch page 0 was handed out")
    for page in range(1, pm.num_pages):
        require(pm._ref[page] == owners[page],
                f"page {page} has ref {pm._ref[page]} but {owners[page]} owners")
        state = "free and owned" if owners[page] else "neither free nor owned"
        require((page in pm._free) == (owners[page] == 0), f"page {page} is {state}")
    seen_cached = False
    for page in pm._free:
        seen_cached |= pm._key[page] is not None
        require(pm._key[page] is not None or not seen_cached,
                f"uncached free page {page} sits behind a cached one in the free list")
    for key, page in pm._cached.items():
        require(page != NULL_PAGE, "the scratch page is registered in the prefix cache")
        require(pm._key[page] == key, f"key {key} points at page {page} with another key")
        require(pm._tokens[page] is not None and len(pm._tokens[page]) == ps,
                f"cached page {page} does not store one full page of token ids")
        require(pm._live_serials.get(pm._serial[page]) == page,
                f"cached page {page} has no live serial")
    num_keyed = sum(k is not None for k in pm._key)
    require(num_keyed == len(pm._cached) == len(pm._live_serials),
            f"{num_keyed} keyed pages, {len(pm._cached)} cache entries, "
            f"{len(pm._live_serials)} live serials")
    host = pm.host_tier
    if host is not None:
        host.check_invariants()
        require(not (host._serials & pm._live_serials.keys()),
                "a registration serial is alive on both the device and the host")
        for slot, page in pm._pending_loads:
            require(pm._ref[page] > 0 and pm._key[page] is not None,
                    f"page {page} waits for host slot {slot} but is not a held, cached page")
