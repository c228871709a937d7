"""The persistent batch's sampling settings (runner/host_sampling.py) through the step layout:
a slot's settings are written when another row takes it, and every step gathers the right ones."""

import numpy as np

from jaxserve.core.plan import ProcessorRow, SamplingRow, ScheduledChunk, StepPlan
from jaxserve.runner.batch import build_step_inputs
from jaxserve.runner.buckets import BucketTable
from jaxserve.runner.host_page_tables import HostPageTables
from jaxserve.runner.host_sampling import HostSamplingRows

BUCKETS = BucketTable.build(64, 8, 64, 16, (8, 64), (8,))
NUM_SLOTS = 9  # max_num_seqs 8 + slot 0


def _chunk(rid: str, slot: int, row: SamplingRow | None, index: int = 3) -> ScheduledChunk:
    return ScheduledChunk(rid, (5,), 10, (1,), row, batch_slot=slot, output_index=index)


def _layout(chunks, tables, samplers):
    return build_step_inputs(StepPlan(chunks=chunks), BUCKETS, 16, tables=tables,
                             device_tables=True, samplers=samplers).sampling


def _settings(sp, n):
    return [(float(sp.temperature[i]), int(sp.top_k[i]), float(sp.top_p[i]),
             float(sp.min_p[i]), int(sp.seeds[i]), int(sp.output_index[i]),
             int(sp.sample_slots[i])) for i in range(n)]


def test_persistent_rows_match_a_fresh_layout_as_slots_change_hands():
    tables = HostPageTables(NUM_SLOTS, BUCKETS.max_pages_per_request, 8)
    samplers = HostSamplingRows(NUM_SLOTS + 8)
    a, b = SamplingRow(0.7, 5, 0.9, 0.05, 11, 2), SamplingRow(0.0, 0, 1.0, 0.0, 12)
    c = SamplingRow(1.3, 0, 0.5, 0.0, 13)
    steps = [[_chunk("a", 1, a, 4), _chunk("b", 2, b, 7)],
             [_chunk("a", 1, a, 5), _chunk("b", 2, b, 8)],
             [_chunk("c", 2, c, 0), _chunk("a", 1, a, 6)],      # c takes b's slot
             [_chunk("a", 1, a, 7), _chunk("x", 0, b, 9)]]      # a row without a slot
    for chunks in steps:
        got = _layout(chunks, tables, samplers)
        want = build_step_inputs(StepPlan(chunks=chunks), BUCKETS, 16).sampling
        assert _settings(got, len(chunks)) == _settings(want, len(chunks))
        assert bool(got.any_sampling) == bool(want.any_sampling) is True
        assert bool(got.any_top_logprobs) == (a in [ch.sampling for ch in chunks])
    assert _settings(got, 2)[0] == (np.float32(0.7), 5, np.float32(0.9), np.float32(0.05), 11,
                                    7, 1)


def test_rows_without_sampling_and_per_step_processor_rows():
    tables = HostPageTables(NUM_SLOTS, BUCKETS.max_pages_per_request, 8)
    samplers = HostSamplingRows(NUM_SLOTS + 8)
    plain = SamplingRow(0.0, 0, 1.0, 0.0, 1)
    for penalty in (1.5, 2.0):  # a processor row is new every step: its slot is rewritten
        proc = SamplingRow(0.5, 0, 1.0, 0.0, 2, 0, ProcessorRow(3, 0.0, 0.0, penalty, False,
                                                                 (), None))
        chunks = [_chunk("p", 1, plain), _chunk("q", 2, proc),
                  ScheduledChunk("r", (5, 6, 7), 0, (4,), None, batch_slot=3)]  # a prefill
        sp = _layout(chunks, tables, samplers)
        assert float(sp.repetition_penalty[1]) == penalty and int(sp.processor_slot[1]) == 3
        assert bool(sp.any_processors) and not bool(sp.any_top_logprobs)
        assert float(sp.temperature[2]) == 0.0  # the prefill row samples nothing
        assert bool(sp.any_sampling)  # q samples at 0.5
