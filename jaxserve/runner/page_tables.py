"""HostPageTables: the host's copy of every batch slot's page table, kept from the plans' diffs.

The scheduler sends a request's page table whole when the request is new to its batch slot and
after that only its changes (plan.PageUpdate: pages gained, leading pages a sliding window
released, a tail cut after rejected drafts); a chunk without one (and every plan.DecodeRows row)
reads the table its slot holds. Rows changed since the device last got them are marked stale;
the plain runner's layout sends the stale rows of each step's slots (input_batch.py keeps the
device copy), and a runner that sends whole tables (speculative steps) copies the rows it needs.

Slot 0 is scratch (never stored). Which slot a request holds is `rows` (runner/batch_rows.py),
which every layout over these tables reads. Pure numpy: no jax, no scheduling.
"""

from __future__ import annotations

import numpy as np

from jaxserve.core.plan import PageUpdate
from jaxserve.runner.batch_rows import BatchRows


class HostPageTables:
    """Every slot's page table [num_slots, P], its length, and whether the device's copy is
    stale."""

    def __init__(self, num_slots: int, max_pages_per_request: int):
        """num_slots: max_num_seqs + 1 (slot 0: scratch, never stored)."""
        self.num_slots = n = num_slots
        self.max_pages = max_pages_per_request
        self.tables = np.zeros((n, max_pages_per_request), np.int32)
        self.lengths = np.zeros(n, np.int64)
        self.stale = np.zeros(n, np.bool_)
        self.changed: list[int] = []  # slots the last plain layout sent the device, in order
        self.rows = BatchRows(num_slots - 1)  # request id -> its slot

    def apply(self, slot: int, update: PageUpdate | None, request_id: str = "") -> None:
        """A chunk's page-table change into its slot (None: the slot holds it already)."""
        if update is None:
            return
        kept, new = update.num_kept, update.new_pages
        end = kept + len(new)
        if end > self.max_pages:
            raise ValueError(f"request {request_id}: {end} pages (page-table width "
                             f"{self.max_pages})")
        row, old = self.tables[slot], int(self.lengths[slot])
        row[:update.num_released] = 0
        row[kept:end] = new
        row[end:max(old, end)] = 0
        self.lengths[slot] = end
        self.stale[slot] = True

    def apply_all(self, chunks, slots) -> None:
        """Each chunk's update into its slot (slots: one per chunk)."""
        apply = self.apply
        for chunk, slot in zip(chunks, slots):
            if chunk.pages is not None:
                apply(slot, chunk.pages, chunk.request_id)

    def take_stale(self, slots: np.ndarray) -> list[int]:
        """The slots among these whose device copy is stale (each once, in order), no longer
        marked: the caller sends them."""
        stale = slots[self.stale[slots]]
        if not stale.size:
            return []
        stale = list(dict.fromkeys(stale.tolist()))
        self.stale[stale] = False
        return stale
