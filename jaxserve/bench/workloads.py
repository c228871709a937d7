"""Benchmark workloads: lists of (prompt token ids, output length) built from a seed.

Pure numpy: deterministic for a seed, so A/B runs in one benchmark see identical requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def random_workload(num_requests: int, input_len: int, output_len: int, vocab_size: int,
                    seed: int = 0, low_token: int = 3) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    return [BenchRequest(rng.integers(low_token, vocab_size, input_len).tolist(), output_len)
            for _ in range(num_requests)]


def anyscale_workload(num_requests: int, vocab_size: int, seed: int = 0,
                      low_token: int = 3) -> list[BenchRequest]:
    """Input uniform 16-512 tokens; output exponential with mean 128, capped at 512, >= 1."""
    rng = np.random.default_rng(seed)
    reqs = []
    for _ in range(num_requests):
        n_in = int(rng.integers(16, 513))
        n_out = int(min(512, max(1, round(rng.exponential(128)))))
        reqs.append(BenchRequest(rng.integers(low_token, vocab_size, n_in).tolist(), n_out))
    return reqs


def shared_prefix_workload(num_requests: int, prefix_len: int, suffix_len: int,
                           output_len: int, vocab_size: int, seed: int = 0,
                           low_token: int = 3) -> list[BenchRequest]:
    """Many requests that share one long system prompt, each with its own question."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(low_token, vocab_size, prefix_len).tolist()
    return [BenchRequest(prefix + rng.integers(low_token, vocab_size, suffix_len).tolist(),
                         output_len) for _ in range(num_requests)]


def build_workload(name: str, num_requests: int, vocab_size: int, seed: int = 0,
                   input_len: int = 128, output_len: int = 128) -> list[BenchRequest]:
    if name == "random":
        return random_workload(num_requests, input_len, output_len, vocab_size, seed)
    if name == "anyscale":
        return anyscale_workload(num_requests, vocab_size, seed)
    if name == "shared-prefix":
        return shared_prefix_workload(num_requests, 4 * input_len, max(1, input_len // 8),
                                      output_len, vocab_size, seed)
    raise ValueError(f"workload must be random, anyscale or shared-prefix, got {name!r}")
