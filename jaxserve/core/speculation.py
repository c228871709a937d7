"""The scheduler's speculation seam: what it asks of a speculative-decoding policy, and
NoSpeculation, the policy of an engine that never speculates.

A policy (spec/policy.py's SpeculationPolicy implements this) says each step whether to
speculate for the running requests and proposes each decoding request's draft rows; the
scheduler puts them in the plan (StepPlan.drafts) and update() records what verification
accepted. reads_every_result: whether the next step can only be planned once this one's
results are in (so no async scheduling). Plain Python: no jax.
"""

from __future__ import annotations

from typing import Protocol, Sequence


class Speculation(Protocol):
    method: str | None           # "ngram" (host proposals), "draft" (on device), None
    reads_every_result: bool

    def drafter(self, running: Sequence, max_model_len: int, num_plain_only: int):
        """This step's drafter(request, tokens it has left to compute, room in the step) ->
        (number of draft rows, their ids); no_drafts when the step does not speculate (for
        one, while num_plain_only requests that only plain steps compute are running)."""

    def propose(self, token_ids: Sequence[int], max_num: int) -> tuple[int, tuple[int, ...]]:
        """(number of draft rows, their ids: () when a draft model proposes them)."""

    def record_step(self, verified: list[tuple[int, int]]) -> None:
        """(drafts verified, drafts accepted) of each request that verified drafts."""


def no_drafts(request, remaining: int, room: int) -> tuple[int, tuple[int, ...]]:
    """A step's drafter when it does not speculate."""
    return 0, ()


def max_drafts(request, room: int, max_model_len: int) -> int:
    """Drafts that fit the room left in the step, max_tokens (the bonus token counts) and
    max_model_len."""
    left = request.sampling.max_tokens - len(request.output_token_ids) - 1
    return max(0, min(room, left, max_model_len - request.num_tokens))


class NoSpeculation:
    method = None
    reads_every_result = False

    def drafter(self, running: Sequence, max_model_len: int, num_plain_only: int):
        return no_drafts

    def propose(self, token_ids: Sequence[int], max_num: int) -> tuple[int, tuple[int, ...]]:
        return 0, ()

    def record_step(self, verified: list[tuple[int, int]]) -> None:
        pass


def update_drafts(plan, events, requests, pages, speculation: Speculation) -> None:
    """After a step that verified drafts (plan.drafts): give back the KV slots of the drafts
    that were rejected (the request's tokens are confirmed up to num_computed_tokens), and
    record what each verification accepted. events: the step's TokenEvents of its chunks."""
    if not plan.drafts:
        return
    emitted = {event.request_id: len(event.new_token_ids) for event in events}
    verified = []
    for request_id, draft in plan.drafts.items():
        request = requests.get(request_id)
        if request is None or request_id not in emitted:
            continue  # finished while the step ran
        verified.append((draft.num_tokens, emitted[request_id] - 1))
        pages.truncate(request_id, request.num_computed_tokens)
    speculation.record_step(verified)
