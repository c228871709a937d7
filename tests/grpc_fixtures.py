"""The gRPC tests' shared server: one in-process ServerThread around an AsyncEngine with the
tiny model (`served`, module-scoped), and waits on it. Imported by test_grpc*.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import SMALL_ENGINE
from jaxserve import SamplingParams
from jaxserve.entrypoints.grpc.client import JaxServeClient

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def served():
    from tiny_models import tiny_loaded

    yield from serve(tiny_loaded())


def serve(loaded):
    """A server around an AsyncEngine of `loaded` (SMALL_ENGINE shapes), yielded as a namespace
    of engine, async_engine, server, client; stopped after the yield (a fixture's body)."""
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.config import EngineConfig
    from jaxserve.engine.engine import Engine
    from jaxserve.entrypoints.grpc.background import ServerThread

    engine = Engine(EngineConfig.from_kwargs(**SMALL_ENGINE), loaded=loaded, progress=False)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    server = ServerThread(async_engine, "127.0.0.1", 0)
    client = JaxServeClient(server.address, timeout=60.0)
    yield SimpleNamespace(engine=engine, async_engine=async_engine, server=server, client=client)
    client.close()
    server.stop(timeout=1.0)
    async_engine.stop(timeout=10.0)


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def wait_until_idle(engine, timeout: float = 10.0) -> None:
    """Every request finished and every page back in the pool, or fail."""
    free = lambda: engine.pages.stats().num_free == engine.pages.stats().num_pages  # noqa: E731
    assert wait_for(lambda: not engine.has_unfinished() and free(), timeout), (
        f"not idle after {timeout} s: {engine.has_unfinished()=}, {engine.pages.stats()}")


def mixed_prompts(n: int, seed: int = 0):
    """Half text prompts, half token-id prompts, with varied lengths and max_tokens."""
    rng = np.random.default_rng(seed)
    ids = [rng.integers(3, 128, int(rng.integers(1, 60))).tolist() for _ in range(n)]
    prompts = [p if i % 2 else "".join(chr(32 + t % 90) for t in p) for i, p in enumerate(ids)]
    params = [SamplingParams(max_tokens=int(rng.integers(1, 40)), **GREEDY) for _ in range(n)]
    return prompts, params
