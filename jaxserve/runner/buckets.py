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


def default_token_buckets(max_num_batched_tokens: int, ratio: int = 2) -> tuple[int, ...]:
    """1 and 4 rows, then 16, 16*ratio, 16*ratio**2, ... up to the budget.

    A step's cost on the CPU follows its padded row count: SmolLM2 decoding one request
    measured 47 ms/step at T=1, 58 at T=4 and 94-116 at T=16 (2-core VM), so one or a few
    running requests get buckets of their own; between 4 and 16 the gain no longer pays for a
    compile."""
    small = tuple(b for b in (1, 4) if b < min(16, max_num_batched_tokens))
    sizes, size = [], min(16, max_num_batched_tokens)
    while size < max_num_batched_tokens:
        sizes.append(size)
        size *= ratio
    return small + tuple(sizes) + (max_num_batched_tokens,)


def token_buckets_for(backend: str, max_num_batched_tokens: int) -> tuple[int, ...]:
    """The default token buckets on a backend: every power of two from 16 on accelerators,
    every other one on the CPU (1, 4, 16, 64, 256 for the default budget of 256).

    On the CPU a compile is slow and start-up is mostly compiles: each bucket costs ~12 s cold
    and ~3 s warm (trace + cache read) on the 2-core VM, for SmolLM2. Five buckets instead of
    seven cut both by two sevenths; the price is padding of steps between two buckets (a
    20..64-token step runs at T=64), where the CPU's cost is nearly linear in T."""
    return default_token_buckets(max_num_batched_tokens, 4 if backend == "cpu" else 2)


@dataclass(frozen=True)
class BucketTable:
    token_buckets: tuple[int, ...]  # T: query rows per step
    seq_buckets: tuple[int, ...]    # S: requests per step
    max_pages_per_request: int      # P: page-table width
    # True: each T has the one S bucket min(T, top S) (the default); False: every S up to T.
    seq_bucket_per_token_bucket: bool = False

    @classmethod
    def build(cls, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
              page_size: int, token_buckets=None, seq_buckets=None) -> "BucketTable":
        tokens = tuple(sorted(set(token_buckets))) if token_buckets else default_token_buckets(
            max_num_batched_tokens)
        # Default: one request bucket per token bucket, S = min(T, max_num_seqs). The only
        # per-request work is the logits rows and the sampler, and the head's weight read
        # dominates those at any S <= 64, so more S buckets would buy compiles, not speed.
        tied = not seq_buckets
        seqs = tuple(sorted(set(seq_buckets))) if seq_buckets else tuple(sorted(
            {min(t, max_num_seqs) for t in tokens}))
        if tokens[-1] < max_num_batched_tokens:
            raise ValueError(f"token_buckets top {tokens[-1]} < max_num_batched_tokens "
                             f"{max_num_batched_tokens}")
        if seqs[-1] < max_num_seqs:
            raise ValueError(f"seq_buckets top {seqs[-1]} < max_num_seqs {max_num_seqs}")
        return cls(tokens, seqs, -(-max_model_len // page_size), tied)

    def shapes(self) -> list[tuple[int, int]]:
        """Every (T, S) pair that can occur: a step never has more requests than rows, so
        for each T the S buckets stop at the first one that covers T."""
        if self.seq_bucket_per_token_bucket:
            return [(t, min(t, self.seq_buckets[-1])) for t in self.token_buckets]
        pairs = []
        for t in self.token_buckets:
            for s in self.seq_buckets:
                pairs.append((t, s))
                if s >= t:
                    break
        return pairs

    def select(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        t = _ceil_bucket(self.token_buckets, num_tokens, "num_tokens")
        if self.seq_bucket_per_token_bucket:
            # num_seqs <= num_tokens <= t and num_seqs <= the top S, so this S covers it.
            _ceil_bucket(self.seq_buckets, max(num_seqs, 1), "num_seqs")
            s = min(t, self.seq_buckets[-1])
        else:
            s = _ceil_bucket(self.seq_buckets, max(num_seqs, 1), "num_seqs")
        assert (t, s) in self.shapes() and s >= num_seqs, (t, s, num_seqs)
        return t, s


def _ceil_bucket(buckets: tuple[int, ...], n: int, name: str) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{name}={n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]
