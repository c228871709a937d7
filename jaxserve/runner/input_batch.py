"""InputBatch: the plain runner's persistent per-row state, kept by batch slot between steps.

A request keeps its batch slot while it runs, so what a step needs of it mostly did not change
since the step before: its page table changes when it gains a page (every page_size tokens of
decoding), loses out-of-window pages or is admitted, and the plan carries only that change
(plan.PageUpdate); its sampling settings (plan.SamplingRow) are the same for its whole life;
its last sampled token is on the device. The batch keeps each of these by slot and a step
writes only the rows that changed:

* HostPageTables (runner/page_tables.py): the host's copy of every slot's page table, kept
  from the plans' diffs; the rows the device lacks are listed for it.
* HostSamplingRows: every slot's sampling settings, written when a row's differ from those its
  slot holds; a step's [S] setting arrays are one gather per field by slot.
* DevicePageTables: the same tables on the device. A step carries each request's slot and at
  most num_table_updates(S) changed rows (step_inputs.PageTableInputs), writes them and
  gathers its [S, P] table by slot (`apply_table_updates`); rows beyond those go first
  through a small scatter compiled ahead for row counts in powers of two.
* LastTokens: each slot's last sampled token on the device. Async scheduling plans step N+1
  before step N's tokens reach the host, so a decode row reads its input token there
  (`feed_tokens`) and every plain step writes its samples back (`record_tokens`).

Slot 0 is scratch: padding requests read its zeros and unused updates write there; slots
1..max_num_seqs are requests', handed out by request id (runner/batch_rows.py: HostPageTables'
`rows`, freed when a plan lists the request as released). The device arrays are donated
through every step like the KV cache (`arrays`, as CompiledStep's caches have).

The layout that updates the host rows from a plan is runner/prepare_inputs.py (pure numpy: it
reaches these rows through the InputBatch it is given and never imports this module). No
scheduling here, and no host transfer beyond the overflow rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.plan import SamplingRow
from jaxserve.model.decoder.step_inputs import PageTableInputs
from jaxserve.runner.buckets import powers_of_two
from jaxserve.runner.page_tables import HostPageTables


class HostSamplingRows:
    """Every slot's sampling settings; rows with processors or a grammar are `special` (the
    layout writes those row by row)."""

    def __init__(self, num_slots: int):
        """num_slots: every slot a step's row may use (scratch 0 included)."""
        self.temperature = np.zeros(num_slots, np.float32)
        self.top_k = np.zeros(num_slots, np.int32)
        self.top_p = np.ones(num_slots, np.float32)
        self.min_p = np.zeros(num_slots, np.float32)
        self.seeds = np.zeros(num_slots, np.uint32)
        self.top_logprobs = np.zeros(num_slots, np.int32)
        self.special = np.zeros(num_slots, np.bool_)  # processors or a grammar: row by row
        self._rows: list[SamplingRow | None] = [None] * num_slots

    def store(self, slots: list[int], rows: list[SamplingRow | None]) -> None:
        """Each row's settings into its slot, unless the slot holds equal ones already
        (None rows: nothing)."""
        held = self._rows
        for slot, r in zip(slots, rows):
            if r is not None and r != held[slot]:
                held[slot] = r
                self.temperature[slot], self.top_k[slot] = r.temperature, r.top_k
                self.top_p[slot], self.min_p[slot], self.seeds[slot] = r.top_p, r.min_p, r.seed
                self.top_logprobs[slot] = r.top_logprobs
                self.special[slot] = r.processors is not None or r.grammar_bitmask is not None


def write_table_rows(tables, slots, rows):
    """tables [N, P] with rows [K, P] written at slots [K] (duplicates only of scratch 0)."""
    return tables.at[slots].set(rows)


def apply_table_updates(tables, inputs: PageTableInputs):
    """In the step: this step's changed rows written, then (tables, page_table [S, P])."""
    tables = write_table_rows(tables, inputs.update_slots, inputs.update_rows)
    return tables, tables[inputs.slots]


def feed_tokens(token_ids, token_slots, last_tokens):
    """In the step: rows whose token is still on the device read it from their slot."""
    return jnp.where(token_slots > 0, last_tokens[token_slots], token_ids)


def record_tokens(last_tokens, sample_slots, sampled):
    """In the step: each sampled row's token into its slot (rows without one: scratch 0)."""
    return last_tokens.at[sample_slots].set(sampled.astype(jnp.int32))


class DevicePageTables:
    """Every slot's page table as one device array [N, P] (`arrays`), updated by row."""

    def __init__(self, num_slots: int, max_pages_per_request: int, sharding=None):
        """num_slots: as the host copy's; sharding: where it lives
        (None: the default device; tensor parallel: replicated)."""
        zeros = np.zeros((num_slots, max_pages_per_request), np.int32)
        self.arrays = jax.device_put(zeros, sharding)
        self.max_pages = max_pages_per_request
        self._sizes = powers_of_two(8, num_slots)
        shardings = {} if sharding is None else {"out_shardings": sharding}
        self._write = jax.jit(write_table_rows, donate_argnums=(0,), **shardings)

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


class LastTokens:
    """Every slot's last sampled token as one device array [N] (`arrays`)."""

    def __init__(self, num_slots: int, sharding=None):
        """num_slots: max_num_seqs + 1 (scratch slot 0: rows that sample nothing write it);
        sharding: as DevicePageTables'."""
        zeros = jnp.zeros(num_slots, jnp.int32)
        self.arrays = zeros if sharding is None else jax.device_put(zeros, sharding)


class InputBatch:
    """The four pieces over one numbering of slots: host_tables, sampling (host numpy, which
    prepare_inputs.build_step_inputs updates from each plan), device_tables and last_tokens
    (device arrays the plain step takes among its donated caches)."""

    def __init__(self, max_num_seqs: int, max_pages_per_request: int, sharding=None):
        """sharding: where the device arrays live (None: the default device; tensor parallel:
        replicated)."""
        num_slots = max_num_seqs + 1
        self.host_tables = HostPageTables(num_slots, max_pages_per_request)
        self.sampling = HostSamplingRows(num_slots)
        self.device_tables = DevicePageTables(num_slots, max_pages_per_request, sharding)
        self.last_tokens = LastTokens(num_slots, sharding)

    @property
    def rows(self):
        """Request id -> slot (runner/batch_rows.py), shared with every layout of these rows."""
        return self.host_tables.rows

    @property
    def arrays(self):
        """The device arrays (to wait on)."""
        return self.last_tokens.arrays, self.device_tables.arrays

    def warmup(self) -> None:
        self.device_tables.warmup()

    def unsent_table_rows(self, num_sent: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The changed page-table rows beyond the first num_sent (those a step carries), as
        (slots [n], rows [n, P]) for write_unsent; None if there are none."""
        unsent = self.host_tables.changed[num_sent:]
        if not unsent:
            return None
        return np.asarray(unsent, np.int32), self.host_tables.tables[unsent]

    def write_unsent(self, rows: tuple[np.ndarray, np.ndarray] | None) -> None:
        """unsent_table_rows' rows into the device tables (before the step that needs them)."""
        if rows is not None:
            self.device_tables.write(*rows)
