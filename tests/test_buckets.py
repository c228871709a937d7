"""The step's bucket table: which (T, S) shapes are compiled and which one a step takes."""

from __future__ import annotations

import pytest

from jaxserve.runner.buckets import BucketTable, default_token_buckets


def test_default_token_buckets_start_at_one_and_four_then_powers_of_two_from_16():
    assert default_token_buckets(256) == (1, 4, 16, 32, 64, 128, 256)
    assert default_token_buckets(16) == (1, 4, 16)
    assert default_token_buckets(8) == (1, 4, 8)
    assert default_token_buckets(3) == (1, 3)
    assert default_token_buckets(100) == (1, 4, 16, 32, 64, 100)


def test_default_table_has_one_request_bucket_per_token_bucket():
    table = BucketTable.build(256, 16, 2048, 16)
    assert table.shapes() == [(1, 1), (4, 4), (16, 16), (32, 16), (64, 16), (128, 16),
                              (256, 16)]
    assert table.select(1, 1) == (1, 1)      # one decoding request: the 1-row step
    assert table.select(3, 3) == (4, 4)
    assert table.select(5, 2) == (16, 16)
    assert table.select(200, 16) == (256, 16)


def test_every_possible_step_gets_a_compiled_shape_that_holds_it():
    for table in (BucketTable.build(256, 16, 2048, 16),
                  BucketTable.build(32, 16, 512, 16, (16, 32), (4, 16)),
                  BucketTable.build(16, 1, 2048, 16)):
        top_s = table.seq_buckets[-1]
        for num_tokens in range(1, table.token_buckets[-1] + 1):
            for num_seqs in range(1, min(num_tokens, top_s) + 1):
                t, s = table.select(num_tokens, num_seqs)
                assert (t, s) in table.shapes() and t >= num_tokens and s >= num_seqs


def test_a_step_outside_the_table_raises_naming_the_limit():
    table = BucketTable.build(32, 16, 512, 16)
    with pytest.raises(ValueError, match="num_tokens=33 exceeds the largest bucket 32"):
        table.select(33, 1)
    with pytest.raises(ValueError, match="num_seqs=17 exceeds the largest bucket 16"):
        table.select(32, 17)
    with pytest.raises(ValueError, match="token_buckets top 16 < max_num_batched_tokens 32"):
        BucketTable.build(32, 16, 512, 16, token_buckets=(16,))
