"""Sliding-window page reuse: when every layer has a window, a running request's pages wholly
before it go back to the pool (NULL_PAGE in its page table), with no page the attention still
needs ever released, the prefix cache still exact, swaps moving only live pages, and no leak.

Host side only (scheduler and page manager, a fixed token per step); the last test runs a tiny
Mistral with a window through the engine and checks greedy tokens are the same with reuse.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.core.plan import StepResult
from jaxserve.core.page_manager import NULL_PAGE, PageManager
from jaxserve.core.request import Request, SamplingParams
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.sliding_window import kv_window, reusable_window
from jaxserve.core.swap_space import HostSwapSpace


def make(num_pages=64, page_size=4, window=8, caching=True, **kw):
    settings_ = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=512)
    settings_.update(kw)
    pages = PageManager(num_pages, page_size, enable_prefix_caching=caching)
    return Scheduler(pages, swap_space=HostSwapSpace(1 << 20, 1024), kv_window=window,
                     **settings_)


def add(sched, rid, prompt, max_tokens):
    r = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0), seed=0)
    r.arrival_seq = len(sched.requests)
    assert sched.add(r) is None
    return r


def check_plan(plan, held: dict, window: int, page_size: int) -> None:
    """Every page a chunk's queries can see is a live page, never the NULL_PAGE stand-in, in
    the table the runner holds for it (held: request id -> table, kept from the plans' diffs
    as the runner keeps them)."""
    for chunk in plan.chunks:
        if chunk.pages is not None:
            held[chunk.request_id] = chunk.pages.apply(held.get(chunk.request_id, ()))
        table = held[chunk.request_id]
        first_key = max(chunk.start_position - window + 1, 0)
        needed = table[first_key // page_size:math.ceil(chunk.kv_len / page_size)]
        assert NULL_PAGE not in needed, (
            f"{chunk.request_id}: queries {chunk.start_position}..{chunk.kv_len - 1} see keys from "
            f"{first_key}, but its page table {table} has a released page there")


def run(sched, *, max_steps=5000, on_step=None):
    """Drive the scheduler to the end with token 7 every step; check accounting every step."""
    pm, window = sched.pages, sched.window.window
    steps, held = 0, {}
    while sched.has_unfinished():
        plan = sched.schedule()
        if window is not None:
            check_plan(plan, held, window, pm.page_size)
        if on_step is not None:
            on_step(plan)
        sched.update(plan, StepResult([7] * len(plan.chunks), [0.0] * len(plan.chunks)))
        pm.check_invariants()
        steps += 1
        assert steps < max_steps, "requests never finished"
    assert pm.num_free_pages == pm.num_pages - 1, "pages leaked after every request finished"
    return steps


def live_pages(sched, rid) -> int:
    return sum(p != NULL_PAGE for p in sched.pages.page_table(rid))


@pytest.mark.parametrize("windows, want", [
    (((8, 8, 8),), 8), (((8, None),), None), (((8, 8), (4, 4)), 8), (((8, 8), (None,)), None),
    (((None,),), None), ((), None)])
def test_reusable_window_needs_a_window_on_every_layer_of_every_model(windows, want):
    assert reusable_window(*windows) == want


def test_release_window_frees_whole_pages_before_the_window_and_keeps_indices():
    pm = PageManager(32, 4)
    pm.allocate("r", (), 40)
    before = pm.page_table("r")
    free_before = pm.num_free_pages
    assert pm.release_window("r", 17) == 4, "slots 0..15 lie in pages 0..3; 16 is still needed"
    assert pm.page_table("r") == [NULL_PAGE] * 4 + before[4:]
    assert pm.num_free_pages == free_before + 4
    assert pm.release_window("r", 17) == 4 and pm.num_free_pages == free_before + 4, \
        "releasing again must be a no-op"
    assert pm.release_window("r", 3) == 4, "the window never moves back"
    pm.check_invariants()
    pm.free("r")
    pm.check_invariants()
    assert pm.num_free_pages == 31


def test_released_pages_keep_their_prefix_entry_and_serve_an_exact_hit():
    pm = PageManager(32, 4)
    tokens = list(range(100, 124))  # 6 full pages
    pm.allocate("a", tokens, len(tokens))
    pm.commit("a", tokens)
    first_pages = pm.page_table("a")[:3]
    pm.release_window("a", 12)
    pm.check_invariants()
    assert pm.lookup_prefix(tokens + [1]) == first_pages + pm.page_table("a")[3:], \
        "released pages hold that prefix's KV still, and stay findable"
    assert pm.lookup_prefix([999] + tokens[1:]) == [], "other tokens never hit"
    pm.allocate("b", tokens + [1], 25)
    assert pm.page_table("b")[:6] == first_pages + pm.page_table("a")[3:]
    pm.check_invariants()
    pm.free("a"), pm.free("b")
    pm.check_invariants()
    assert pm.num_free_pages == 31


def test_long_generation_holds_only_the_window_pages():
    window, page_size = 8, 4
    # admission still checks the whole length fits (conservative), so the pool is big enough
    sched = make(num_pages=128, window=window, page_size=page_size)
    add(sched, "r", range(10, 40), max_tokens=300)
    most = [0]

    def on_step(plan):
        if plan.chunks and plan.chunks[0].num_tokens == 1:  # decoding
            most[0] = max(most[0], live_pages(sched, "r"))

    run(sched, on_step=on_step)
    assert most[0] <= math.ceil(window / page_size) + 1, \
        f"a decoding request held {most[0]} pages for a window of {window} tokens"


def test_without_a_window_no_page_is_released():
    sched = make(window=None)
    add(sched, "r", range(10, 40), max_tokens=60)
    seen = []
    run(sched, on_step=lambda plan: seen.extend(
        p for c in plan.chunks if c.pages is not None
        for p in (NULL_PAGE,) * c.pages.num_released + c.pages.new_pages))
    assert NULL_PAGE not in seen


def test_requests_sharing_a_cached_prefix_still_hit_after_the_window_released_it():
    sched = make(window=8)
    prompt = list(range(50, 90))
    add(sched, "a", prompt, max_tokens=40)
    run(sched)
    hits = sched.pages.lookup_prefix(prompt)
    assert len(hits) == 9, "the finished request's released pages stay in the prefix cache"
    add(sched, "b", prompt, max_tokens=40)
    run(sched)
    assert sched.pages.stats().prefix_hit_tokens >= 36


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_with_a_window_moves_only_live_pages_and_leaks_nothing(mode):
    window, page_size = 8, 4
    sched = make(num_pages=16, window=window, page_size=page_size, max_num_seqs=6,
                 preemption_mode=mode)
    for i in range(6):
        add(sched, f"r{i}", range(20 * i, 20 * i + 20), max_tokens=30)
    out, back = {}, {}

    def on_step(plan):
        for swap in plan.swap_out:
            assert NULL_PAGE not in swap.page_ids
            assert len(swap.page_ids) <= math.ceil(window / page_size) + 1, swap
            out.setdefault(swap.request_id, []).append(len(swap.page_ids))
        for swap in plan.swap_in:
            back.setdefault(swap.request_id, []).append(len(swap.page_ids))

    run(sched, on_step=on_step)
    assert sched.num_preemptions > 0, "the pool was meant to force preemption"
    if mode == "swap":
        assert sched.num_swaps > 0 and out == back, \
            f"pages swapped in must match the ones swapped out: {out} vs {back}"


@settings(max_examples=60, deadline=None)
@given(window=st.integers(1, 24), page_size=st.integers(1, 8), caching=st.booleans(),
       mode=st.sampled_from(["swap", "recompute"]), num_pages=st.integers(12, 40),
       lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40)), min_size=1,
                        max_size=6),
       budget=st.integers(4, 24), shared=st.booleans())
def test_window_reuse_never_releases_a_needed_page_nor_leaks(window, page_size, caching, mode,
                                                             num_pages, lengths, budget, shared):
    sched = make(num_pages=num_pages, page_size=page_size, window=window, caching=caching,
                 preemption_mode=mode, max_num_batched_tokens=budget)
    for i, (prompt_len, max_tokens) in enumerate(lengths):
        start = 0 if shared else 100 * i
        r = Request(f"r{i}", list(range(start, start + prompt_len)),
                    SamplingParams(max_tokens=max_tokens, temperature=0), seed=0)
        r.arrival_seq = i
        sched.add(r)  # one that can never fit is finished at once
    run(sched)


def mistral_window_run(loaded, prompts, *, reuse: bool, **engine_settings):
    """Greedy tokens of `prompts` through the engine, whether pages were released, and
    (preemptions, swaps)."""
    from jaxserve.entrypoints.llm import LLM

    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    with LLM(loaded=loaded, page_size=4, max_num_batched_tokens=16, max_num_seqs=6,
             token_buckets=(16,), seq_buckets=(6,),  # one bucket: one compile per engine
             max_model_len=128, progress=False, **engine_settings) as llm:
        scheduler = llm.engine.scheduler
        scheduler.window = kv_window(scheduler.pages, reusable_window(loaded.config.layer_windows)
                                    if reuse else None)
        schedule, nulls = scheduler.schedule, []

        def recording_schedule():
            plan = schedule()
            nulls.extend(p for c in plan.chunks if c.pages is not None
                         for p in (NULL_PAGE,) * c.pages.num_released + c.pages.new_pages
                         if p == NULL_PAGE)
            return plan

        scheduler.schedule = recording_schedule
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert scheduler.pages.num_free_pages == scheduler.pages.num_pages - 1, "pages leaked"
        return ([list(o.token_ids) for o in outputs], bool(nulls),
                (scheduler.num_preemptions, scheduler.num_swaps))


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_mistral_window_greedy_tokens_are_the_same_with_page_reuse_and_preemption(mode):
    pytest.importorskip("jax")
    from tiny_models import tiny_loaded

    loaded = tiny_loaded(seed=3, architecture="mistral", sliding_window=8,
                         layer_types=("sliding_attention",) * 2)
    prompts = [list(range(3 + i, 3 + i + n)) for i, n in enumerate((30, 25, 12, 28, 21, 17))]
    want, released, _ = mistral_window_run(loaded, prompts, reuse=False)
    assert not released
    got, released, (num_preemptions, num_swaps) = mistral_window_run(
        loaded, prompts, reuse=True, num_pages=14, preemption_mode=mode)
    assert released, "no page was released for the window"
    assert num_preemptions > 0, "the 13-page pool was meant to force preemption"
    assert (num_swaps > 0) == (mode == "swap"), f"{num_swaps} swaps in {mode} mode"
    assert all(len(tokens) == 20 for tokens in got)
    assert got == want, "window page reuse (with preemption) changed greedy tokens"


@pytest.mark.parametrize("kernel_name", ["ragged", "decode"])
def test_attention_masks_null_pages_before_the_window(kernel_name):
    """The reference and the Pallas kernels (interpret mode) read NULL_PAGE where pages were
    released and give the output of the full page table."""
    jnp = pytest.importorskip("jax.numpy")
    import functools

    import numpy as np
    from pallas_kernels import reference
    from pallas_kernels.paged_attention import paged_attention
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention
    from test_kernels import (MAX_SEQS, NUM_TOKENS, assert_close, compile_once, decode_lens,
                              make_inputs, ragged_batch)

    window, page_size, head_dim = 13, 8, 32
    rng = np.random.default_rng(14)
    kw = dict(sm_scale=head_dim ** -0.5, sliding_window=window)
    if kernel_name == "ragged":
        q_lens, kv_lens, cu_q_lens, num_seqs = ragged_batch(rng, page_size)
        num_rows, extra = NUM_TOKENS, (cu_q_lens, num_seqs)
        ref, kernel = reference.ragged_paged_attention, ragged_paged_attention
    else:
        kv_lens = decode_lens(rng, page_size)
        q_lens, num_rows, extra = [1] * MAX_SEQS, MAX_SEQS, ()
        ref, kernel = reference.paged_attention, paged_attention
        kw["num_kv_splits"] = 2
    q, k, v, layer, kv, table = make_inputs(rng, q_lens, kv_lens, 2, page_size, head_dim,
                                            jnp.float32, num_rows)
    if kernel_name == "decode":
        q = jnp.where((kv == 0)[:, None, None], jnp.nan, q)
    nulled = np.asarray(table).copy()
    for s, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        first_key = max(kv_len - q_len - window + 1, 0)  # what the first query row sees
        nulled[s, :first_key // page_size] = NULL_PAGE
    assert (nulled == NULL_PAGE).any(), "the draw released no page"
    ref_kw = {key: val for key, val in kw.items() if key != "num_kv_splits"}
    args = (q, k, v, layer, kv, table) + extra
    want = compile_once(functools.partial(ref, **ref_kw), *args)(*args)
    args = (q, k, v, layer, kv, jnp.asarray(nulled)) + extra
    live = (np.arange(num_rows) < sum(q_lens) if kernel_name == "ragged"
            else np.asarray(kv_lens) > 0)
    got_ref = compile_once(functools.partial(ref, **ref_kw), *args)(*args)
    assert_close(got_ref, want, jnp.float32, live, "reference with NULL_PAGE entries")
    got = compile_once(functools.partial(kernel, interpret=True, **kw), *args)(*args)
    assert_close(got, want, jnp.float32, live, f"{kernel_name} kernel with NULL_PAGE entries")
