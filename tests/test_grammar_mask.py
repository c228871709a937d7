"""apply_bitmask in jnp against a numpy reference: disallowed tokens at -inf on masked rows,
rows without a mask untouched, a vocab that is not a multiple of 32, and the lax.cond variant."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runner.grammar_mask import apply_bitmask, maybe_apply_bitmask, unpack_bitmask


def numpy_apply(logits, bitmask, has_mask):
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
    allowed = bits[:, :logits.shape[1]].astype(bool) | ~has_mask[:, None]
    return np.where(allowed, logits, -np.inf).astype(np.float32)


def random_case(rows, vocab, seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    words = (vocab + 31) // 32
    bitmask = rng.integers(-2**31, 2**31, size=(rows, words), dtype=np.int64).astype(np.int32)
    has_mask = rng.random(rows) < 0.6
    has_mask[0], has_mask[-1] = True, False
    return logits, bitmask, has_mask


@pytest.mark.parametrize("vocab", [64, 1000, 49152 + 13])
def test_apply_bitmask_matches_numpy(vocab):
    logits, bitmask, has_mask = random_case(8, vocab)
    got = np.asarray(jax.jit(apply_bitmask)(logits, bitmask, has_mask))
    np.testing.assert_array_equal(got, numpy_apply(logits, bitmask, has_mask))


def test_rows_without_a_mask_are_untouched_even_with_an_all_zero_bitmask():
    logits, _, _ = random_case(4, 100)
    bitmask = np.zeros((4, 4), dtype=np.int32)
    has_mask = np.array([False, True, False, True])
    got = np.asarray(apply_bitmask(logits, bitmask, has_mask))
    np.testing.assert_array_equal(got[[0, 2]], logits[[0, 2]])
    assert np.isneginf(got[[1, 3]]).all()


def test_sign_bit_is_token_31_of_its_word():
    bitmask = np.array([[np.int32(-2**31), 1]], dtype=np.int32)  # tokens 31 and 32
    allowed = np.asarray(unpack_bitmask(jnp.asarray(bitmask), 64))[0]
    assert np.nonzero(allowed)[0].tolist() == [31, 32]


def test_bitmask_too_narrow_for_the_vocab_is_an_error():
    with pytest.raises(ValueError, match="can't cover a vocab of 65"):
        unpack_bitmask(jnp.zeros((1, 2), jnp.int32), 65)


@pytest.mark.parametrize("any_mask", [True, False])
def test_maybe_apply_bitmask_equals_apply_bitmask(any_mask):
    logits, bitmask, has_mask = random_case(6, 300, seed=1)
    if not any_mask:
        has_mask[:] = False
    got = np.asarray(jax.jit(maybe_apply_bitmask)(logits, bitmask, has_mask))
    np.testing.assert_array_equal(got, numpy_apply(logits, bitmask, has_mask))


def test_host_flag_false_skips_the_mask_whatever_has_mask_says():
    """any_mask is the host's word for the whole batch: False means no row is constrained."""
    logits, bitmask, has_mask = random_case(4, 96, seed=2)
    got = np.asarray(jax.jit(maybe_apply_bitmask)(logits, bitmask, has_mask, np.bool_(False)))
    np.testing.assert_array_equal(got, logits)
    got = np.asarray(jax.jit(maybe_apply_bitmask)(logits, bitmask, has_mask, np.bool_(True)))
    np.testing.assert_array_equal(got, numpy_apply(logits, bitmask, has_mask))
