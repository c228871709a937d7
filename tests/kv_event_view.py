"""A KV-event subscriber's view of one engine's prefix cache, rebuilt from the events alone.

`KVCacheView.apply(events)` applies a batch's events in order (core/kv_events.py's dataclasses,
as engine/kv_events.decode_batch returns them): BlockStored adds each page hash on its medium
with its parent (the previous hash of the chain, or the event's parent for the first), token
ids and adapter; BlockRemoved drops the hashes from the medium; AllBlocksCleared empties every
medium. `expected(pm)` reads the same map from a PageManager (and its host tier) for comparison.
"""

from __future__ import annotations

from jaxserve.core.kv_events import (MEDIUM_DEVICE, MEDIUM_HOST, AllBlocksCleared, BlockRemoved,
                                     BlockStored)


class KVCacheView:
    def __init__(self):
        # medium -> {page hash: (parent hash, token ids, lora id)}
        self.blocks: dict[str, dict[int, tuple]] = {MEDIUM_DEVICE: {}, MEDIUM_HOST: {}}
        self.num_events = 0

    def apply(self, events) -> None:
        for event in events:
            self.num_events += 1
            if isinstance(event, BlockStored):
                parent, size = event.parent_block_hash, event.block_size
                assert len(event.token_ids) == size * len(event.block_hashes), event
                for i, key in enumerate(event.block_hashes):
                    tokens = tuple(event.token_ids[i * size:(i + 1) * size])
                    self.blocks[event.medium][key] = (parent, tokens, event.lora_id)
                    parent = key
            elif isinstance(event, BlockRemoved):
                for key in event.block_hashes:
                    assert key in self.blocks[event.medium], (
                        f"BlockRemoved of {key} on {event.medium}, never stored there")
                    del self.blocks[event.medium][key]
            elif isinstance(event, AllBlocksCleared):
                for blocks in self.blocks.values():
                    blocks.clear()
            else:
                raise AssertionError(f"unknown event {event!r}")

    def keys(self, medium: str = MEDIUM_DEVICE) -> set[int]:
        return set(self.blocks[medium])


def expected(pm) -> dict[str, dict[int, tuple[int, ...]]]:
    """{medium: {page hash: token ids}} of a PageManager's prefix cache, device and host."""
    device = {key: pm._tokens[page] for key, page in pm._cached.items()}
    host = {} if pm.host_tier is None else {
        key: entry.tokens for key, entry in pm.host_tier._entries.items()}
    return {MEDIUM_DEVICE: device, MEDIUM_HOST: host}


def parent_keys(pm) -> dict[int, int | None]:
    """{device page hash: its parent's hash (None: a chain's first page)} of a PageManager,
    for the parents that are still on the device."""
    by_serial = {pm._serial[page]: key for key, page in pm._cached.items()}
    return {key: by_serial.get(pm._parent_serial[page]) for key, page in pm._cached.items()
            if pm._parent_serial[page] <= 0 or pm._parent_serial[page] in by_serial}
