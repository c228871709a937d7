"""Batching policies: when the scheduler may admit waiting requests, and what padding costs.

Continuous batching (the default) admits whenever there is room and pads nothing. Static
batching keeps the classic padded batch as a baseline for the benchmarks: a new batch is
admitted only when every member of the previous one has finished, all its members at once (their
prompts are read in later steps), and each step is charged the rows a padded batch computes for
nothing (finished members' slots and prompt padding, see plan.StaticPadding). Everything else
(chunking, preemption, paging) is the scheduler's and is shared by both. Plain Python: no jax.
"""

from __future__ import annotations

from typing import Collection, Protocol

from jaxserve.core.plan import StaticPadding
from jaxserve.core.request import Request


class BatchingPolicy(Protocol):
    reads_every_result: bool  # the next step is planned only once this one's results are in

    def begin_step(self, live_ids: Collection[str]) -> None: ...

    def may_admit(self, num_running: int) -> bool: ...

    def admits_more(self, budget: int) -> bool:
        """Whether another waiting request may join with `budget` tokens left this step."""

    def admitted(self, new_batch: list[Request]) -> None: ...

    def padding(self, budget: int, live_ids: Collection[str]) -> StaticPadding | None: ...


class ContinuousBatching:
    reads_every_result = False

    def begin_step(self, live_ids: Collection[str]) -> None:
        pass

    def may_admit(self, num_running: int) -> bool:
        return True

    def admits_more(self, budget: int) -> bool:
        return budget > 0

    def admitted(self, new_batch: list[Request]) -> None:
        pass

    def padding(self, budget: int, live_ids: Collection[str]) -> StaticPadding | None:
        return None


class StaticBatching:
    reads_every_result = True  # (its padding counts the members that finished)

    def __init__(self):
        self._batch: set[str] = set()   # request ids of the current batch
        self._pad_left = 0              # prompt-padding rows not yet charged

    def begin_step(self, live_ids: Collection[str]) -> None:
        if not any(rid in live_ids for rid in self._batch):
            self._batch = set()

    def may_admit(self, num_running: int) -> bool:
        # The next batch waits until every member of this one is done.
        return num_running == 0

    def admits_more(self, budget: int) -> bool:
        return True  # all members at once, even with no token budget left

    def admitted(self, new_batch: list[Request]) -> None:
        if new_batch and not self._batch:
            self._batch = {r.request_id for r in new_batch}
            longest = max(r.num_tokens for r in new_batch)
            self._pad_left = sum(longest - r.num_tokens for r in new_batch)

    def padding(self, budget: int, live_ids: Collection[str]) -> StaticPadding | None:
        """Rows a padded static batch would compute this step, within the token budget."""
        if not self._batch:
            return None
        finished = min(sum(rid not in live_ids for rid in self._batch), budget)
        pad = min(self._pad_left, budget - finished)
        self._pad_left -= pad
        return StaticPadding(num_rows=finished + pad, num_finished_slots=finished)


def make_batching_policy(batching: str) -> BatchingPolicy:
    if batching == "static":
        return StaticBatching()
    if batching == "continuous":
        return ContinuousBatching()
    raise ValueError(f"batching must be 'continuous' or 'static', got {batching!r}")
