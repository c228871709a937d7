"""GrammarMatcher and fill_batch with the default model's tokenizer: a valid JSON walked token by
token is allowed at every step, a token that breaks it is not, rollback restores the state,
only EOS follows a complete grammar, ids outside the tokenizer are never allowed, and the batch
layout (with and without speculative drafts) matches the single-row masks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structured_fixtures import compiler, tokenizer  # noqa: F401  (fixtures)

from jaxserve.bench.structured_schemas import JSON_SCHEMAS
from jaxserve.structured.compiler import GrammarCompiler
from jaxserve.structured.matcher import bitmask_words, fill_batch, fill_draft_rows
from jaxserve.structured.params import StructuredOutputs

PERSON = StructuredOutputs(json=JSON_SCHEMAS["person"])
PERSON_TEXT = '{"name": "Ada Lovelace", "age": 36}'


def allowed(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool [vocab_size] from one int32 bitmask row."""
    return np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab_size].astype(bool)


def mask_of(matcher) -> np.ndarray:
    row = np.zeros(matcher.num_words, dtype=np.int32)
    matcher.fill_bitmask(row)
    return row


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_every_token_of_a_valid_json_is_allowed_at_its_step(compiler, tokenizer):
    m = compiler.get(PERSON).new_matcher()
    for step, token in enumerate(encode(tokenizer, PERSON_TEXT)):
        ok = allowed(mask_of(m), m.vocab_size)
        assert ok[token], f"step {step}: {tokenizer.id_to_token(token)!r} masked out"
        assert m.accept([token]), f"step {step}: mask allowed a token accept refused"
    assert m.is_accepting() and m.is_stopped()


def test_complete_grammar_allows_only_eos_and_eos_terminates(compiler, tokenizer):
    m = compiler.get(PERSON).new_matcher()
    assert m.accept(encode(tokenizer, PERSON_TEXT))
    ok = allowed(mask_of(m), m.vocab_size)
    assert list(np.nonzero(ok)[0]) == list(tokenizer.eos_token_ids)
    assert not m.is_terminated()
    assert m.accept([tokenizer.eos_token_ids[0]]) and m.is_terminated()
    assert not m.accept(encode(tokenizer, " ")), "nothing follows the EOS"
    assert list(np.nonzero(allowed(mask_of(m), m.vocab_size))[0]) == \
        list(tokenizer.eos_token_ids), "a terminated row still allows EOS, never nothing"


def test_eos_is_not_allowed_before_the_json_is_complete(compiler, tokenizer):
    m = compiler.get(PERSON).new_matcher()
    assert m.accept(encode(tokenizer, '{"name": "Ada"'))
    assert not allowed(mask_of(m), m.vocab_size)[tokenizer.eos_token_ids[0]]
    assert not m.accept([tokenizer.eos_token_ids[0]])


def test_a_token_that_breaks_the_json_is_disallowed_and_refused(compiler, tokenizer):
    m = compiler.get(PERSON).new_matcher()
    assert m.accept(encode(tokenizer, '{"name": "Ada", "age": '))
    before = mask_of(m)
    for text in ['"', "true", "-", "x"]:  # age is an integer from 0 to 130
        (token,) = encode(tokenizer, text)
        assert not allowed(before, m.vocab_size)[token], f"{text!r} allowed for an integer"
        assert not m.accept([token]), f"{text!r} accepted for an integer"
    assert np.array_equal(mask_of(m), before), "a refused token changed the state"
    assert m.error() is None


def test_accept_is_all_or_nothing(compiler, tokenizer):
    m = compiler.get(PERSON).new_matcher()
    good = encode(tokenizer, '{"name"')
    assert not m.accept(good + encode(tokenizer, "}"))
    assert m.num_accepted == 0
    assert m.num_valid(good + encode(tokenizer, "}")) == len(good)


def test_rollback_restores_the_mask(compiler, tokenizer):
    m = compiler.get(PERSON).new_matcher()
    tokens = encode(tokenizer, PERSON_TEXT)
    assert m.accept(tokens[:4])
    at_four = mask_of(m)
    assert m.accept(tokens[4:] + [tokenizer.eos_token_ids[0]]) and m.is_terminated()
    m.rollback(len(tokens) - 4 + 1)
    assert m.num_accepted == 4 and not m.is_terminated()
    assert np.array_equal(mask_of(m), at_four)
    assert m.accept(tokens[4:]) and m.is_stopped(), "the walk resumes after a rollback"


def test_rollback_of_more_than_accepted_is_an_error(compiler, tokenizer):
    m = compiler.get(PERSON).new_matcher()
    m.accept(encode(tokenizer, '{"name"'))
    with pytest.raises(ValueError, match="can't roll back"):
        m.rollback(m.num_accepted + 1)
    assert m.error() is None


def test_grammar_that_may_continue_allows_eos_among_other_tokens(compiler, tokenizer):
    m = compiler.get(StructuredOutputs(regex="[a-z]+")).new_matcher()
    assert m.accept(encode(tokenizer, "abc"))
    ok = allowed(mask_of(m), m.vocab_size)
    assert m.is_accepting() and not m.is_stopped()
    assert ok[tokenizer.eos_token_ids[0]] and ok.sum() > 100


def test_rolling_back_an_eos_reopens_a_grammar_that_may_continue(compiler, tokenizer):
    m = compiler.get(StructuredOutputs(regex="[a-z]+")).new_matcher()
    assert m.accept(encode(tokenizer, "abc"))
    before = mask_of(m)
    assert m.accept([tokenizer.eos_token_ids[0]]) and m.is_terminated()
    m.rollback(1)
    assert not m.is_terminated() and m.num_accepted == len(encode(tokenizer, "abc"))
    assert np.array_equal(mask_of(m), before)
    assert m.accept(encode(tokenizer, "de") + [tokenizer.eos_token_ids[0]])


