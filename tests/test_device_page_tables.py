"""Page tables kept on the device by batch slot (runner/device_page_tables.py): a step sends
only the rows that changed, the step's gathered [S, P] table equals the host layout's, rows
beyond what a step carries go through the overflow scatter, and nothing compiles after
warm-up."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve.model import pytrees  # noqa: E402,F401  (the step inputs as pytrees)
from jaxserve.core.plan import ScheduledChunk, StepPlan  # noqa: E402
from jaxserve.runner import device_page_tables  # noqa: E402
from jaxserve.runner.batch import build_step_inputs  # noqa: E402
from jaxserve.runner.buckets import BucketTable  # noqa: E402
from jaxserve.runner.compile_count import CompileCounter  # noqa: E402
from jaxserve.runner.device_page_tables import DevicePageTables  # noqa: E402
from jaxserve.runner.host_page_tables import HostPageTables  # noqa: E402

PAGE_SIZE, MAX_SEQS = 4, 40
BUCKETS = BucketTable.build(64, MAX_SEQS, 32, PAGE_SIZE, (64,), (MAX_SEQS,))
P = BUCKETS.max_pages_per_request


def decode_plan(lengths, slots, first_page=1):
    """One decode chunk per request; request i owns pages first_page + 8i ...."""
    chunks = []
    for i, (n, slot) in enumerate(zip(lengths, slots)):
        pages = tuple(range(first_page + 8 * i, first_page + 8 * i + -(-n // PAGE_SIZE)))
        chunks.append(ScheduledChunk(f"r{i}", (5,), n - 1, pages, None, batch_slot=slot))
    return StepPlan(chunks=chunks)


def layout(plan, tables):
    return build_step_inputs(plan, BUCKETS, PAGE_SIZE, tables=tables, device_tables=True)


def test_a_step_sends_only_the_rows_that_changed():
    tables = HostPageTables(MAX_SEQS + 1, P, num_transient=MAX_SEQS)
    lengths, slots = [3, 4, 9], [2, 5, 7]
    first = layout(decode_plan(lengths, slots), tables)
    assert first.attention.page_table is None, "the whole table was sent"
    assert list(first.tables.update_slots[:3]) == slots
    same = layout(decode_plan(lengths, slots), tables)
    assert not same.tables.update_slots.any(), "unchanged rows were sent again"
    grown = layout(decode_plan([3, 5, 9], slots), tables)  # request 1 gains its second page
    assert list(grown.tables.update_slots[:2]) == [5, 0]
    assert list(grown.tables.update_rows[0, :2]) == [9, 10]
    assert list(grown.tables.slots[:3]) == slots


def test_the_device_table_of_a_step_equals_each_requests_own_table():
    tables = HostPageTables(MAX_SEQS + 1, P, num_transient=MAX_SEQS)
    device = DevicePageTables(MAX_SEQS + 1 + MAX_SEQS, P)
    apply = jax.jit(device_page_tables.apply)
    rng = np.random.default_rng(0)
    for step in range(6):  # admissions beyond a step's own updates go through the overflow
        n = int(rng.integers(1, MAX_SEQS))
        slots = [int(s) for s in rng.permutation(np.arange(1, MAX_SEQS + 1))[:n]]
        slots[0] = 0  # a request without a batch slot takes a transient one
        plan = decode_plan(rng.integers(1, 30, n), slots, first_page=step)
        inputs = layout(plan, tables)
        overflow = tables.changed[len(inputs.tables.update_slots):]
        if overflow:
            device.write(np.asarray(overflow, np.int32), tables.tables[overflow])
        device.arrays, page_table = apply(device.arrays, inputs.tables)
        for i, chunk in enumerate(plan.chunks):
            row = np.asarray(page_table[i])
            want = list(chunk.page_table) + [0] * (P - len(chunk.page_table))
            assert list(row) == want, f"step {step} request {i}: {row} != {want}"
        assert not np.asarray(page_table[n:]).any(), "padding requests read a non-zero row"


def test_overflow_writes_compile_nothing_after_warmup():
    device = DevicePageTables(MAX_SEQS + 1, P)
    device.warmup()
    with CompileCounter() as compiles:
        for n in range(1, MAX_SEQS + 1):  # slots 1..n; the padding writes zeros to scratch 0
            device.write(np.arange(1, n + 1, dtype=np.int32), np.ones((n, P), np.int32))
    assert compiles.count == 0, f"{compiles.count} compilations after warm-up"
    assert np.asarray(device.arrays)[1:].all() and not np.asarray(device.arrays)[0].any()
