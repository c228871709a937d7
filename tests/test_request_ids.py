"""A caller's request id may be reused once its request has ended (finished, aborted, expired):
the reuse gets exactly the tokens a fresh id gets. The engine keys every piece of state by its
own id of the admission (Request.request_id: the caller's id and a serial), so a step still in
flight for the old request can never feed the new one.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from conftest import make_llm
from jaxserve import SamplingParams
from jaxserve.engine.async_engine import AsyncEngine, DeadlineExceededError

from test_engine import assert_idle_and_no_leak

FIRST = [5, 9, 33, 40, 7, 8, 12, 77, 100, 3, 4, 17, 18, 19]
SECOND = [60, 61, 62, 63, 90, 91, 3]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=[(True, True), (False, True), (True, False)],
                ids=["async+prefix", "sync+prefix", "async+noprefix"])
def llm(request, small_llm):
    async_scheduling, prefix_caching = request.param
    if request.param == (True, True):
        return small_llm
    return make_llm(async_scheduling=async_scheduling, enable_prefix_caching=prefix_caching)


def run(engine, prompt, request_id, params=GREEDY, abort_after_steps=None):
    """Run one request to its end (or abort it after that many steps); its token ids."""
    engine.add_request(prompt, params, request_id=request_id)
    tokens, num_steps = [], 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id:
                tokens = list(out.outputs[0].token_ids)
        num_steps += 1
        if num_steps == abort_after_steps:
            engine.abort(request_id)
    return tokens


def test_an_id_reused_after_its_request_stopped_with_a_step_in_flight_gets_fresh_tokens(llm):
    engine = llm.engine
    fresh = run(engine, SECOND, "fresh-a")
    first = run(engine, FIRST, "stopped")
    # Stop on its 4th token: with async scheduling the step after it is in flight by then.
    stop = SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[first[3]])
    assert len(run(engine, FIRST, "reused", stop)) <= 4
    assert run(engine, SECOND, "reused") == fresh, "a reused id got the old request's state"
    assert_idle_and_no_leak(llm)


def test_an_id_reused_after_an_abort_gets_fresh_tokens(llm):
    engine = llm.engine
    fresh = run(engine, SECOND, "fresh-b")
    run(engine, FIRST, "aborted", SamplingParams(max_tokens=200, temperature=0,
                                                 ignore_eos=True), abort_after_steps=3)
    assert run(engine, SECOND, "aborted") == fresh, "a reused id got the old request's state"
    assert_idle_and_no_leak(llm)


def test_an_id_in_flight_is_refused_by_name(small_llm):
    engine = small_llm.engine
    engine.add_request(FIRST, GREEDY, request_id="busy")
    with pytest.raises(ValueError, match="'busy' is already in use"):
        engine.add_request(SECOND, GREEDY, request_id="busy")
    while engine.has_unfinished():
        engine.step()
    assert_idle_and_no_leak(small_llm)


def test_an_id_reused_after_its_deadline_passed_gets_fresh_tokens():
    llm = make_llm()  # (the async engine's loop closes its engine when it stops)
    engine = llm.engine
    fresh = run(engine, SECOND, "fresh-c")
    async_engine = AsyncEngine(engine)
    async_engine.start()

    async def generate(prompt, params, deadline=None):
        out = None
        async for out in async_engine.generate(None, params, request_id="late",
                                               prompt_token_ids=prompt, deadline=deadline):
            pass
        return list(out.outputs[0].token_ids)

    async def scenario():
        with pytest.raises(DeadlineExceededError):
            await generate(FIRST, SamplingParams(max_tokens=400, temperature=0,
                                                 ignore_eos=True), time.monotonic() + 0.05)
        return await generate(SECOND, GREEDY)

    try:
        assert asyncio.run(scenario()) == fresh, "a reused id got the expired request's state"
    finally:
        async_engine.stop(timeout=10.0)
    assert_idle_and_no_leak(llm)
