"""Speculative decoding, host side: the n-gram proposer, the policy, and the scheduler's
bookkeeping of draft rows (rollback of rejected slots, stops inside an accepted run)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jaxserve.core.plan import StepResult
from jaxserve.core.page_manager import PageManager
from jaxserve.core.request import FinishReason, Request, SamplingParams
from jaxserve.core.scheduler import Scheduler
from jaxserve.spec.ngram import NgramProposer
from jaxserve.spec.policy import PROBE_INTERVAL, SpeculationPolicy


# ---- n-gram proposer ---------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_occurrence_of_the_suffix():
    ngram = NgramProposer(1, 3)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 1, 5, 6, 8, 2, 5, 6]
    assert ngram.propose(tokens, 3) == (8, 2, 5), "the latest '5 6' is at 4, followed by 8 2 5"
    assert ngram.propose(tokens, 1) == (8,)


def test_ngram_prefers_the_longest_matching_suffix():
    ngram = NgramProposer(1, 3)
    tokens = [1, 2, 3, 9, 7, 3, 4, 1, 2, 3]  # '3' last recurs at 5 (-> 4), '1 2 3' at 0 (-> 9)
    assert ngram.propose(tokens, 2) == (9, 7)
    assert NgramProposer(1, 1).propose(tokens, 2) == (4, 1)


def test_ngram_continues_a_repeating_suffix_with_its_period():
    assert NgramProposer(1, 2).propose([4, 5, 6, 4, 5, 6, 4, 5], 5) == (6, 4, 5, 6, 4)
    assert NgramProposer(1, 2).propose([3, 3, 3], 4) == (3, 3, 3, 3)


def test_ngram_proposes_nothing_without_a_recurring_suffix():
    ngram = NgramProposer(2, 4)
    assert ngram.propose([1, 2, 3, 4, 5], 4) == ()
    assert ngram.propose([1, 2, 1, 2], 0) == ()
    assert ngram.propose([7], 3) == ()


# ---- policy ------------------------------------------------------------------------------
def test_policy_fixed_batch_size_rule():
    policy = SpeculationPolicy("ngram", 4, disable_by_batch_size=2)
    assert [policy.should_speculate(b) for b in (0, 1, 2, 3)] == [False, True, True, False]
    assert policy.stats.num_skipped_steps == 1


def test_policy_measured_rule_follows_cost_and_acceptance():
    policy = SpeculationPolicy("draft", 4)
    policy.set_step_costs({1: 1.1, 2: 1.5, 4: 2.5, 8: 4.5})
    assert policy.max_batch_size() == 2, "prior of 1 accepted draft: pays while cost < 2x"
    for _ in range(60):  # every verification accepts all 4 drafts
        policy.record_step([(4, 4), (4, 4)])
    assert policy.max_batch_size() == 8
    for _ in range(60):  # nothing is accepted any more
        policy.record_step([(4, 0)])
    assert policy.max_batch_size() == 0 and not policy.should_speculate(1)
    probes = [policy.should_speculate(1) for _ in range(2 * PROBE_INTERVAL)]
    assert sum(probes) == 2, "a refusing policy must still probe the acceptance now and then"
    stats = policy.stats
    assert stats.num_verifications == 180 and stats.num_accepted_tokens == 480
    policy.set_step_costs({1: 6.0})
    assert not any(policy.should_speculate(1) for _ in range(2 * PROBE_INTERVAL)), \
        "probed a batch size where even full acceptance cannot pay"
    assert stats.acceptance_rate == pytest.approx(480 / 720)


def test_draft_policy_proposes_device_rows_capped_by_k():
    policy = SpeculationPolicy("draft", 3)
    assert policy.propose([1, 2, 3], 10) == (3, ())
    assert policy.propose([1, 2, 3], 2) == (2, ())
    assert policy.propose([1, 2, 3], 0) == (0, ())


# ---- scheduler bookkeeping ---------------------------------------------------------------
def make_scheduler(page_size=2, num_pages=40, k=4):
    pages = PageManager(num_pages, page_size)
    policy = SpeculationPolicy("ngram", k, disable_by_batch_size=8)
    return Scheduler(pages, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                     speculation=policy), pages, policy


def run_prefill(sched, prompt, first_token, **params):
    sched.add(Request("r", list(prompt), SamplingParams(temperature=0, **params), seed=0))
    plan = sched.schedule()
    assert not plan.drafts, "a prefill chunk never carries drafts"
    sched.update(plan, StepResult(np.array([first_token]), np.array([0.0], np.float32)))
    return sched.requests["r"]


def verify(sched, emitted):
    """One speculative step whose verification returned `emitted` (then -1 padding)."""
    plan = sched.schedule()
    chunk = plan.chunks[0]
    draft = plan.drafts[chunk.request_id]
    row = np.full((1, draft.num_tokens + 1), -1, np.int32)
    row[0, :len(emitted)] = emitted
    events = sched.update(plan, StepResult(row, np.zeros(row.shape, np.float32)))
    return chunk, draft, events[-1]  # (after the decode rows' DecodeTokens)


def test_rejected_drafts_give_back_their_slots_and_stay_out_of_the_prefix_cache():
    sched, pages, policy = make_scheduler()
    request = run_prefill(sched, [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], first_token=3, max_tokens=20)
    chunk, draft, event = verify(sched, [4, 1, 9])  # drafts 4 1 2 3: two accepted, then 9
    assert chunk.token_ids == (3,) and draft.token_ids == (4, 1, 2, 3)
    assert pages.num_slots("r") == 15 - 2, "slots of the 2 rejected drafts were not given back"
    assert len(pages.page_table("r")) == 7, "the page holding only rejected drafts was kept"
    assert request.num_computed_tokens == 13 and request.output_token_ids == [3, 4, 1, 9]
    assert event.new_token_ids == (4, 1, 9)
    cached = pages.lookup_prefix(request.prompt_token_ids + [3, 4, 1, 2, 3, 0])
    assert len(cached) * pages.page_size <= 13, "a page with a rejected draft was cached"
    assert (policy.stats.num_draft_tokens, policy.stats.num_accepted_tokens) == (4, 2)
    pages.check_invariants()


@pytest.mark.parametrize("stop, emitted, want, reason", [
    (dict(stop_token_ids=(1,)), [4, 1, 2, 3, 4], (4, 1), FinishReason.STOP),
    (dict(max_tokens=3), [4, 1], (4, 1), FinishReason.LENGTH),
])
def test_a_stop_inside_an_accepted_run_ends_the_output_there(stop, emitted, want, reason):
    sched, pages, _ = make_scheduler()
    params = dict(max_tokens=20, ignore_eos=True)
    params.update(stop)
    request = run_prefill(sched, [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], first_token=3, **params)
    _, draft, event = verify(sched, emitted)
    assert event.new_token_ids == want and event.finish_reason == reason
    assert request.output_token_ids == [3, *want] and request.is_finished
    if "max_tokens" in stop:
        assert draft.num_tokens == 1, "drafts beyond max_tokens were proposed"
    assert pages.stats().num_free == pages.stats().num_pages
    pages.check_invariants()


def test_drafts_leave_every_other_running_request_its_decode_row():
    pages = PageManager(64, 4)
    policy = SpeculationPolicy("draft", 8, disable_by_batch_size=8)
    sched = Scheduler(pages, max_num_seqs=4, max_num_batched_tokens=12, max_model_len=64,
                      speculation=policy)
    for i in range(4):
        sched.add(Request(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=30, temperature=0),
                          seed=0))
    plan = sched.schedule()
    sched.update(plan, StepResult(np.arange(4), np.zeros(4, np.float32)))
    plan = sched.schedule()
    assert len(plan.chunks) == 4, "a decode row was crowded out by drafts"
    assert plan.num_tokens + plan.num_draft_tokens <= 12
    assert plan.num_drafts_of(plan.chunks[0].request_id) == 12 - 4, (
        "the first request got the spare rows")


@pytest.mark.parametrize("module", ["jaxserve.spec.policy", "jaxserve.spec.ngram",
                                    "jaxserve.spec.spec_inputs", "jaxserve.spec.setup"])
def test_host_side_spec_modules_do_not_import_jax(module):
    import subprocess
    import sys
    code = (f"import sys; import {module}; "
            "assert not [m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib')]")
    repo = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True,
                            text=True)
    assert result.returncode == 0, f"{module} pulls in jax:\n{result.stderr[-2000:]}"
