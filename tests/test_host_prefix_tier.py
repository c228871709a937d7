"""The prefix cache's host tier, on the page manager and the runner's host pool, without a model.

A property test drives the real PageManager (with a HostPrefixTier) and the real HostPrefixPool
over small device KV arrays whose contents stand for KV: the value at (page, slot) is a hash of
the request's tokens up to that position, so a page holds the right KV exactly when its values
equal what a recompute writes. Random sequences of admissions (several per step, sharing
prefixes), growth, finishes, aborts before any KV is computed, and prefix-cache resets evict
pages to the host and bring them back. After every step every page a request reuses (device
or host hit) must hold the recompute's values, and at the end every page is free or cached,
on both sides, with the accounting consistent.
"""

from __future__ import annotations

import hashlib

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from jaxserve.core.host_prefix_tier import HostPrefixTier
from jaxserve.core.page_manager import PageManager
from jaxserve.runner.host_prefix_pool import HostPrefixPool
from jaxserve.runner.swap import KVSwapper

PS, NUM_PAGES = 4, 16
SWAPPER = KVSwapper((1, 2, 4))  # shared: its executables compile once for the whole test


def recompute_value(tokens, position: int) -> float:
    """What 'prefill' writes at position: a function of tokens[:position + 1] only."""
    digest = hashlib.blake2b(repr(tuple(tokens[:position + 1])).encode(), digest_size=3)
    return float(int.from_bytes(digest.digest(), "little"))  # < 2**24: exact in float32


