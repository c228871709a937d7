"""Scheduler + PageManager properties over random workloads (hypothesis), no model, no jax.

A fake runner answers every step: the token a row samples is a function of (request id, output
index), so a request's outputs do not depend on batching, chunking or preemption, and some
requests stop early on STOP. Workloads vary the number of requests, their arrival steps,
prompt lengths (with shared prefixes, so the prefix cache is used), max_tokens, the page pool
(small, to force preemption and refusals), page size, max_num_seqs, the step budget, chunked
prefill, preemption mode (recompute; swap with a host swap space from none to ample, so swap
also falls back to recompute), Scheduler(decode_rows=...) and the async one-step lag (step N+1
is planned before step N's tokens are taken in, as the engine does when may_plan_ahead()).

Without chunked prefill the step budget is at least max_model_len (what vLLM requires): the
scheduler refuses a smaller one (a request could wait forever); see the tests at the end. Every
step, the page tables the runner would hold (kept by batch slot from the plans' diffs) equal
the page manager's. The workloads and the fake runner are scheduler_workloads.py's.

Bounds. Lemma: the oldest running request is never preempted (the victim is the newest running
request not yet scheduled this step, and the request asking for a page is always a candidate;
alone, a request always fits, as add() refuses any that could not) and, first in the step with
the whole budget, it computes >= 1 token a step, so it finishes within L = max(P + M) + 2 steps
(P prompt, M output tokens; +1 for the step its last token is in flight, +1 slack). While the
oldest live request G is not running, the requests running (at most max_num_seqs) each finish or
leave within L steps in turn. So each request that is oldest in turn lives at most
(max_num_seqs + 1) * L steps as the oldest, and a request k waits (arrival to first scheduled
row) at most (live requests older than k at its arrival + 1) * (max_num_seqs + 1) * L steps;
the whole workload ends within last arrival + (n + 1) * (max_num_seqs + 1) * L steps.
(The argument is exact for recompute, where nothing joins the running requests while G waits;
with swap, swapped-out requests may come back before G. Over 400 random workloads of both
modes the worst run used about 1/4 of the step bound and 1/5 of the wait bound.)
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from jaxserve.core.page_manager import PageManager
from jaxserve.core.request import FinishReason, Request
from jaxserve.core.scheduler import Scheduler
from scheduler_workloads import (BASE, SETTINGS, STOP, Config, Spec, fake_token, fits_pool,
                                 output_budget, run_workload, step_bound, workloads)


# ---- the properties ---------------------------------------------------------------------
@settings(max_examples=80, **SETTINGS)
@given(workloads())
def test_every_step_stays_within_max_num_batched_tokens_and_max_num_seqs(workload):
    cfg, specs = workload
    run_workload(cfg, specs, check_budgets=True)


@settings(max_examples=80, **SETTINGS)
@given(workloads())
def test_every_request_finishes_by_length_or_stop_or_is_refused_within_bounded_steps(workload):
    cfg, specs = workload
    run = run_workload(cfg, specs)  # raises if the bound on steps is passed
    for spec in specs:
        rid, request = spec.request_id, run.requests[spec.request_id]
        if rid in run.refused:
            assert not fits_pool(cfg, spec), f"{rid} fits the pool but was refused"
            assert rid not in run.first_step, f"refused {rid} got rows in a step"
            continue
        assert fits_pool(cfg, spec), f"{rid} can never fit the pool but was not refused"
        assert request.is_finished, f"{rid} did not finish ({request.status.value})"
        assert run.finishes[rid] == [request.finish_reason], (
            f"{rid}: finish events {run.finishes[rid]}, finished by {request.finish_reason}")
        outputs = request.output_token_ids
        assert run.tokens[rid] == outputs, f"{rid}: the events' tokens differ from its outputs"
        assert outputs == [fake_token(rid, i, spec.stops) for i in range(len(outputs))], (
            f"{rid}: outputs are not the runner's tokens in output order")
        budget = output_budget(cfg, spec)
        if request.finish_reason == FinishReason.LENGTH:
            assert len(outputs) == budget, (
                f"{rid}: finished by length after {len(outputs)} of {budget} tokens")
            assert not spec.stops or STOP not in outputs, (
                f"{rid}: sampled its stop token but finished by length: {outputs}")
        else:
            assert request.finish_reason == FinishReason.STOP, (
                f"{rid}: finished by {request.finish_reason}")
            assert spec.stops and outputs[-1] == STOP and STOP not in outputs[:-1], (
                f"{rid}: stopped without ending on its first stop token: {outputs}")
            assert len(outputs) <= budget


@settings(max_examples=80, **SETTINGS)
@given(workloads(mode="recompute"))
def test_pages_are_conserved_across_recompute_preemption(workload):
    cfg, specs = workload
    run_workload(cfg, specs, check_page_books=True)


@settings(max_examples=80, **SETTINGS)
@given(workloads(mode="swap"))
def test_pages_and_swap_space_are_conserved_across_swap_preemption(workload):
    cfg, specs = workload
    run_workload(cfg, specs, check_page_books=True)


@settings(max_examples=80, **SETTINGS)
@given(workloads())
def test_fcfs_requests_start_in_arrival_order_and_wait_a_bounded_number_of_steps(workload):
    cfg, specs = workload
    run = run_workload(cfg, specs)
    admitted = sorted((r for r in run.requests.values() if r.request_id not in run.refused),
                      key=Request.sort_key)
    for earlier, later in zip(admitted, admitted[1:]):
        a, b = run.first_step[earlier.request_id], run.first_step[later.request_id]
        assert a <= b, (f"{later.request_id} (arrival {later.arrival_seq}) started at step {b}, "
                        f"before {earlier.request_id} (arrival {earlier.arrival_seq}) at {a}")
    per_oldest = (cfg.max_num_seqs + 1) * step_bound(cfg, specs)
    for request in admitted:
        rid = request.request_id
        wait = run.first_step[rid] - run.arrival_step[rid]
        bound = (run.older_live_at_arrival[rid] + 1) * per_oldest
        assert wait <= bound, (f"{rid} waited {wait} steps; bound {bound} with "
                               f"{run.older_live_at_arrival[rid]} older live requests")


@settings(max_examples=80, **SETTINGS)
@given(workloads())
def test_preemption_takes_the_latest_arrived_running_request(workload):
    cfg, specs = workload
    run_workload(cfg, specs, check_preemption_order=True)


# ---- the workloads do reach preemption, swap and refusal --------------------------------
@pytest.mark.parametrize("decode_rows", [False, True])
@pytest.mark.parametrize("lag", [False, True])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_small_pool_preempts_and_still_conserves_pages(mode, lag, decode_rows):
    """The harness on a fixed workload that must preempt (and, with swap, swap out)."""
    cfg = Config(page_size=4, num_pages=9, max_num_seqs=4, budget=16, max_model_len=48,
                 chunked=True, mode=mode, swap_pages=1000, decode_rows=decode_rows, lag=lag)
    # 4 to 7 pages each of the 8, arriving a step apart: they cannot all run at once
    specs = [Spec(f"r{i}", tuple(BASE[:4 + 3 * i]), 12, False, i) for i in range(5)]
    specs.append(Spec("huge", (3,) * 40, 8, False, 1))  # 12 pages > 8: refused
    run = run_workload(cfg, specs, check_budgets=True, check_page_books=True,
                       check_preemption_order=True)
    assert run.refused == {"huge"}
    assert run.num_preemptions > 0, "the small pool should force a preemption"
    assert mode == "recompute" or run.num_swaps > 0, "swap mode should swap out"
    assert all(len(run.tokens[s.request_id]) == 12 for s in specs[:-1])


# ---- without chunked prefill -------------------------------------------------------------
def test_without_chunked_prefill_a_step_budget_below_max_model_len_is_refused():
    """A prompt (or a recompute's prompt + outputs) is prefilled in one step: a smaller budget
    would leave such a request waiting forever, so the scheduler refuses the settings."""
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=16 .* max_model_len \(64\)"):
        Scheduler(PageManager(64, 4), max_num_seqs=4, max_num_batched_tokens=16,
                  max_model_len=64, enable_chunked_prefill=False)


def test_without_chunked_prefill_a_recompute_preempted_request_resumes():
    # "b" is preempted after > 8 outputs and re-prefills prompt + outputs in one step
    cfg = Config(page_size=4, num_pages=9, max_num_seqs=4, budget=64, max_model_len=64,
                 chunked=False, mode="recompute", swap_pages=0, decode_rows=False, lag=False)
    run = run_workload(cfg, [Spec("a", (5,) * 8, 24, False, 0),
                             Spec("b", (6,) * 8, 24, False, 0)])
    assert run.num_preemptions > 0, "the small pool should force a preemption"
