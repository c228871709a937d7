"""DevicePageTables: every batch slot's page table as one device array, updated by row.

The plain step receives, instead of its [S, P] page table, each request's slot and the rows
that changed since they were last sent (step_inputs.PageTableInputs, at most
num_table_updates(S) rows); it writes those rows into this array (donated through the step
like the KV cache) and gathers its [S, P] table by slot on the device (`apply`). When more rows
changed than a step carries (many requests admitted at once), `write` sends the rest first: a
small scatter compiled ahead of time for row counts in powers of two, run on the launcher
thread before the step. Slot 0 is scratch and stays zeros: padding requests read it, unused
update entries write zeros to it. No scheduling and no host copy here
(runner/host_page_tables.py keeps the host's).
"""

from __future__ import annotations

import jax
import numpy as np

from jaxserve.runner.buckets import powers_of_two
from jaxserve.model.step_inputs import PageTableInputs


def write(tables, slots, rows):
    """tables [N, P] with rows [K, P] written at slots [K] (duplicates only of scratch 0)."""
    return tables.at[slots].set(rows)


def apply(tables, inputs: PageTableInputs):
    """In the step: this step's changed rows written, then (tables, page_table [S, P])."""
    tables = write(tables, inputs.update_slots, inputs.update_rows)
    return tables, tables[inputs.slots]


class DevicePageTables:
    def __init__(self, num_slots: int, max_pages_per_request: int, sharding=None):
        """num_slots: as HostPageTables'; sharding: where it lives (None: the default
        device; tensor parallel: replicated)."""
        zeros = np.zeros((num_slots, max_pages_per_request), np.int32)
        self.arrays = jax.device_put(zeros, sharding)
        self.max_pages = max_pages_per_request
        self._sizes = powers_of_two(8, num_slots)
        shardings = {} if sharding is None else {"out_shardings": sharding}
        self._write = jax.jit(write, donate_argnums=(0,), **shardings)

    def warmup(self) -> None:
        """Compile the overflow scatter for every row-count bucket (serving never compiles)."""
        for size in self._sizes:
            self.write(np.zeros(size, np.int32), np.zeros((size, self.max_pages), np.int32))

    def write(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """Rows [n, P] into slots [n] now (host arrays, padded to a bucket with scratch 0)."""
        size = next(s for s in self._sizes if s >= len(slots))
        padded_slots = np.zeros(size, np.int32)
        padded_rows = np.zeros((size, self.max_pages), np.int32)
        padded_slots[:len(slots)], padded_rows[:len(slots)] = slots, rows
        self.arrays = self._write(self.arrays, padded_slots, padded_rows)
