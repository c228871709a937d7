"""HostPageTables: the page table of every batch slot, kept between steps (the persistent batch).

A request keeps its batch slot while it runs, and its page table changes only when it gains a
page (every page_size tokens of decoding), loses out-of-window pages, or is admitted: so a step
copies just the rows whose table changed (a tuple compare per request), and lays out its [S, P]
page table and its decode rows' slot mapping with one numpy gather each instead of one copy per
request. Pure numpy: no jax, no scheduling.
"""

from __future__ import annotations

import numpy as np


class HostPageTables:
    def __init__(self, num_slots: int, max_pages_per_request: int):
        """num_slots: max_num_seqs + 1 (slot 0: no slot, never stored)."""
        self.tables = np.zeros((num_slots, max_pages_per_request), np.int32)
        self._rows: list[tuple[int, ...] | None] = [None] * num_slots

    def update(self, slot: int, page_table: tuple[int, ...]) -> None:
        """Store a request's table in its slot if it differs from the one there."""
        if self._rows[slot] != page_table:
            row = self.tables[slot]
            row[:len(page_table)] = page_table
            row[len(page_table):] = 0
            self._rows[slot] = page_table
