"""A plain step's inputs laid out in one buffer (step_layout.py) and sliced back out on the
device (runner/packed_inputs.py) equal the same plan laid out as separate arrays: every field,
its dtype and shape, for a plan that sets every kind of field."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxserve.core.plan import PageUpdate, ProcessorRow, SamplingRow, ScheduledChunk, StepPlan
from jaxserve.runner.buckets import BucketTable
from jaxserve.runner.input_batch import InputBatch
from jaxserve.runner.packed_inputs import unpack
from jaxserve.runner.prepare_inputs import build_step_inputs
from jaxserve.model.decoder.step_layout import StepLayout, layouts_for

BUCKETS = BucketTable.build(64, 8, 64, 16, (8, 64), (8,))
WORDS = 2  # grammar bitmask words per row (a 64-token vocabulary)


def _plan() -> StepPlan:
    bitmask = np.array([0x0F0F0F0F, -2], np.int32).tobytes()
    proc = ProcessorRow(3, 0.25, 0.5, 1.5, True, (7, 9), None)
    whole = PageUpdate.whole  # (each request new to its slot)
    return StepPlan(chunks=[
        ScheduledChunk("a", (5,), 20, whole((1, 2)),
                       SamplingRow(0.7, 5, 0.9, 0.05, 2**32 - 3, 2),
                       token_on_device=True, output_index=4),
        ScheduledChunk("b", (6,), 3, whole((3,)),
                       SamplingRow(0.0, 0, 1.0, 0.0, 12, 0, proc, bitmask),
                       output_index=1),
        ScheduledChunk("c", (8, 9, 10, 11), 0, whole((4,)),
                       SamplingRow(1.2, 0, 0.5, 0.0, 13),
                       prompt_logprobs=2, prompt_logprob_first_row=0,
                       prompt_logprob_next=(9, 10, 11))])


def _build(layouts=None):
    batch = InputBatch(8, BUCKETS.max_pages_per_request)
    return build_step_inputs(_plan(), BUCKETS, 16, mask_words=WORDS, batch=batch,
                             layouts=layouts)


def _fields(inputs):
    """(path, array) of every array field, in order (None fields left out)."""
    out = []
    for group in dataclasses.fields(inputs):
        part = getattr(inputs, group.name)
        for f in dataclasses.fields(part) if part is not None else ():
            value = getattr(part, f.name)
            if value is not None:
                out.append(((group.name, f.name), np.asarray(value)))
    return out


def test_unpacked_on_the_device_equals_the_separate_arrays():
    want = _build()
    packed = _build(layouts_for(BUCKETS.shapes(), BUCKETS.max_pages_per_request, WORDS))
    assert packed.shape == want.shape and packed.words.dtype == np.int32
    assert packed.words.shape == (packed.layout.size,)
    assert packed.grammar_bitmask is packed.views.sampling.grammar_bitmask  # a row has one
    got = jax.jit(unpack)(packed)
    want_fields, got_fields = _fields(want), _fields(got)
    assert [p for p, _ in got_fields] == [p for p, _ in want_fields]
    for (path, w), (_, g) in zip(want_fields, got_fields):
        assert g.dtype == w.dtype and g.shape == w.shape, path
        np.testing.assert_array_equal(g, w, err_msg=str(path))
    # the plan did set the fields a mistake would most likely lose
    sp = want.sampling
    assert sp.has_grammar[1] and sp.suppress_stop[1] and sp.any_prompt_logprobs
    assert sp.seeds[0] == 2**32 - 3 and sp.temperature[0] == np.float32(0.7)
    assert sp.grammar_bitmask[1, 1] == -2 and want.model.token_slots[0] == 1


def test_host_views_write_through_to_the_buffer_and_each_step_gets_a_fresh_one():
    layout = StepLayout(8, 8, 4, 1)
    first, second = layout.new(), layout.new()
    first.views.sampling.temperature[2] = 0.5
    first.views.sampling.any_sampling[...] = True
    first.views.attention.num_seqs[...] = 3
    words = {f.path: f for f in layout.fields}
    t = words[("sampling", "temperature")]
    assert first.words[t.offset + 2:t.offset + 3].view(np.float32)[0] == 0.5
    assert first.words[words[("sampling", "any_sampling")].offset] == 1
    assert first.words[words[("attention", "num_seqs")].offset] == 3
    assert not second.views.sampling.any_sampling and second.views.sampling.temperature[2] == 0
    # the padding defaults of StepInputs.empty: top_p 1, banned -1, the bitmask not packed
    assert second.views.sampling.top_p.tolist() == [1.0] * 8
    assert (second.views.sampling.banned == -1).all()
    assert ("sampling", "grammar_bitmask") not in words and second.grammar_bitmask.shape == (8, 1)
    assert ("attention", "page_table") not in words  # device page tables: not sent
    assert layout == StepLayout(8, 8, 4, 1) and hash(layout) == hash(StepLayout(8, 8, 4, 1))
    assert layout != StepLayout(8, 8, 4, 2)


def test_a_step_without_grammars_makes_no_bitmask():
    layouts = layouts_for(BUCKETS.shapes(), BUCKETS.max_pages_per_request, WORDS)
    batch = InputBatch(8, BUCKETS.max_pages_per_request)
    plan = StepPlan(chunks=[ScheduledChunk("a", (5,), 20, PageUpdate.whole((1, 2)),
                                           SamplingRow(0.0, 0, 1.0, 0.0, 1))])
    packed = build_step_inputs(plan, BUCKETS, 16, mask_words=WORDS, batch=batch,
                               layouts=layouts)
    assert packed.grammar_bitmask is None and not packed.views.sampling.any_grammar


def test_a_field_of_another_width_is_refused():
    from jaxserve.model.decoder.step_layout import _words
    with pytest.raises(TypeError, match="int64"):
        _words(np.zeros(3, np.int64))
