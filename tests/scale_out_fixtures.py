"""Shared by the scale-out tests and their subprocesses: a tiny GQA model saved as a jaxserve
checkpoint, the lean engine settings, and the mixed greedy requests whose tokens are compared.

The model has 8 query heads and 4 KV heads (so tensor parallelism 2 and 4 both hold whole
heads) and the 270-token test vocabulary (so tp=2 splits the vocabulary and tp=4 keeps it
replicated: both rules run).
"""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np

from conftest import SMALL_ENGINE

# One (T, S) bucket and a short max_model_len: each engine compiles one step and few swap
# copies, so building an engine per tensor-parallel size stays cheap on two cores.
LEAN_ENGINE = {**SMALL_ENGINE, "max_model_len": 128, "num_pages": 20, "token_buckets": (32,),
               "seq_buckets": (16,)}


def save_tiny_checkpoint(directory: str | Path, **overrides) -> Path:
    from model_fixtures import random_model, tiny_tokenizer

    from jaxserve.model.loaders.checkpoint import save_checkpoint
    from jaxserve.model.loaders.weights import LoadedModel

    config, params = random_model(seed=3, **{"num_heads": 8, "num_kv_heads": 4, **overrides})
    save_checkpoint(directory, LoadedModel(config, params, tiny_tokenizer(), "tiny"))
    return Path(directory)


def mixed_requests(n: int = 32, seed: int = 0, vocab: int = 270, max_prompt: int = 60,
                   max_out: int = 24):
    """n prompts (token ids) of 1..max_prompt tokens and greedy params of 1..max_out tokens."""
    from jaxserve import SamplingParams

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, vocab, rng.integers(1, max_prompt + 1)).tolist()
               for _ in range(n)]
    params = [SamplingParams(max_tokens=int(rng.integers(1, max_out + 1)), temperature=0.0,
                             ignore_eos=True) for _ in range(n)]
    return prompts, params


def engine_flags(settings: dict) -> list[str]:
    """LEAN_ENGINE-style settings as `jaxserve` CLI flags."""
    flags = []
    for name, value in settings.items():
        values = value if isinstance(value, tuple) else (value,)
        if name in ("swap_space", "kv_cache_memory"):  # bytes: a plain number is vLLM's unit
            values = (f"{value}B",)
        flags += ["--" + name.replace("_", "-"), *(str(v) for v in values)]
    return flags


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
