"""HostSamplingRows: the persistent batch's sampling settings, one row per batch slot.

A request without logits processors or a grammar has one SamplingRow for its whole life
(plan.SamplingRow), so a step recognizes, by identity, the rows whose slot already holds their
settings and writes only the others (a request newly in its slot, a transient slot, a row with
per-step processors or a grammar); the step's [S] setting arrays are then one gather per field
by slot. Pure numpy: no jax, no scheduling.
"""

from __future__ import annotations

import numpy as np

from jaxserve.core.plan import SamplingRow


class HostSamplingRows:
    def __init__(self, num_slots: int):
        """num_slots: every slot a step's row may use (HostPageTables' slots, transient ones
        included)."""
        self.temperature = np.zeros(num_slots, np.float32)
        self.top_k = np.zeros(num_slots, np.int32)
        self.top_p = np.ones(num_slots, np.float32)
        self.min_p = np.zeros(num_slots, np.float32)
        self.seeds = np.zeros(num_slots, np.uint32)
        self.top_logprobs = np.zeros(num_slots, np.int32)
        self.special = np.zeros(num_slots, np.bool_)  # processors or a grammar: row by row
        self._rows: list[SamplingRow | None] = [None] * num_slots

    def store(self, slots: list[int], rows: list[SamplingRow | None]) -> None:
        """Each row's settings into its slot, unless the slot holds that very row already
        (None rows: nothing)."""
        held = self._rows
        for slot, r in zip(slots, rows):
            if r is not None and held[slot] is not r:
                held[slot] = r
                self.temperature[slot], self.top_k[slot] = r.temperature, r.top_k
                self.top_p[slot], self.min_p[slot], self.seeds[slot] = r.top_p, r.min_p, r.seed
                self.top_logprobs[slot] = r.top_logprobs
                self.special[slot] = r.processors is not None or r.grammar_bitmask is not None
