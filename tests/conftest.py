"""Shared test setup: a persistent XLA compilation cache, and engines shared across tests.

JAX compiles are slow on the CPU, so tests build few engines (module or session scope) with
small bucket tables and reuse them; engines with the same shapes hit the compile cache.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Tests never reach the Hugging Face hub: a hub id not in the cache is an error, not a download
# (tests/test_hub_download.py lifts this only around a mocked hub client).
os.environ["HF_HUB_OFFLINE"] = "1"

# Engine shapes most engine tests share (same shapes -> compile-cache hits across engines).
SMALL_ENGINE = dict(max_num_seqs=16, max_num_batched_tokens=32, max_model_len=512,
                    page_size=16, num_pages=48, token_buckets=(16, 32), seq_buckets=(16,),
                    swap_space=64 << 20)


def make_llm(seed: int = 0, model_overrides: dict | None = None, **settings):
    from jaxserve.entrypoints.llm import LLM
    from tiny_models import tiny_loaded

    loaded = tiny_loaded(seed=seed, **(model_overrides or {}))
    return LLM(loaded=loaded, progress=False, **{**SMALL_ENGINE, **settings})


@pytest.fixture(scope="session")
def small_llm():
    """The default tiny engine; tests must leave it idle (every request finished)."""
    return make_llm()


def _memory_mappings() -> int:
    try:
        with open("/proc/self/maps") as maps:
            return sum(1 for _ in maps)
    except OSError:  # not Linux: no per-process mapping limit to watch
        return 0


@pytest.fixture(autouse=True)
def _release_executables_when_mappings_pile_up():
    """Drop JAX's in-memory executable caches once the process holds many memory mappings.

    Every loaded CPU executable holds mappings, and the jit / op-by-op caches never let go:
    the eager forward passes in test_model.py alone load tens of thousands, and a whole-suite
    run that kept them crossed the kernel's vm.max_map_count (65530) and segfaulted inside
    XLA. Engines keep their own ahead-of-time executables, so shared fixtures are unaffected;
    released jit functions recompile (or hit the persistent cache) when next called."""
    yield
    if _memory_mappings() > 20000:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()
