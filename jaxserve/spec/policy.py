"""SpeculationPolicy: the scheduler's view of speculative decoding. Per step it says whether to
speculate, and per decoding request how many tokens to verify and which (n-gram) or that the
draft model proposes them; it keeps the acceptance statistics.

When to speculate. A step that verifies k drafts for each of B decoding requests runs about
B*(k+1) rows instead of B, and gains the accepted drafts. With `disable_by_batch_size` set, the
rule is fixed: speculate while B <= that size. Otherwise the runner measures at warm-up what one
step costs with and without speculation for every batch size (`set_step_costs`), and the policy
speculates while cost_with / cost_without < 1 + (mean accepted drafts per verification), the
mean being a moving average of what verification actually accepted (it starts at 1). So that a
low estimate cannot switch speculation off for good, one refused step in PROBE_INTERVAL
speculates anyway when full acceptance (k drafts) would pay at that batch size.

Plain host code: it must not import jax, and it never touches pages or requests' state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from jaxserve.core.speculation import max_drafts, no_drafts
from jaxserve.spec.ngram import NgramProposer

_EMA_WEIGHT = 0.1          # weight of one step's mean in the accepted-drafts average
_PRIOR_ACCEPTED = 1.0      # mean accepted drafts per verification before any was measured
PROBE_INTERVAL = 32        # refused steps between two probes of the acceptance


@dataclass
class SpecStats:
    num_verifications: int = 0   # request-steps that verified at least one draft
    num_draft_tokens: int = 0    # drafts proposed and verified
    num_accepted_tokens: int = 0  # drafts the target accepted
    num_spec_steps: int = 0      # steps with at least one verification
    num_skipped_steps: int = 0   # steps with decoding requests where the policy said no

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        """Accepted drafts per verification (each verification also yields one more token)."""
        return self.num_accepted_tokens / self.num_verifications if self.num_verifications else 0.0


class SpeculationPolicy:
    """core/speculation.py's Speculation: the scheduler asks it for each step's drafter."""

    reads_every_result = True  # a step's accepted drafts decide what the next one computes

    def __init__(self, method: str, num_speculative_tokens: int, *,
                 ngram: NgramProposer | None = None, disable_by_batch_size: int | None = None):
        if method not in ("ngram", "draft"):
            raise ValueError(f"speculative method must be ngram or draft, got {method!r}")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1 to speculate, got "
                             f"{num_speculative_tokens}")
        self.method = method
        self.num_speculative_tokens = num_speculative_tokens
        self.ngram = ngram or NgramProposer()
        self.disable_by_batch_size = disable_by_batch_size
        self.stats = SpecStats()
        self.mean_accepted = _PRIOR_ACCEPTED
        self.cost_ratio: dict[int, float] = {}  # batch size -> step cost with / without
        self._refused_since_probe = 0

    # ---- the runner's measurements -------------------------------------------------------
    def set_step_costs(self, cost_ratio: dict[int, float]) -> None:
        """Measured at warm-up: for each batch size B, cost of a speculative step over cost of
        a plain one."""
        self.cost_ratio = dict(cost_ratio)

    def pays(self, num_decoding: int) -> bool:
        """Whether speculating for this many decoding requests pays at the current estimate."""
        if self.disable_by_batch_size is not None:
            return num_decoding <= self.disable_by_batch_size
        if not self.cost_ratio:  # never measured: only the single request, always cheap
            return num_decoding == 1
        return self.cost_ratio.get(num_decoding, float("inf")) < 1.0 + self.mean_accepted

    def max_batch_size(self) -> int:
        """Largest measured batch size that speculates now (0: none)."""
        return max((b for b in self.cost_ratio if self.pays(b)), default=0)

    # ---- the scheduler's questions ---------------------------------------------------------
    def drafter(self, running: Sequence, max_model_len: int, num_plain_only: int):
        """This step's drafter for the scheduler (core/speculation.py): no_drafts while a
        request only plain steps compute is running, or when speculating doesn't pay for the
        requests decoding now."""
        if num_plain_only or not self.should_speculate(sum(
                r.num_scheduled_tokens - r.num_computed_tokens == 1 for r in running)):
            return no_drafts

        def propose(request, remaining: int, room: int) -> tuple[int, tuple[int, ...]]:
            if remaining != 1:  # a prefill chunk: nothing to draft after
                return 0, ()
            return self.propose(request.all_token_ids, max_drafts(request, room, max_model_len))
        return propose

    def should_speculate(self, num_decoding: int) -> bool:
        if num_decoding == 0:
            return False
        if self.pays(num_decoding):
            return True
        full_gain = 1 + self.num_speculative_tokens
        could_pay = self.cost_ratio.get(num_decoding, float("inf")) < full_gain
        if self.disable_by_batch_size is None and could_pay:
            self._refused_since_probe += 1
            if self._refused_since_probe >= PROBE_INTERVAL:
                self._refused_since_probe = 0
                return True
        self.stats.num_skipped_steps += 1
        return False

    def propose(self, token_ids: Sequence[int], max_num: int) -> tuple[int, tuple[int, ...]]:
        """(number of draft rows, their ids) for one decoding request; ids are () when the
        runner's draft model proposes them on the device."""
        max_num = min(max_num, self.num_speculative_tokens)
        if max_num <= 0:
            return 0, ()
        if self.method == "draft":
            return max_num, ()
        drafts = self.ngram.propose(token_ids, max_num)
        return len(drafts), drafts

    # ---- results -------------------------------------------------------------------------
    def record_step(self, verified: Sequence[tuple[int, int]]) -> None:
        """(drafts, accepted drafts) for each request that verified drafts this step."""
        verified = [(n, a) for n, a in verified if n]
        if not verified:
            return
        s = self.stats
        s.num_spec_steps += 1
        s.num_verifications += len(verified)
        s.num_draft_tokens += sum(n for n, _ in verified)
        accepted = sum(a for _, a in verified)
        s.num_accepted_tokens += accepted
        step_mean = accepted / len(verified)
        self.mean_accepted += _EMA_WEIGHT * (step_mean - self.mean_accepted)
