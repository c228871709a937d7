"""KV-cache events as plain data: which prefix-cache pages were stored, removed or all cleared,
in the shapes of vLLM's KV events (BlockStored, BlockRemoved, AllBlocksCleared).

The PageManager and its host tier append to a KVEventLog as their prefix-cache entries change:
a full page registered under its chain key (stored), a cached page evicted or replaced
(removed), the whole cache reset (cleared). The engine takes the log's events after each step
and hands them to a publisher (engine/kv_events.py) that encodes and sends them off the engine
thread. A block hash here is the page's prefix-cache key (page_stats.stable_page_hash of the
parent key and the page's token ids); the first page of a chain has no parent (None), also
under a LoRA adapter (its lora_id says which). Medium "GPU" is the device pool (vLLM's name for
it, whatever the backend), "CPU" the prefix cache's host tier.

Consecutive stores that continue one chain (same medium and adapter, each page's parent the
previous one) share one BlockStored, as vLLM batches a request's new blocks; consecutive
removals on one medium share one BlockRemoved. A clear drops the events before it: a subscriber
that applies the batch in order ends in the same state. No jax, no zmq, no I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass

MEDIUM_DEVICE = "GPU"
MEDIUM_HOST = "CPU"


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[int]          # a chain: each page's parent is the one before it
    parent_block_hash: int | None    # the first page's parent (None: a chain's first page)
    token_ids: list[int]             # every page's token ids, block_size per page
    block_size: int
    lora_id: int | None              # the LoRA adapter's id (None: the base model)
    medium: str


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str


@dataclass(slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventLog:
    """The prefix cache's changes since the last take(), in order."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._events: list[KVEvent] = []
        # key -> [parent key, lora id, media holding it]: a page copied to another medium
        # (evicted to the host tier) is announced with the same parent and adapter there.
        self._known: dict[int, list] = {}

    def __len__(self) -> int:
        return len(self._events)

    def stored(self, key: int, parent_key: int | None, token_ids, lora_id: int,
               medium: str = MEDIUM_DEVICE) -> None:
        known = self._known.get(key)
        if known is None:
            self._known[key] = [parent_key, lora_id, 1]
        else:
            known[0], known[1], known[2] = parent_key, lora_id, known[2] + 1
        lora = lora_id or None
        last = self._events[-1] if self._events else None
        if (type(last) is BlockStored and parent_key is not None and last.medium == medium
                and last.lora_id == lora and last.block_hashes[-1] == parent_key):
            last.block_hashes.append(key)
            last.token_ids.extend(token_ids)
        else:
            self._events.append(BlockStored([key], parent_key, list(token_ids),
                                            self.block_size, lora, medium))

    def copied(self, key: int, token_ids, medium: str) -> None:
        """A page already stored on one medium is stored on another (its parent and adapter
        as announced first)."""
        parent_key, lora_id, _ = self._known.get(key) or (None, 0, 0)
        self.stored(key, parent_key, token_ids, lora_id, medium)

    def removed(self, key: int, medium: str = MEDIUM_DEVICE) -> None:
        known = self._known.get(key)
        if known is not None:
            known[2] -= 1
            if known[2] <= 0:
                del self._known[key]
        last = self._events[-1] if self._events else None
        if type(last) is BlockRemoved and last.medium == medium:
            last.block_hashes.append(key)
        else:
            self._events.append(BlockRemoved([key], medium))

    def cleared(self) -> None:
        self._events = [AllBlocksCleared()]
        self._known.clear()

    def take(self) -> list[KVEvent]:
        """The events since the last take, oldest first; the log is empty afterwards."""
        events, self._events = self._events, []
        return events
