"""HostPageTables: the host's copy of every batch slot's page table (the persistent batch).

A request keeps its batch slot while it runs, and its page table changes only when it gains a
page (every page_size tokens of decoding), loses out-of-window pages, or is admitted: so a step
checks one tuple per request (by identity first: the page manager replaces a request's tuple
when its pages change) and records just the rows whose table changed. The plain step
keeps the tables themselves on the device (runner/device_page_tables.py) and receives only
those rows; the host copy lays out the decode rows' slot mapping with one numpy gather, and is
what a step without device tables copies its [S, P] table from. Pure numpy: no jax, no
scheduling.
"""

from __future__ import annotations

import numpy as np


class HostPageTables:
    def __init__(self, num_slots: int, max_pages_per_request: int, num_transient: int = 0):
        """num_slots: max_num_seqs + 1 (slot 0: no slot, never stored); num_transient: more
        slots after those, one per request row of a step, for requests without a batch slot
        (their row i uses slot num_slots + i; 0: such a step copies every table)."""
        self.num_slots, self.num_transient = num_slots, num_transient
        self.tables = np.zeros((num_slots + num_transient, max_pages_per_request), np.int32)
        self._rows: list[tuple[int, ...] | None] = [None] * (num_slots + num_transient)
        self.changed: list[int] = []  # slots whose row the last layout changed, in order

    def update(self, slot: int, page_table: tuple[int, ...]) -> bool:
        """Store a request's table in its slot if it differs from the one there; True if so
        (the device's copy of the row is then stale)."""
        held = self._rows[slot]
        if held is page_table or held == page_table:  # (the page manager's tuple: identity)
            return False
        row = self.tables[slot]
        row[:len(page_table)] = page_table
        row[len(page_table):] = 0
        self._rows[slot] = page_table
        return True
