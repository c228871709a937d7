"""BatchRows: which row of the runner's persistent batch state each running request holds.

The runner owns this mapping (as vLLM's InputBatch.req_id_to_index); plans name requests only.
A request gets a row the first time a plan lays it out and keeps it until a plan lists it in
StepPlan.released (it finished or was preempted): its page table, sampling settings and last
sampled token stay in that row between steps (runner/input_batch.py). Row 0 is scratch and
never handed out. Every runner over the same batch state (the plain step, the speculative
verify and the draft's sync step) reads the one BatchRows, and laying a plan out twice (two
steps over one plan) gives the same rows. Plain Python: no jax, no scheduling.
"""

from __future__ import annotations


class BatchRows:
    def __init__(self, num_rows: int):
        """num_rows: rows 1..num_rows for requests (max_num_seqs: the most that run at once)."""
        self.num_rows = num_rows
        self._free = list(range(num_rows, 0, -1))
        self._row_of: dict[str, int] = {}
        self._plan = None  # the last plan whose releases were applied

    @property
    def row_of(self) -> dict[str, int]:
        """Request id -> its row, for every request holding one."""
        return dict(self._row_of)

    def release(self, plan) -> None:
        """Free the rows of plan.released (once per plan: a second call is a no-op)."""
        if plan is self._plan:
            return
        self._plan = plan
        row_of, free = self._row_of, self._free
        for request_id in plan.released:
            row = row_of.pop(request_id, 0)
            if row:
                free.append(row)

    def rows(self, request_ids) -> list[int]:
        """Each request's row, a free one for a request new to the batch."""
        row_of, free = self._row_of, self._free
        out = []
        for request_id in request_ids:  # (per request and step: plain locals)
            row = row_of.get(request_id)
            if row is None:
                if not free:
                    raise ValueError(f"request {request_id} needs a batch row, but all "
                                     f"{self.num_rows} are held (a plan lays out more "
                                     "requests than max_num_seqs, or released none)")
                row = row_of[request_id] = free.pop()
            out.append(row)
        return out