class World:
    """The page manager, the device KV (layers=1, heads=1, dim=1) and the host pool."""

    def __init__(self, host_slots: int):
        self.tier = HostPrefixTier(host_slots * 8, 8)
        self.pm = PageManager(NUM_PAGES, PS, host_tier=self.tier)
        zeros = jnp.zeros((1, NUM_PAGES, PS, 1, 1), jnp.float32)
        self.kv = (zeros, zeros + 0)
        self.pool = HostPrefixPool(host_slots, self.kv, SWAPPER)
        self.tokens: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        self.num_reused: dict[str, int] = {}  # tokens the request got from the cache

    def admit(self, rid: str, tokens: list[int]) -> int | None:
        got = self.pm.allocate(rid, tokens, len(tokens))
        if got is not None:
            self.tokens[rid], self.num_computed[rid], self.num_reused[rid] = tokens, got, got
        return got

    def finish(self, rid: str) -> None:
        self.pm.free(rid)
        for table in (self.tokens, self.num_computed, self.num_reused):
            del table[rid]

    def step(self) -> None:
        """The runner's part before a step: the host-tier copies the plan carries."""
        stores, loads = self.pm.take_prefix_ops()
        self.kv = self.pool.apply(self.kv, stores, loads)

    def compute(self, rid: str, upto: int) -> None:
        """The step: write the recompute's values for positions [computed, upto)."""
        table, tokens = self.pm.page_table(rid), self.tokens[rid]
        for pos in range(self.num_computed[rid], upto):
            value = recompute_value(tokens, pos)
            page, slot = table[pos // PS], pos % PS
            self.kv = tuple(x.at[0, page, slot, 0, 0].set(value) for x in self.kv)
        self.num_computed[rid] = upto
        self.pm.commit(rid, tokens[:upto])

    def check_reused(self, rid: str) -> None:
        """Every reused position holds the recompute's value, in K and in V."""
        table, tokens = self.pm.page_table(rid), self.tokens[rid]
        k, v = (np.asarray(x)[0, :, :, 0, 0] for x in self.kv)
        for pos in range(self.num_reused[rid]):
            want = recompute_value(tokens, pos)
            page, slot = table[pos // PS], pos % PS
            assert k[page, slot] == want and v[page, slot] == want, (rid, pos, page)


# Six pages each (plus a token); 0 and 1 share a page, 2 and 3 two; 4 repeats one page.
PREFIXES = [[7] * 25, [7] * 4 + [8] * 21, list(range(1, 26)), list(range(1, 9)) + [5] * 17,
            [3, 1, 4, 1] * 6 + [5]]

# (prefix, how much of it, extra tokens, whether it stays running after its prefill)
admission = st.tuples(st.integers(0, len(PREFIXES) - 1), st.integers(0, 25), st.integers(0, 6),
                      st.booleans())
admit = st.tuples(st.just("admit"), st.lists(admission, min_size=1, max_size=3))
finish = st.tuples(st.just("finish"), st.integers(0, 7))
ops = st.lists(st.one_of(  # repeated to weigh them: admissions and finishes make evictions
    admit, admit, admit, finish, finish,
    st.tuples(st.just("grow"), st.integers(0, 7)),
    st.tuples(st.just("abort"), st.integers(0, len(PREFIXES) - 1)),
    st.tuples(st.just("reset"), st.integers(0, 9)),  # resets only on 0: they empty both tiers
), min_size=20, max_size=60)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, host_slots=st.sampled_from([2, 5, 16]))
def test_host_tier_keeps_accounting_and_returns_recomputed_kv(ops, host_slots):
    w, serial = World(host_slots), 0
    for op, arg in ops:
        live = sorted(w.tokens)
        if op == "admit":  # several admissions in one step, then the copies, then the step
            admitted = []
            for family, cut, extra, stays in arg:
                tokens = PREFIXES[family][:max(cut, 1)] + [20 + serial % 3] * extra
                rid, serial = f"r{serial}", serial + 1
                if w.admit(rid, tokens) is not None:
                    admitted.append((rid, stays))
            w.step()
            for rid, stays in admitted:
                w.check_reused(rid)
                w.compute(rid, len(w.tokens[rid]))
                if not stays:
                    w.finish(rid)
        elif op == "grow" and live:
            rid = live[arg % len(live)]
            w.tokens[rid].append(30 + arg)
            if w.pm.append_slots(rid, len(w.tokens[rid])):
                w.step()
                w.compute(rid, len(w.tokens[rid]))
            else:
                w.tokens[rid].pop()
        elif op == "finish" and live:
            w.finish(live[arg % len(live)])
        elif op == "abort":  # admitted, then aborted before its KV was computed
            tokens = PREFIXES[arg] + [99]
            if w.pm.allocate("aborted", tokens, len(tokens)) is not None:
                w.step()
                w.pm.free("aborted")
        elif op == "reset" and arg == 0:
            w.pm.reset_prefix_cache()
        w.pm.check_invariants()
    for rid in list(w.tokens):
        w.pm.free(rid)
    w.step()
    w.pm.check_invariants()
    stats = w.pm.stats()
    assert stats.num_free == stats.num_pages  # every device page is free (cached or not)
    assert stats.host.num_used <= host_slots
    event(f"pages loaded from the host: {min(stats.host.loaded_pages, 10)}")


def test_host_hit_comes_back_after_eviction_and_counts_as_cached():
    """The plain story: a prefix evicted from the device is found on the host, loaded into
    fresh pages (over b's old KV there), and its tokens count as cached."""
    w = World(host_slots=8)
    tokens = list(range(1, 10))  # two full pages + one token
    assert w.admit("a", tokens) == 0
    w.step()
    w.compute("a", 9)
    w.finish("a")
    filler = [100 + i for i in range(4 * (NUM_PAGES - 1))]  # takes every page: evicts a's
    assert w.admit("b", filler) == 0
    stores, loads = w.pm.take_prefix_ops()
    assert len(stores) == 2 and not loads and w.tier.num_used == 2
    w.kv = w.pool.apply(w.kv, stores, loads)
    w.compute("b", len(filler))  # overwrites a's old pages on the device
    w.finish("b")
    assert w.admit("a2", tokens) == 8  # its fresh pages evict b's (3 stores now)
    host = w.pm.stats().host
    assert host.hit_tokens == 8 and host.loaded_pages == 2 and host.stored_pages == 5
    w.step()
    w.check_reused("a2")
    w.finish("a2")
    w.pm.check_invariants()


def test_an_entry_whose_store_is_pending_is_not_matched():
    """Evicted and asked for again before its store landed: recomputed, never read early."""
    w = World(host_slots=8)
    tokens = list(range(1, 6))  # one full page + one token
    w.admit("a", tokens)
    w.step()
    w.compute("a", 5)
    w.finish("a")
    filler = [100 + i for i in range(4 * (NUM_PAGES - 1))]
    w.admit("b", filler)  # evicts a's page: its store is pending
    w.finish("b")
    assert w.tier.num_used == 1 and w.admit("a2", tokens) == 0  # same step: no host hit
    w.step()
    assert w.admit("a3", tokens) == 4  # a step later the store is in flight: found, and the
    w.step()                           # load waits for it to land
    w.check_reused("a3")
    w.pm.check_invariants()


@pytest.mark.parametrize("bad", [dict(enable_prefix_caching=False, host_prefix_cache_size=1 << 20),
                                 dict(host_prefix_cache_size=-1)])
def test_bad_settings_name_the_field(bad):
    from jaxserve.config import EngineConfig
    with pytest.raises(ValueError, match="host_prefix_cache_size"):
        EngineConfig.from_kwargs(model="x", **bad)


def test_builder_refuses_a_tier_too_small_or_too_big():
    from jaxserve.config import CacheConfig
    from jaxserve.engine.builder import host_prefix_tier
    with pytest.raises(ValueError, match="holds no page"):
        host_prefix_tier(CacheConfig(host_prefix_cache_size=100), 4096, 1)
    with pytest.raises(ValueError, match="exceed this host's memory"):
        host_prefix_tier(CacheConfig(host_prefix_cache_size=1 << 60), 4096, 1)
    with pytest.raises(ValueError, match="several JAX processes"):
        host_prefix_tier(CacheConfig(host_prefix_cache_size=1 << 20), 4096, 2)
    assert host_prefix_tier(CacheConfig(), 4096, 1) is None
    assert host_prefix_tier(CacheConfig(host_prefix_cache_size=10000), 4096,
                            1).num_slots == 2
