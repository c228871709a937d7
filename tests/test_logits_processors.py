"""Logits processors (penalties, logit_bias, allowed tokens, bad words, min_tokens) and top-k
logprobs against a numpy reference written from the token histories, on random logits.

The device path is the real one: ProcessorSlots assigns slots and inits, runner/prepare_inputs.py
lays the plan out, init_rows fills the state, and the jitted apply / record / top_logprobs run.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.core.plan import PageUpdate, SamplingRow, ScheduledChunk, StepPlan
from jaxserve.core.processor_slots import ProcessorSlots
from jaxserve.core.request import Request, SamplingParams
from jaxserve.runner import logits_processors as lp
from jaxserve.runner.page_tables import HostPageTables
from jaxserve.runner.prepare_inputs import build_step_inputs
from jaxserve.runner.buckets import BucketTable
from jaxserve.runner.sampler import top_logprobs

V, EOS = 64, 2


def reference(logits, request: Request) -> np.ndarray:
    """vLLM's semantics, one row, from the request's own token lists (EOS: token 2)."""
    sp, out = request.sampling, request.output_token_ids
    x = logits.astype(np.float64).copy()
    if sp.allowed_token_ids is not None:
        mask = np.ones(len(x), bool)
        mask[list(sp.allowed_token_ids)] = False
        x[mask] = -np.inf
    for token, bias in sp.logit_bias:
        x[token] += bias
    for word in request.bad_words_ids:
        if len(word) == 1 or (len(out) >= len(word) - 1
                              and tuple(out[len(out) - len(word) + 1:]) == word[:-1]):
            x[word[-1]] = -np.inf
    if len(out) < sp.min_tokens:
        x[list(sp.stop_token_ids) + ([] if sp.ignore_eos else [EOS])] = -np.inf
    for token in set(request.prompt_token_ids) | set(out):
        x[token] = x[token] / sp.repetition_penalty if x[token] > 0 else \
            x[token] * sp.repetition_penalty
    for token in set(out):
        x[token] -= sp.frequency_penalty * out.count(token) + sp.presence_penalty
    return x


def random_request(rng, i: int) -> Request:
    prompt = rng.integers(3, V, rng.integers(1, 12)).tolist()
    output = rng.integers(3, 12, rng.integers(0, 10)).tolist()  # small ids: repeats
    kwargs = dict(max_tokens=40, temperature=0.0)
    choice = i % 7
    if choice in (0, 6):
        kwargs.update(repetition_penalty=float(rng.uniform(0.5, 2.0)))
    if choice in (1, 6):
        kwargs.update(frequency_penalty=float(rng.uniform(-2, 2)),
                      presence_penalty=float(rng.uniform(-2, 2)))
    if choice in (2, 6):
        kwargs.update(logit_bias={int(t): float(rng.uniform(-100, 100))
                                  for t in rng.choice(V, 5, replace=False)})
    if choice in (3, 6):
        kwargs.update(allowed_token_ids=rng.choice(V, 10, replace=False).tolist())
    if choice == 4:
        kwargs.update(min_tokens=len(output) + 1, stop_token_ids=[7, 9])
    if choice == 5:  # the words' ids are set below, as the engine's tokenizing would
        kwargs.update(bad_words=["w"])
    request = Request(f"r{i}", prompt, SamplingParams(**kwargs), seed=i, eos_token_ids=(EOS,))
    request.output_token_ids.extend(output)
    if choice == 5:  # bad words: one single-token, two ending the output, one not
        ends = tuple(output[-2:]) if len(output) >= 2 else (4, 5)
        request.bad_words_ids = ((13,), ends + (20,), (ends[-1], 21), (60, 61, 22))
    return request


def device_rows(requests, logits):
    """The engine's path: slots, inits, the laid-out batch, apply and top_logprobs."""
    slots = ProcessorSlots(len(requests) + 1)
    chunks = []
    for i, r in enumerate(requests):
        row = SamplingRow(0.0, 0, 1.0, 0.0, r.seed, 5, slots.row(r))
        chunks.append(ScheduledChunk(r.request_id, (3,), i, PageUpdate.whole((1,)), row,
                                     output_index=len(r.output_token_ids)))
    plan, buckets = StepPlan(chunks=chunks), BucketTable.build(64, 16, 64, 16)
    tables = HostPageTables(len(chunks) + 1, buckets.max_pages_per_request)
    inputs = build_step_inputs(plan, buckets, 16, tables=tables)
    arrays = list(lp.empty_arrays(len(requests) + 1, V))
    for chunk in chunks:
        proc = chunk.sampling.processors
        if proc is not None:
            for a, row in zip(arrays, lp.init_rows(proc.init, V)):
                a[proc.slot] = row
    s = inputs.sampling.temperature.shape[0]
    padded = np.zeros((s, V), np.float32)
    padded[:len(requests)] = logits
    processed = jax.jit(lp.apply_if_any)(padded, inputs.sampling, tuple(arrays))
    top = jax.jit(top_logprobs)(processed, inputs.sampling)
    return inputs, tuple(arrays), np.asarray(processed)[:len(requests)], top


