"""PageManager: page accounting, prefix cache correctness under collisions, LRU eviction.

The state machine keeps its own ground truth of what every page holds: for each slot, the whole
token prefix whose KV was written there. A cache hit must return pages whose slots hold exactly
the query's prefix, and a request may only write into pages it owns alone.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxserve.core.page_manager import PageManager, stable_page_hash

PAGE_SIZE = 4
NUM_PAGES = 16  # 15 allocatable: small, so eviction and out-of-pages happen often
SHARED_PREFIXES = ([], [1, 1, 0, 0], [0, 1, 1, 0, 1, 0, 0, 1], [0, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1])
TOKENS = st.builds(lambda prefix, tail: prefix + tail, st.sampled_from(SHARED_PREFIXES),
                   st.lists(st.integers(0, 1), max_size=10)).filter(len)


_SETTINGS = settings(max_examples=100, stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])


class PageManagerMachine(RuleBasedStateMachine):
    hash_fn = None
    enable_prefix_caching = True

    def __init__(self):
        super().__init__()
        self.pm = PageManager(NUM_PAGES, PAGE_SIZE, self.enable_prefix_caching, self.hash_fn)
        self.tokens: dict[str, list[int]] = {}  # request -> tokens whose KV is written
        self.content = {p: [None] * PAGE_SIZE for p in range(NUM_PAGES)}  # page -> slot prefixes
        self.next_id = 0

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _snapshot(self):
        return ({r: (self.pm.page_table(r), self.pm.num_slots(r)) for r in self.tokens},
                self.pm.num_free_pages, self.pm.stats().num_cached)

    def _owners(self, page: int) -> int:
        return sum(self.pm.page_table(r).count(page) for r in self.tokens)

    def _write(self, rid: str, start: int, tokens: list[int]) -> None:
        """The device writes KV for positions start.. of tokens (all of the request's tokens)."""
        table = self.pm.page_table(rid)
        for pos in range(start, len(tokens)):
            page = table[pos // PAGE_SIZE]
            assert self._owners(page) == 1, f"{rid} writes into page {page}, shared with others"
            self.content[page][pos % PAGE_SIZE] = tuple(tokens[:pos + 1])

    def _reset_new_pages(self, old_table: list[int], table: list[int]) -> None:
        for page in table[len(old_table):]:
            self.content[page] = [None] * PAGE_SIZE

    def _draw_request(self, data) -> str:
        return data.draw(st.sampled_from(sorted(self.tokens)))

    @rule(prompt=TOKENS, commit=st.booleans())
    def add_request(self, prompt, commit):
        rid, before = self._new_id(), self._snapshot()
        expected_ok = self.pm.can_allocate(prompt, len(prompt))
        num_cached = self.pm.allocate(rid, prompt, len(prompt))
        assert (num_cached is not None) == expected_ok, "can_allocate disagrees with allocate"
        if num_cached is None:
            assert self._snapshot() == before, "a failed allocate changed state"
            return
        assert num_cached % PAGE_SIZE == 0 and num_cached < len(prompt)
        table = self.pm.page_table(rid)
        self._check_hit(prompt, table[:num_cached // PAGE_SIZE])
        self._reset_new_pages(table[:num_cached // PAGE_SIZE], table)
        self.tokens[rid] = list(prompt)
        self._write(rid, num_cached, prompt)
        if commit:
            self.pm.commit(rid, prompt)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new_tokens=st.lists(st.integers(0, 1), min_size=1, max_size=3),
          commit=st.booleans())
    def decode(self, data, new_tokens, commit):
        rid = self._draw_request(data)
        tokens, old_table = self.tokens[rid] + new_tokens, self.pm.page_table(rid)
        before = self._snapshot()
        if not self.pm.append_slots(rid, len(tokens)):
            assert self._snapshot() == before, "a failed append_slots changed state"
            return
        self._reset_new_pages(old_table, self.pm.page_table(rid))
        self._write(rid, len(self.tokens[rid]), tokens)
        self.tokens[rid] = tokens
        if commit:
            self.pm.commit(rid, tokens)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), drafts=st.lists(st.integers(0, 1), min_size=1, max_size=5))
    def speculate(self, data, drafts):
        rid = self._draw_request(data)
        num_accepted = data.draw(st.integers(0, len(drafts)))
        old_len, old_table = len(self.tokens[rid]), self.pm.page_table(rid)
        if not self.pm.append_slots(rid, old_len + len(drafts)):
            return
        self._reset_new_pages(old_table, self.pm.page_table(rid))
        self._write(rid, old_len, self.tokens[rid] + drafts)
        self.pm.truncate(rid, old_len + num_accepted)
        assert self.pm.num_slots(rid) == old_len + num_accepted
        self.tokens[rid] = self.tokens[rid] + drafts[:num_accepted]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def commit(self, data):
        rid = self._draw_request(data)
        self.pm.commit(rid, self.tokens[rid])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        src, dst = self._draw_request(data), self._new_id()
        num_slots = data.draw(st.integers(0, len(self.tokens[src])))
        got = self.pm.fork(src, dst, num_slots)
        assert got == num_slots // PAGE_SIZE * PAGE_SIZE
        src_table, dst_table = self.pm.page_table(src), self.pm.page_table(dst)
        assert dst_table == src_table[:got // PAGE_SIZE], "fork shares the pages in num_slots"
        self.tokens[dst] = list(self.tokens[src][:got])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def finish(self, data):
        self.finish_request(self._draw_request(data))

    def finish_request(self, rid):
        self.pm.free(rid)
        del self.tokens[rid]
        assert not self.pm.has_request(rid)
        self.pm.free(rid)  # freeing an unknown request is a no-op

    @rule(query=TOKENS)
    def lookup(self, query):
        pages = self.pm.lookup_prefix(query)
        assert len(pages) <= (len(query) - 1) // PAGE_SIZE, "a lookup covered the whole query"
        self._check_hit(query, pages)
        if not self.enable_prefix_caching:
            assert pages == []

    def _check_hit(self, query, pages):
        for i, page in enumerate(pages):
            expected = [tuple(query[:i * PAGE_SIZE + o + 1]) for o in range(PAGE_SIZE)]
            assert self.content[page] == expected, (
                f"cache hit page {page} at depth {i} holds KV of another prefix")

    @invariant()
    def accounting_holds(self):
        self.pm.check_invariants()
        stats = self.pm.stats()
        owned = {p for r in self.tokens for p in self.pm.page_table(r)}
        assert 0 not in owned, "scratch page 0 was handed out"
        assert len(owned) + self.pm.num_free_pages == NUM_PAGES - 1, (
            f"{len(owned)} owned + {self.pm.num_free_pages} free != {NUM_PAGES - 1} pages")
        assert stats.num_free + stats.num_used == stats.num_pages == NUM_PAGES - 1
        if not self.tokens:
            assert self.pm.num_free_pages == NUM_PAGES - 1, "pages leaked after all requests ended"

    def teardown(self):
        for rid in list(self.tokens):
            self.finish_request(rid)
        self.accounting_holds()


class CollidingHashMachine(PageManagerMachine):
    # Keys blind to the parent: the same page tokens after different prefixes always collide.
    hash_fn = staticmethod(lambda parent, tokens: stable_page_hash(None, tokens) % 8)


class NoPrefixCachingMachine(PageManagerMachine):
    enable_prefix_caching = False


TestPageManagerStateful = PageManagerMachine.TestCase
TestCollidingHashStateful = CollidingHashMachine.TestCase
TestNoPrefixCachingStateful = NoPrefixCachingMachine.TestCase
TestPageManagerStateful.settings = TestCollidingHashStateful.settings = _SETTINGS
TestNoPrefixCachingStateful.settings = settings(_SETTINGS, max_examples=40)


# ---------------------------------------------------------------------- unit tests


def _admit(pm, rid, tokens, commit=True):
    num_cached = pm.allocate(rid, tokens, len(tokens))
    assert num_cached is not None, f"{rid} could not be admitted"
    if commit:
        pm.commit(rid, tokens)
    return num_cached


def test_constant_hash_never_returns_wrong_pages():
    pm = PageManager(8, 4, hash_fn=lambda parent, tokens: 0)
    _admit(pm, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    page_a0 = pm.page_table("a")[0]
    assert pm.lookup_prefix([1, 2, 3, 4, 0]) == [page_a0]
    assert pm.lookup_prefix([5, 6, 7, 8, 0]) == [], "page 2 of 'a' is not a prefix's first page"
    assert pm.lookup_prefix([1, 2, 3, 4, 1, 2, 3, 4, 0]) == [page_a0], (
        "the colliding key of the second page must not return the first page again")


def test_parent_serial_rejects_same_tokens_after_another_parent():
    # Keys blind to the parent: a page matches on its own tokens unless the parent is checked.
    pm = PageManager(8, 4, hash_fn=lambda parent, tokens: stable_page_hash(None, tokens))
    _admit(pm, "a", [1, 1, 1, 1, 2, 2, 2, 2, 9])
    _admit(pm, "c", [3, 3, 3, 3, 9])
    assert pm.lookup_prefix([3, 3, 3, 3, 2, 2, 2, 2, 9]) == [pm.page_table("c")[0]], (
        "page [2,2,2,2] of 'a' was computed after [1,1,1,1], not after [3,3,3,3]")


def test_cached_prefix_is_reused_with_ref_counts():
    pm = PageManager(8, 4)
    _admit(pm, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert _admit(pm, "b", [1, 2, 3, 4, 5, 6, 7, 8, 0, 0]) == 8
    assert pm.page_table("b")[:2] == pm.page_table("a")[:2]
    assert _admit(pm, "c", [1, 2, 3, 4, 5, 6, 7, 8]) == 4, "the last token must be computed"
    pm.free("a"), pm.free("b"), pm.free("c")
    assert pm.num_free_pages == 7 and pm.stats().num_cached == 2


def test_lru_eviction_takes_least_recently_used_cached_page():
    pm = PageManager(5, 2)  # 4 allocatable pages
    for rid, tokens in (("a", [1, 2]), ("b", [3, 4]), ("c", [5, 6])):
        _admit(pm, rid, tokens)
    pages = {rid: pm.page_table(rid)[0] for rid in "abc"}
    for rid in "abc":
        pm.free(rid)
    _admit(pm, "b2", [3, 4, 0])  # touches b's page: now the most recently used
    pm.free("b2")
    _admit(pm, "d", [7, 7, 7, 7])  # two pages: the never-used page, then the LRU cached one (a's)
    assert pages["a"] in pm.page_table("d")
    assert pm.lookup_prefix([1, 2, 0]) == [], "a's page was evicted: its key must be gone"
    assert pm.lookup_prefix([3, 4, 0]) == [pages["b"]]
    assert pm.lookup_prefix([5, 6, 0]) == [pages["c"]]
    _admit(pm, "e", [8, 8])
    assert pm.page_table("e") == [pages["c"]], "c's page is now the least recently used"


def test_uncached_pages_are_reused_before_evicting_cached_ones():
    pm = PageManager(3, 2)  # 2 allocatable pages
    _admit(pm, "a", [1, 2, 3])  # page 0 full (cached), page 1 partial (uncached)
    full_page, partial_page = pm.page_table("a")
    pm.free("a")
    _admit(pm, "b", [9])
    assert pm.page_table("b") == [partial_page]
    assert pm.lookup_prefix([1, 2, 0]) == [full_page], "the cached page must survive"


def test_chain_is_evicted_from_its_leaves():
    pm = PageManager(4, 2)  # 3 allocatable pages
    _admit(pm, "a", [1, 2, 3, 4, 5, 6])
    table = pm.page_table("a")
    pm.free("a")
    _admit(pm, "b", [9])
    assert pm.page_table("b") == [table[2]], "the deepest page of the chain goes first"
    assert pm.lookup_prefix([1, 2, 3, 4, 5, 6]) == table[:2]


def test_allocate_out_of_pages_returns_none_and_changes_nothing():
    pm = PageManager(5, 4)
    _admit(pm, "a", list(range(10)))  # 3 pages
    before = (pm.num_free_pages, pm.stats(), pm.page_table("a"))
    assert not pm.can_allocate([7] * 9, 9)
    assert pm.allocate("b", [7] * 9, 9) is None
    assert (pm.num_free_pages, pm.stats(), pm.page_table("a")) == before
    assert not pm.has_request("b")
    assert not pm.append_slots("a", 17) and pm.num_slots("a") == 10


def test_allocate_counts_cached_pages_that_sit_in_the_free_list():
    pm = PageManager(4, 2)  # 3 allocatable pages
    _admit(pm, "a", [1, 2, 3, 4, 5])
    pm.free("a")
    assert pm.num_free_pages == 3
    assert pm.can_allocate([1, 2, 3, 4, 5, 6], 6), "2 cached pages + 1 fresh page fit exactly"
    assert not pm.can_allocate([1, 2, 3, 4, 5, 6, 7], 7)
    assert _admit(pm, "b", [1, 2, 3, 4, 5, 6]) == 4


def test_fork_shares_the_whole_pages_inside_num_slots_and_nothing_more():
    pm = PageManager(8, 4)
    _admit(pm, "a", list(range(10)))
    free = pm.num_free_pages
    assert pm.fork("a", "b", 9) == 8
    a, b = pm.page_table("a"), pm.page_table("b")
    assert b == a[:2] and pm.num_free_pages == free, "shared by ref count, none taken"
    assert pm.append_slots("b", 10) and pm.page_table("b")[2] not in a
    pm.free("a")
    assert pm.page_table("b")[:2] == a[:2], "b keeps the shared pages"
    pm.free("b")
    pm.check_invariants()
    assert pm.num_free_pages == 7


def test_truncate_releases_trailing_pages_but_refuses_committed_ones():
    pm = PageManager(8, 4)
    _admit(pm, "a", list(range(5)))
    assert pm.append_slots("a", 13) and len(pm.page_table("a")) == 4
    pm.truncate("a", 6)
    assert len(pm.page_table("a")) == 2 and pm.num_free_pages == 5
    with pytest.raises(ValueError, match="committed"):
        pm.truncate("a", 3)


def test_disabled_prefix_caching_never_hits():
    pm = PageManager(8, 4, enable_prefix_caching=False)
    _admit(pm, "a", list(range(9)))
    assert _admit(pm, "b", list(range(9))) == 0
    assert pm.lookup_prefix(list(range(9))) == [] and pm.stats().num_cached == 0


def test_reset_prefix_cache_forgets_everything():
    pm = PageManager(8, 4)
    _admit(pm, "a", list(range(9)))
    pm.free("a")
    pm.reset_prefix_cache()
    assert pm.lookup_prefix(list(range(9))) == [] and pm.stats().num_cached == 0
    pm.check_invariants()


def test_prefix_hit_stats_count_admissions():
    pm = PageManager(8, 4)
    _admit(pm, "a", list(range(9)))
    pm.lookup_prefix(list(range(9)))  # a peek before admission is not counted
    _admit(pm, "b", list(range(9)))
    stats = pm.stats()
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens) == (18, 8)
    assert stats.prefix_hit_rate == pytest.approx(8 / 18)
    assert stats.usage == pytest.approx(stats.num_used / 7)


def test_default_hash_is_stable_across_processes():
    code = ("from jaxserve.core.page_manager import stable_page_hash as h; "
            "print(h(h(None, (1, 2, 3)), (4, 5, 6)))")
    env = {**os.environ, "PYTHONHASHSEED": "random", "PYTHONPATH": str(Path(__file__).parents[1])}
    outputs = {subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, check=True).stdout for _ in range(2)}
    assert outputs == {f"{stable_page_hash(stable_page_hash(None, (1, 2, 3)), (4, 5, 6))}\n"}


def test_paging_waste_metric():
    spec = importlib.util.spec_from_file_location(
        "paging_waste", Path(__file__).parents[1] / "scripts" / "paging_waste.py")
    waste = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # for dataclasses
    spec.loader.exec_module(waste)
    # Prompt 16, 2 output tokens, page 16: the prefill step holds 16 slots for 16 tokens, the
    # decode step 32 slots for 17 (the last sampled token is never written); contiguous holds 64.
    result = waste.measure_waste([(16, 2)], page_size=16, max_model_len=64)
    assert result.paged == pytest.approx(1 - 33 / 48)
    assert result.contiguous == pytest.approx(1 - 33 / 128)
    mixed = waste.measure_waste(waste.mixed_workload(200, seed=0), 16, 2048)
    assert 0 < mixed.paged < 0.1 < 0.5 < mixed.contiguous, f"unexpected waste figures {mixed}"


def test_forked_request_extends_the_chain_its_source_registered():
    pm = PageManager(10, 4)
    _admit(pm, "a", list(range(10)), commit=False)  # 2 full pages + 1 partial
    assert pm.fork("a", "b", 10) == 8
    assert pm.append_slots("a", 12) and pm.append_slots("b", 12)
    pm.commit("a", list(range(12)))
    pm.commit("b", list(range(10)) + [9, 9])  # pages 0, 1 already registered by 'a': adopted
    a, b = pm.page_table("a"), pm.page_table("b")
    assert pm.lookup_prefix(list(range(10)) + [9, 9, 0]) == [a[0], a[1], b[2]]
    assert pm.lookup_prefix(list(range(13))) == a


def test_orphaned_cache_entry_is_replaced_by_a_valid_chain():
    pm = PageManager(8, 4)  # 7 allocatable pages
    prefix = [1, 1, 1, 1, 2, 2, 2, 2]
    _admit(pm, "a", [1, 1, 1, 1, 9], commit=False)
    _admit(pm, "b", prefix + [9], commit=False)  # computes page [1,1,1,1] itself
    pm.commit("a", [1, 1, 1, 1, 9])
    pm.commit("b", prefix + [9])  # its first page duplicates a's; its second hangs off a's
    pm.free("a")
    _admit(pm, "d", [5] * 13)  # takes every free page: evicts a's cached page
    pm.free("d")
    assert pm.lookup_prefix(prefix + [9]) == [], "b's second page lost its parent: unreachable"
    _admit(pm, "c", prefix + [9])
    assert pm.lookup_prefix(prefix + [9]) == pm.page_table("c")[:2], (
        "c's second page must replace the unreachable entry")
    pm.check_invariants()
