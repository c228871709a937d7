"""The runner's persistent per-slot state (runner/input_batch.py) through the step layout.

Page tables cross from the scheduler as diffs (row_layout.page_update) and are kept by batch
slot (runner/page_tables.py), each request's slot the runner's (runner/batch_rows.py): any
sequence of changes leaves each slot's row equal to the request's table; on the device a step
sends only the rows that changed, the step's gathered [S, P] table equals each request's own,
rows beyond what a step carries go through the overflow scatter, and nothing compiles after
warm-up. Sampling settings by slot: a
slot's settings are written when another row takes it, and every step gathers the right ones."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve.model.decoder import pytrees  # noqa: E402,F401  (the step inputs as pytrees)
from hypothesis import given, settings, strategies as st  # noqa: E402

from jaxserve.core.plan import (PageUpdate, ProcessorRow, SamplingRow,  # noqa: E402
                                ScheduledChunk, StepPlan)
from jaxserve.core.row_layout import page_update  # noqa: E402
from jaxserve.runner import input_batch  # noqa: E402
from jaxserve.runner.buckets import BucketTable  # noqa: E402
from jaxserve.runner.compile_count import CompileCounter  # noqa: E402
from jaxserve.runner.input_batch import DevicePageTables, InputBatch  # noqa: E402
from jaxserve.runner.page_tables import HostPageTables  # noqa: E402
from jaxserve.runner.prepare_inputs import build_step_inputs  # noqa: E402

PAGE_SIZE, MAX_SEQS = 4, 40
BUCKETS = BucketTable.build(64, MAX_SEQS, 32, PAGE_SIZE, (64,), (MAX_SEQS,))
P = BUCKETS.max_pages_per_request


def decode_plan(lengths, sent, first_page=1, ids=None, released=()):
    """One decode chunk per request (ids, default r0, r1, ...), request i owning pages
    first_page + 8i ...; sent: request id -> the table its row last got (the scheduler's side
    of the diffs); released: requests that left their rows before this plan. Returns (plan,
    tables)."""
    for rid in released:
        sent.pop(rid, None)
    chunks, tables = [], []
    for i, n in enumerate(lengths):
        rid = f"r{i}" if ids is None else ids[i]
        pages = tuple(range(first_page + 8 * i, first_page + 8 * i + -(-n // PAGE_SIZE)))
        update = page_update(sent.get(rid), pages)
        sent[rid] = pages
        chunks.append(ScheduledChunk(rid, (5,), n - 1, update, None))
        tables.append(pages)
    return StepPlan(chunks=chunks, released=list(released)), tables


def layout(plan, batch):
    return build_step_inputs(plan, BUCKETS, PAGE_SIZE, batch=batch)


def test_a_step_sends_only_the_rows_that_changed():
    batch, sent = InputBatch(MAX_SEQS, P), {}
    lengths = [3, 4, 9]
    first = layout(decode_plan(lengths, sent)[0], batch)
    slots = [batch.rows.row_of[f"r{i}"] for i in range(3)]
    assert first.attention.page_table is None, "the whole table was sent"
    assert list(first.tables.update_slots[:3]) == slots
    plan = decode_plan(lengths, sent)[0]
    assert all(c.pages is None for c in plan.chunks), "unchanged tables crossed again"
    same = layout(plan, batch)
    assert not same.tables.update_slots.any(), "unchanged rows were sent again"
    plan = decode_plan([3, 5, 9], sent)[0]  # request 1 gains its second page
    assert plan.chunks[1].pages == PageUpdate(1, (10,))
    grown = layout(plan, batch)
    assert list(grown.tables.update_slots[:2]) == [slots[1], 0]
    assert list(grown.tables.update_rows[0, :2]) == [9, 10]
    assert list(grown.tables.slots[:3]) == slots


def test_the_device_table_of_a_step_equals_each_requests_own_table():
    batch, sent = InputBatch(MAX_SEQS, P), {}
    device = batch.device_tables
    apply = jax.jit(input_batch.apply_table_updates)
    rng = np.random.default_rng(0)
    live = []
    for step in range(6):  # admissions beyond a step's own updates go through the overflow
        keep = [rid for rid in live if rng.random() < 0.5][:MAX_SEQS - 1]  # others leave
        released = [rid for rid in live if rid not in keep]
        num_new = int(rng.integers(1, MAX_SEQS - len(keep) + 1))
        live = keep + [f"s{step}r{i}" for i in range(num_new)]
        n = len(live)
        plan, tables = decode_plan(rng.integers(1, 30, n), sent, first_page=step, ids=live,
                                   released=released)
        inputs = layout(plan, batch)
        batch.write_unsent(batch.unsent_table_rows(len(inputs.tables.update_slots)))
        device.arrays, page_table = apply(device.arrays, inputs.tables)
        for i, table in enumerate(tables):
            row = np.asarray(page_table[i])
            want = list(table) + [0] * (P - len(table))
            assert list(row) == want, f"step {step} request {i}: {row} != {want}"
        assert not np.asarray(page_table[n:]).any(), "padding requests read a non-zero row"


# a table's changes while its request runs: pages gained, leading pages a window released
# (NULL_PAGE in their place), a tail cut (rejected drafts), or a new request in the slot
_CHANGES = st.lists(st.tuples(st.sampled_from(["grow", "release", "cut", "new"]),
                              st.integers(0, 5)), max_size=30)


@settings(max_examples=200, deadline=None)
@given(_CHANGES)
def test_any_sequence_of_page_table_diffs_leaves_the_slot_holding_the_table(changes):
    host, sent, table, fresh = HostPageTables(2, 16), {}, (), iter(range(1, 10_000))
    for kind, k in changes:
        if kind == "grow":
            table = (table + tuple(next(fresh) for _ in range(k)))[:16]
        elif kind == "release":
            released = min(k + sum(p == 0 for p in table), len(table))
            table = (0,) * released + table[released:]
        elif kind == "cut":
            table = table[:max(len(table) - k, 0)]
        else:
            table, sent = tuple(next(fresh) for _ in range(k)), {}
        update = page_update(sent.get(1), table)
        if update is not None:
            assert update.apply(sent.get(1, ())) == table
        sent[1] = table
        host.apply(1, update)
        assert host.tables[1].tolist() == list(table) + [0] * (16 - len(table))
        assert host.lengths[1] == len(table)


def test_overflow_writes_compile_nothing_after_warmup():
    device = DevicePageTables(MAX_SEQS + 1, P)
    device.warmup()
    with CompileCounter() as compiles:
        for n in range(1, MAX_SEQS + 1):  # slots 1..n; the padding writes zeros to scratch 0
            device.write(np.arange(1, n + 1, dtype=np.int32), np.ones((n, P), np.int32))
    assert compiles.count == 0, f"{compiles.count} compilations after warm-up"
    assert np.asarray(device.arrays)[1:].all() and not np.asarray(device.arrays)[0].any()


SAMPLING_BUCKETS = BucketTable.build(64, 8, 64, 16, (8, 64), (8,))
SAMPLING_SEQS = 8  # max_num_seqs (and request rows a step has)


def _chunk(rid: str, row: SamplingRow | None, index: int = 3) -> ScheduledChunk:
    return ScheduledChunk(rid, (5,), 10, PageUpdate.whole((1,)), row, output_index=index)


def _layout(chunks, batch, released=()):
    plan = StepPlan(chunks=chunks, released=list(released))
    return build_step_inputs(plan, SAMPLING_BUCKETS, 16, batch=batch).sampling


def _settings(sp, n):
    return [(float(sp.temperature[i]), int(sp.top_k[i]), float(sp.top_p[i]),
             float(sp.min_p[i]), int(sp.seeds[i]), int(sp.output_index[i])) for i in range(n)]


def test_persistent_rows_match_a_fresh_layout_as_slots_change_hands():
    batch = InputBatch(SAMPLING_SEQS, SAMPLING_BUCKETS.max_pages_per_request)
    a, b = SamplingRow(0.7, 5, 0.9, 0.05, 11, 2), SamplingRow(0.0, 0, 1.0, 0.0, 12)
    c = SamplingRow(1.3, 0, 0.5, 0.0, 13)
    steps = [([_chunk("a", a, 4), _chunk("b", b, 7)], ()),
             ([_chunk("a", a, 5), _chunk("b", b, 8)], ()),
             ([_chunk("c", c, 0), _chunk("a", a, 6)], ("b",)),  # c takes b's slot
             ([_chunk("a", a, 7), _chunk("x", b, 9)], ("c",))]  # x, with b's settings, c's
    for chunks, released in steps:
        got = _layout(chunks, batch, released)
        tables = HostPageTables(SAMPLING_SEQS + 1, SAMPLING_BUCKETS.max_pages_per_request)
        want = build_step_inputs(StepPlan(chunks=chunks), SAMPLING_BUCKETS, 16,
                                 tables=tables).sampling
        assert _settings(got, len(chunks)) == _settings(want, len(chunks))
        slots = [batch.rows.row_of[ch.request_id] for ch in chunks]
        assert got.sample_slots[:len(chunks)].tolist() == slots, "a sample kept off its slot"
        assert bool(got.any_sampling) == bool(want.any_sampling) is True
        assert bool(got.any_top_logprobs) == (a in [ch.sampling for ch in chunks])
    assert batch.rows.row_of == {"a": 1, "x": 2}, "c and then x took b's freed slot"
    assert _settings(got, 2)[0] == (np.float32(0.7), 5, np.float32(0.9), np.float32(0.05), 11,
                                    7)


def test_rows_without_sampling_and_per_step_processor_rows():
    batch = InputBatch(SAMPLING_SEQS, SAMPLING_BUCKETS.max_pages_per_request)
    plain = SamplingRow(0.0, 0, 1.0, 0.0, 1)
    for penalty in (1.5, 2.0):  # a processor row is new every step: its slot is rewritten
        proc = SamplingRow(0.5, 0, 1.0, 0.0, 2, 0, ProcessorRow(3, 0.0, 0.0, penalty, False,
                                                                 (), None))
        chunks = [_chunk("p", plain), _chunk("q", proc),
                  ScheduledChunk("r", (5, 6, 7), 0, PageUpdate.whole((4,)), None)]  # a prefill
        sp = _layout(chunks, batch)
        assert float(sp.repetition_penalty[1]) == penalty and int(sp.processor_slot[1]) == 3
        assert bool(sp.any_processors) and not bool(sp.any_top_logprobs)
        assert float(sp.temperature[2]) == 0.0  # the prefill row samples nothing
        assert bool(sp.any_sampling)  # q samples at 0.5