def assert_rows_equal(got, want):
    assert np.array_equal(np.isneginf(got), np.isneginf(want)), "masked tokens differ"
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_processor_matches_the_numpy_reference(seed):
    rng = np.random.default_rng(seed)
    requests = [random_request(rng, i) for i in range(14)]
    logits = (3 * rng.standard_normal((len(requests), V))).astype(np.float32)
    _, _, processed, _ = device_rows(requests, logits)
    for i, r in enumerate(requests):
        assert_rows_equal(processed[i], reference(logits[i], r))


def test_top_logprobs_are_the_log_softmax_of_the_processed_logits():
    rng = np.random.default_rng(3)
    requests = [random_request(rng, i) for i in range(7)]
    logits = (3 * rng.standard_normal((len(requests), V))).astype(np.float32)
    _, _, processed, (ids, values) = device_rows(requests, logits)
    ids, values = np.asarray(ids), np.asarray(values)
    for i, r in enumerate(requests):
        x = reference(logits[i], r)
        logsm = x - np.log(np.sum(np.exp(x[np.isfinite(x)] - x.max()))) - x.max()
        order = np.argsort(-logsm, kind="stable")[:ids.shape[1]]
        np.testing.assert_allclose(values[i], logsm[order], rtol=1e-5, atol=1e-5)
        assert np.allclose(logsm[ids[i]], values[i], atol=1e-5)


def test_record_adds_each_sampled_token_to_its_own_row_only():
    rng = np.random.default_rng(4)
    requests = [random_request(rng, i) for i in (0, 1, 3)]  # two use penalties
    inputs, arrays, _, _ = device_rows(requests, np.zeros((3, V), np.float32))
    tokens = np.zeros(inputs.sampling.temperature.shape[0], np.int32)
    tokens[:3] = [5, 6, 7]
    counts = np.asarray(jax.jit(lp.record_if_any)(arrays, inputs.sampling, tokens)[0])
    for i, r in enumerate(requests):
        slot = int(inputs.sampling.processor_slot[i])
        want = np.bincount(r.output_token_ids + [tokens[i]], minlength=V)
        assert slot > 0 and np.array_equal(counts[slot], want), r.request_id


def test_a_batch_without_processors_is_left_untouched():
    rng = np.random.default_rng(5)
    plain = Request("p", [3, 4], SamplingParams(max_tokens=4, temperature=0.0), seed=0)
    logits = rng.standard_normal((1, V)).astype(np.float32)
    inputs, _, processed, (ids, values) = device_rows([plain], logits)
    assert not inputs.sampling.any_processors
    assert np.array_equal(processed, logits)


def test_slots_are_reused_and_refilled_after_release():
    slots = ProcessorSlots(3)
    a = Request("a", [3], SamplingParams(presence_penalty=1.0), seed=0)
    b = Request("b", [4], SamplingParams(presence_penalty=1.0), seed=0)
    first = slots.row(a)
    assert first.init is not None and slots.row(a).init is None, "filled once per admission"
    assert slots.row(b).slot != first.slot
    slots.release("a")
    a.output_token_ids.extend([8, 8])
    again = slots.row(a)
    assert again.init is not None and again.init.output_token_ids == (8, 8)
    assert slots.num_assigned == 2 and 0 not in (again.slot, slots.row(b).slot)


@pytest.mark.parametrize("kwargs, field", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logit_bias={5: 101.0}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(bad_words=[""]), "bad_words"),
    (dict(logprobs=21), "logprobs"),
    (dict(logprobs=-1), "logprobs"),
])
def test_invalid_settings_name_their_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bool_logprobs_keep_their_old_meaning():
    assert SamplingParams(logprobs=True).logprobs == 0
    assert SamplingParams(logprobs=False).logprobs is None
    assert SamplingParams(logprobs=3).top_logprobs == 3


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_end_the_text_with_or_without_themselves(include):
    from model_fixtures import tiny_tokenizer

    from jaxserve.engine.detokenizer import IncrementalDetokenizer

    tok = tiny_tokenizer()
    detok = IncrementalDetokenizer(tok, [], ("in",), include_stop_str=include)
    detok.add_tokens(tok.encode("the sun in the sky", add_special_tokens=False))
    assert detok.stopped
    assert detok.take_delta(final=True) == ("the sun in" if include else "the sun ")


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_are_skipped_in_the_text_unless_asked(skip):
    from model_fixtures import tiny_tokenizer

    from jaxserve.engine.detokenizer import IncrementalDetokenizer

    tok = tiny_tokenizer()
    ids = tok.encode("hi", add_special_tokens=False) + [2]  # <|im_end|>
    detok = IncrementalDetokenizer(tok, [], (), skip_special_tokens=skip)
    detok.add_tokens(ids)
    assert detok.take_delta(final=True) == ("hi" if skip else "hi<|im_end|>")
