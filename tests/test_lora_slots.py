"""The scheduler side of multi-LoRA, without a model: LoRASlots (core/lora_slots.py), the
scheduler giving each running request's rows its adapter's slot and holding back a request
whose adapter cannot get one, and the prefix cache keyed by adapter (core/page_manager.py).
"""

from __future__ import annotations

import pytest

from jaxserve.core.lora_slots import LoRASlots
from jaxserve.core.page_manager import PageManager
from jaxserve.core.request import Request, SamplingParams
from jaxserve.core.scheduler import Scheduler


def request(rid: str, lora_id: int, prompt=None, max_tokens: int = 4) -> Request:
    return Request(rid, list(prompt or range(3, 12)), SamplingParams(max_tokens=max_tokens,
                                                                     temperature=0.0),
                   seed=0, lora_id=lora_id)


def test_a_resident_adapter_is_shared_and_an_idle_one_is_replaced_least_recent_first():
    slots = LoRASlots(2)
    a, b, a2, c = request("a", 1), request("b", 2), request("a2", 1), request("c", 3)
    for r in (a, b, a2):
        assert slots.can_acquire(r)
        slots.acquire(r)
    assert [slots.slot_of(r.request_id) for r in (a, b, a2)] == [1, 2, 1]
    assert slots.take_loads() == [(1, 1), (2, 2)] and slots.take_loads() == []
    assert not slots.can_acquire(c), "both slots hold adapters in use: c must wait"
    slots.release(a)
    assert not slots.can_acquire(c), "adapter 1 is still used by a2"
    slots.release(b)
    slots.release(a2)  # adapter 2 went idle first: it is the one replaced
    slots.acquire(c)
    assert slots.slot_of("c") == 2 and slots.take_loads() == [(2, 3)]
    assert slots.resident == {1: 1, 3: 2} and (slots.num_loads, slots.num_evictions) == (3, 1)
    base = request("base", 0)
    slots.acquire(base)
    assert slots.slot_of("base") == 0 and slots.take_loads() == []


def test_the_scheduler_gives_rows_their_slot_and_holds_back_a_request_without_one():
    pages = PageManager(64, 4)
    scheduler = Scheduler(pages, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                          max_loras=1)
    for r in (request("a", 1), request("b", 2), request("base", 0)):
        scheduler.add(r)
    plan = scheduler.schedule()
    got = {c.request_id: c.lora_slot for c in plan.chunks}
    assert got == {"a": 1, "base": 0}, f"b's adapter has no slot while a runs: {got}"
    assert plan.lora_loads == [(1, 1)]
    assert [r.request_id for r in scheduler.waiting] == ["b"]


def test_a_request_under_an_adapter_is_refused_when_no_adapter_is_served():
    scheduler = Scheduler(PageManager(64, 4), max_num_seqs=4, max_num_batched_tokens=64,
                          max_model_len=64)
    event = scheduler.add(request("a", 1))
    assert event is not None and "serves no adapters" in event.error
    assert scheduler.lora_slots.in_use == frozenset(), "a refused request still holds its adapter"


def test_an_adapter_is_in_use_from_queueing_until_its_last_request_finishes():
    from jaxserve.core.request import FinishReason

    scheduler = Scheduler(PageManager(64, 4), max_num_seqs=4, max_num_batched_tokens=64,
                          max_model_len=64, max_loras=1)
    for r in (request("a", 1), request("b", 1), request("base", 0)):
        scheduler.add(r)
    assert scheduler.lora_slots.in_use == {1}, "queued requests' adapter is not in use"
    scheduler.schedule()
    scheduler.finish("a", FinishReason.ABORT)
    assert scheduler.lora_slots.in_use == {1}, "b still runs under adapter 1"
    scheduler.finish("b", FinishReason.ABORT)
    assert scheduler.lora_slots.in_use == frozenset(), "no request uses adapter 1 any more"
    assert scheduler.lora_slots.slot_of("b") == 0, "a finished request kept its adapter slot"


def test_the_scheduler_asks_the_adapter_object_before_any_request_runs():
    """Even base-model requests: the scheduler holds no rule of its own about adapters."""
    scheduler = Scheduler(PageManager(64, 4), max_num_seqs=4, max_num_batched_tokens=64,
                          max_model_len=64, max_loras=1)
    asked = []
    scheduler.lora_slots.can_acquire = lambda r: asked.append(r.request_id) or False
    scheduler.add(request("base", 0))
    plan = scheduler.schedule()
    assert asked == ["base"], f"the scheduler asked LoRASlots about {asked}, not 'base'"
    assert not plan.chunks, "a request ran though LoRASlots refused it a slot"


@pytest.mark.parametrize("host_tier", [False, True])
def test_the_prefix_cache_never_shares_pages_across_adapters(host_tier):
    from jaxserve.core.host_prefix_tier import HostPrefixTier

    tier = HostPrefixTier(8 * 1024, 1024) if host_tier else None
    pages = PageManager(16, 4, host_tier=tier)
    prompt = list(range(3, 20))  # 4 full pages and one token
    assert pages.allocate("base", prompt, len(prompt)) == 0
    pages.commit("base", prompt)
    assert len(pages.lookup_prefix(prompt)) == 4
    assert pages.lookup_prefix(prompt, lora_id=1) == [], "adapter 1 found the base model's KV"
    assert pages.allocate("a", prompt, len(prompt), lora_id=1) == 0
    pages.commit("a", prompt)
    assert len(pages.lookup_prefix(prompt, lora_id=1)) == 4
    assert pages.lookup_prefix(prompt, lora_id=2) == []
    base_pages = pages.lookup_prefix(prompt)
    assert not set(base_pages) & set(pages.lookup_prefix(prompt, lora_id=1))
    pages.check_invariants()


def test_adapter_chains_stay_apart_even_when_every_key_collides():
    """A hash that maps everything to one key: the root serial still tells adapters apart."""
    pages = PageManager(16, 4, hash_fn=lambda parent, tokens: 7)
    prompt = list(range(3, 12))
    pages.allocate("base", prompt, len(prompt))
    pages.commit("base", prompt)
    assert pages.lookup_prefix(prompt, lora_id=1) == []
    assert len(pages.lookup_prefix(prompt)) == 1
    pages.check_invariants()
