"""The static shapes a step may take: token-count and request-count buckets.

Every bucket is compiled once at start-up; choosing a bucket outside the table is an error,
never a silent recompile. Pure Python, no jax.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


def powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2*lo, ... and finally hi itself if it is not a power of two."""
    sizes, size = [], lo
    while size < hi:
        sizes.append(size)
        size *= 2
    sizes.append(hi)
    return tuple(sizes)


@dataclass(frozen=True)
class BucketTable:
    token_buckets: tuple[int, ...]  # T: query rows per step
    seq_buckets: tuple[int, ...]    # S: requests per step
    max_pages_per_request: int      # P: page-table width

    @classmethod
    def build(cls, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
              page_size: int, token_buckets=None, seq_buckets=None,
              min_token_bucket: int = 16) -> "BucketTable":
        tokens = tuple(sorted(set(token_buckets))) if token_buckets else powers_of_two(
            min(min_token_bucket, max_num_batched_tokens), max_num_batched_tokens)
        # Default: one request bucket per token bucket, S = min(T, max_num_seqs). The only
        # per-request work is the logits rows and the sampler, and the head's weight read
        # dominates those at any S <= 64, so more S buckets would buy compiles, not speed.
        seqs = tuple(sorted(set(seq_buckets))) if seq_buckets else tuple(sorted(
            {min(t, max_num_seqs) for t in tokens}))
        if tokens[-1] < max_num_batched_tokens:
            raise ValueError(f"token_buckets top {tokens[-1]} < max_num_batched_tokens "
                             f"{max_num_batched_tokens}")
        if seqs[-1] < max_num_seqs:
            raise ValueError(f"seq_buckets top {seqs[-1]} < max_num_seqs {max_num_seqs}")
        return cls(tokens, seqs, -(-max_model_len // page_size))

    def shapes(self) -> list[tuple[int, int]]:
        """Every (T, S) pair that can occur: a step never has more requests than rows, so
        for each T the S buckets stop at the first one that covers T."""
        pairs = []
        for t in self.token_buckets:
            for s in self.seq_buckets:
                pairs.append((t, s))
                if s >= t:
                    break
        return pairs

    def select(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        t = _ceil_bucket(self.token_buckets, num_tokens, "num_tokens")
        s = _ceil_bucket(self.seq_buckets, max(num_seqs, 1), "num_seqs")
        assert (t, s) in self.shapes(), (t, s)
        return t, s


def _ceil_bucket(buckets: tuple[int, ...], n: int, name: str) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{name}={n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]