@pytest.mark.parametrize("extra", [77, -40], ids=["model_vocab_larger", "model_vocab_smaller"])
def test_ids_outside_the_tokenizer_or_model_vocab_are_never_allowed(tokenizer, extra):
    vocab = tokenizer.vocab_size + extra
    c = GrammarCompiler(tokenizer, vocab_size=vocab)
    try:
        m = c.get(StructuredOutputs(regex="(.|\n)*")).new_matcher()
        row = mask_of(m)
        assert row.shape == (bitmask_words(vocab),)
        bits = np.unpackbits(row.view(np.uint8), bitorder="little").astype(bool)
        known = min(vocab, tokenizer.vocab_size)
        assert bits[:known].sum() > known // 2, "an any-text regex allows most tokens"
        assert not bits[known:].any(), f"bits at ids >= {known} are set"
    finally:
        c.close()


def _walked(compiler, tokenizer, so, text):
    m = compiler.get(so).new_matcher()
    assert m.accept(encode(tokenizer, text))
    return m


@pytest.mark.parametrize("parallel", [False, True])
def test_fill_batch_rows_match_single_masks_and_rows_without_a_matcher_are_open(compiler,
                                                                                  tokenizer,
                                                                                  parallel):
    matchers = [_walked(compiler, tokenizer, PERSON, '{"name": "A'), None,
                _walked(compiler, tokenizer, PERSON, '{"name": "Ada", "age": 3'),
                _walked(compiler, tokenizer, StructuredOutputs(choice=["red", "green"]), "gr")]
    singles = [None if m is None else mask_of(m) for m in matchers]
    out = np.zeros((6, matchers[0].num_words), dtype=np.int32)
    has_mask = fill_batch(matchers, out, parallel=parallel)
    assert has_mask.tolist() == [True, False, True, True, False, False]
    for i, single in enumerate(singles):
        if single is not None:
            assert np.array_equal(out[i], single), f"row {i} differs from its single mask"
    assert (out[[1, 4, 5]] == -1).all(), "rows without a matcher allow everything"


def test_fill_batch_with_drafts_masks_each_draft_position_up_to_the_first_rejected(compiler,
                                                                                    tokenizer):
    tokens = encode(tokenizer, PERSON_TEXT)
    a, b = (compiler.get(PERSON).new_matcher() for _ in range(2))
    (bad,) = encode(tokenizer, "}")  # the object can't close before "name"
    k = 3
    drafts = [tokens[:k], [tokens[0], bad, tokens[2]]]
    out = np.zeros((2 * (k + 1), a.num_words), dtype=np.int32)
    has_mask = fill_batch([a, b], out, drafts=drafts)
    assert has_mask.tolist() == [True] * 4 + [True, True, False, False]
    ref = compiler.get(PERSON).new_matcher()
    for j in range(k + 1):
        assert np.array_equal(out[j], mask_of(ref)), f"draft row {j} differs"
        if j < k:
            ref.accept([tokens[j]])
    assert not allowed(out[5], a.vocab_size)[bad], "the rejected draft is masked out"
    assert (out[6:] == -1).all()
    assert a.num_accepted == b.num_accepted == 0, "drafts are rolled back"
    assert np.array_equal(mask_of(a), out[0])


def test_fill_batch_rejects_a_wrong_width(compiler):
    m = compiler.get(PERSON).new_matcher()
    with pytest.raises(ValueError, match="bitmask must be"):
        fill_batch([m], np.zeros((1, m.num_words + 1), dtype=np.int32))


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 30), back=st.integers(0, 30))
def test_rollback_after_any_walk_restores_the_mask_of_that_point(compiler, seed, steps, back):
    """Walk `steps` allowed tokens chosen at random, roll back `back` of them: the mask is the
    one seen when the walk was there."""
    rng = np.random.default_rng(seed)
    m = compiler.get(StructuredOutputs(json=JSON_SCHEMAS["order"])).new_matcher()
    masks = [mask_of(m)]
    for _ in range(steps):
        if m.is_terminated():
            break
        choices = np.nonzero(allowed(masks[-1], m.vocab_size))[0]
        assert m.accept([int(rng.choice(choices))])
        masks.append(mask_of(m))
    back = min(back, m.num_accepted)
    m.rollback(back)
    assert np.array_equal(mask_of(m), masks[len(masks) - 1 - back])


def test_fill_draft_rows_takes_any_row_layout(compiler, tokenizer):
    tokens = encode(tokenizer, PERSON_TEXT)
    a, b = (compiler.get(PERSON).new_matcher() for _ in range(2))
    out = np.zeros((7, a.num_words), dtype=np.int32)
    # a verifies 1 draft at rows 0-1, b verifies 3 at rows 3-6; row 2 belongs to no one
    has_mask = fill_draft_rows([(a, tokens[:1], 0), (b, tokens[:3], 3)], out)
    assert has_mask.tolist() == [True, True, False, True, True, True, True]
    ref = compiler.get(PERSON).new_matcher()
    expected = [mask_of(ref)]
    for t in tokens[:3]:
        ref.accept([t])
        expected.append(mask_of(ref))
    assert np.array_equal(out[0], expected[0]) and np.array_equal(out[1], expected[1])
    for j in range(4):
        assert np.array_equal(out[3 + j], expected[j]), f"b's row {j} differs"
    assert (out[2] == -1).all()
    with pytest.raises(ValueError, match="past the 7 rows"):
        fill_draft_rows([(a, tokens[:3], 5)], out)
