"""The runner owns the request -> row mapping (runner/batch_rows.py), as vLLM's
InputBatch.req_id_to_index: plans name requests and list those that left their rows
(StepPlan.released); the scheduler's Request carries no row or slot of the runner's."""

from __future__ import annotations

import dataclasses

import pytest

from jaxserve.core.page_manager import PageManager
from jaxserve.core.plan import PageUpdate, SamplingRow, ScheduledChunk, StepPlan
from jaxserve.core.request import FinishReason, Request, SamplingParams
from jaxserve.core.scheduler import Scheduler
from jaxserve.runner.batch_rows import BatchRows
from jaxserve.runner.buckets import BucketTable
from jaxserve.runner.page_tables import HostPageTables
from jaxserve.runner.prepare_inputs import build_step_inputs

BUCKETS = BucketTable.build(64, 4, 64, 16, (64,), (4,))


def chunk(rid: str) -> ScheduledChunk:
    return ScheduledChunk(rid, (5,), 0, PageUpdate.whole((1,)), SamplingRow(0.0, 0, 1.0, 0.0, 1))


def test_a_request_keeps_its_row_until_a_plan_releases_it_and_the_row_is_reused():
    rows = BatchRows(3)
    assert rows.rows(["a", "b"]) == [1, 2]
    assert rows.rows(["b", "a"]) == [2, 1], "a running request changed rows"
    rows.release(StepPlan(released=["a"]))
    assert rows.rows(["c"]) == [1], "the freed row was not handed to the next request"
    assert rows.row_of == {"b": 2, "c": 1}


def test_releasing_one_plan_twice_frees_its_rows_once():
    """Two steps over one plan (a draft's sync step, then the plain step) see the same rows."""
    rows = BatchRows(3)
    rows.rows(["a", "b"])
    plan = StepPlan(released=["a"])
    rows.release(plan)
    first = rows.rows(["a"])  # a runs again in the plan that released it: a new row
    rows.release(plan)
    assert rows.rows(["a"]) == first, "a second layout of the plan moved a to another row"


def test_more_requests_than_rows_is_refused_by_name():
    rows = BatchRows(1)
    rows.rows(["a"])
    with pytest.raises(ValueError, match="request b needs a batch row"):
        rows.rows(["b"])


def test_the_layout_gives_rows_from_request_ids_and_frees_released_ones():
    tables = HostPageTables(3, BUCKETS.max_pages_per_request)
    first = build_step_inputs(StepPlan(chunks=[chunk("a"), chunk("b")]), BUCKETS, 16,
                              tables=tables)
    assert first.sampling.sample_slots[:2].tolist() == [1, 2]
    plan = StepPlan(chunks=[chunk("c")], released=["a"])
    second = build_step_inputs(plan, BUCKETS, 16, tables=tables)
    assert second.sampling.sample_slots[0] == 1, "c did not take a's freed row"
    assert tables.rows.row_of == {"b": 2, "c": 1}


def test_a_request_carries_no_row_or_slot_of_the_runner():
    names = {f.name for f in dataclasses.fields(Request)}
    held = names & {"batch_slot", "lora_slot", "sampling_row", "plain_rows", "steady_rows"}
    assert not held, f"Request still carries the runner's {sorted(held)}"
    chunk_names = {f.name for f in dataclasses.fields(ScheduledChunk)}
    assert "batch_slot" not in chunk_names, "plans still name the runner's rows"


def _request(rid: str) -> Request:
    return Request(rid, list(range(3, 9)), SamplingParams(max_tokens=4, temperature=0.0), 0)


def test_the_next_plan_releases_finished_and_preempted_requests():
    scheduler = Scheduler(PageManager(64, 4), max_num_seqs=4, max_num_batched_tokens=64,
                          max_model_len=64)
    for rid in ("a", "b"):
        scheduler.add(_request(rid))
    assert scheduler.schedule().released == []
    scheduler.finish("a", FinishReason.ABORT)
    scheduler.release_all_kv()  # b is preempted outside any plan
    plan = scheduler.schedule()
    assert plan.released == ["a", "b"], f"rows to free: {plan.released}, not a's and b's"
    assert scheduler.schedule().released == [], "a release was sent twice"


def test_a_waiting_request_that_finishes_releases_no_row():
    scheduler = Scheduler(PageManager(64, 4), max_num_seqs=4, max_num_batched_tokens=64,
                          max_model_len=64)
    scheduler.add(_request("a"))
    scheduler.finish("a", FinishReason.ABORT)
    assert scheduler.schedule().released == [], "a request that never ran released a row"
