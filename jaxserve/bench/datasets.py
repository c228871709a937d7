"""Request sets for the serving benchmark: random, anyscale, shared-prefix and chat.

The token-id sets come from workloads.py; `chat` reads the bundled hand-written prompts
(data/chat_prompts.jsonl) and sends them as chat messages, so the server applies the model's
chat template. Pure Python and numpy, deterministic for a seed; no gRPC, no jax.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxserve.bench.workloads import build_workload

DATASETS = ("random", "anyscale", "shared-prefix", "chat")
CHAT_PROMPTS_PATH = Path(__file__).resolve().parent / "data" / "chat_prompts.jsonl"


@dataclass(frozen=True)
class ServeRequest:
    """One benchmark request: exactly one of prompt_token_ids and messages."""
    max_tokens: int
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[dict, ...] | None = None


def load_chat_prompts(path: str | Path | None = None) -> list[dict]:
    """Records {"messages": [{"role", "content"}, ...], "output_len": int}, in file order."""
    records = []
    with open(path or CHAT_PROMPTS_PATH, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not record.get("messages") or int(record.get("output_len", 0)) < 1:
                raise ValueError(f"{path or CHAT_PROMPTS_PATH}:{line_no}: a record needs "
                                 f"non-empty 'messages' and 'output_len' >= 1")
            records.append(record)
    return records


def vary_lengths(length: int, num: int, range_ratio: float, rng) -> list[int]:
    """`num` lengths uniform in [length * (1 - r), length * (1 + r)], each >= 1 (vLLM's
    --random-range-ratio); r = 0 gives `length` for all."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio={range_ratio} is invalid: must be in [0, 1)")
    lo = max(1, int(round(length * (1 - range_ratio))))
    hi = max(lo, int(round(length * (1 + range_ratio))))
    return rng.integers(lo, hi + 1, num).tolist()


def chat_requests(num_requests: int, seed: int = 0, output_len: int | None = None,
                  range_ratio: float = 0.0, path=None) -> list[ServeRequest]:
    """Prompts drawn in a seeded random order (cycling when more are asked for than exist);
    max_tokens is each record's output_len unless output_len is given."""
    records = load_chat_prompts(path)
    rng = np.random.default_rng(seed)
    order = np.concatenate([rng.permutation(len(records))
                            for _ in range(-(-num_requests // len(records)))])[:num_requests]
    picked = [records[int(i)] for i in order]
    if output_len is None:
        lengths = [int(r["output_len"]) for r in picked]
    else:
        lengths = vary_lengths(output_len, num_requests, range_ratio, rng)
    return [ServeRequest(n, messages=tuple(dict(m) for m in r["messages"]))
            for r, n in zip(picked, lengths)]


def token_requests(name: str, num_requests: int, vocab_size: int, seed: int = 0,
                   input_len: int = 128, output_len: int = 128,
                   range_ratio: float = 0.0) -> list[ServeRequest]:
    """random / anyscale / shared-prefix as token ids (workloads.py); range_ratio varies the
    output lengths of random and shared-prefix (anyscale draws its own)."""
    workload = build_workload(name, num_requests, vocab_size, seed, input_len, output_len)
    lengths = [r.max_tokens for r in workload]
    if name != "anyscale" and range_ratio > 0:
        lengths = vary_lengths(output_len, num_requests, range_ratio,
                               np.random.default_rng(seed + 1))
    return [ServeRequest(n, prompt_token_ids=tuple(r.prompt_token_ids))
            for r, n in zip(workload, lengths)]


def build_requests(dataset: str, num_requests: int, vocab_size: int, seed: int = 0,
                   input_len: int = 128, output_len: int | None = None,
                   range_ratio: float = 0.0, path=None) -> list[ServeRequest]:
    if dataset == "chat":
        return chat_requests(num_requests, seed, output_len, range_ratio, path)
    if dataset in DATASETS:
        return token_requests(dataset, num_requests, vocab_size, seed, input_len,
                              128 if output_len is None else output_len, range_ratio)
    raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}")
