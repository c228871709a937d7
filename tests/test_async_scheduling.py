"""Async scheduling changes no token: the same requests with it on and off, side by side
(and, in recompute mode, with every decode laid out as a chunk instead of plan.DecodeRows).

The mix: 64 requests with chunked prefill (prompts longer than the step's budget), forced
preemption (a small page pool, recompute and swap), stop strings, stop tokens, EOS, max_tokens,
aborts in mid-stream and seeded sampling. Each run must also show that its mode really ran:
steps planned ahead of their predecessor's results with async on, none with it off.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import make_llm
from jaxserve import SamplingParams
from jaxserve.runner.compile_count import CompileCounter
from test_engine import assert_idle_and_no_leak

N = 64


def base_requests():
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 128, int(rng.integers(1, 120))).tolist() for _ in range(N)]
    params = []
    for i in range(N):
        kind = dict(max_tokens=int(rng.integers(1, 40)), ignore_eos=True, temperature=0.0)
        if i % 4 == 1:  # seeded sampling
            kind.update(temperature=0.9, top_p=0.9, seed=1000 + i)
        params.append(SamplingParams(**kind))
    return prompts, params


def run(llm, prompts, params, abort_after: dict[int, int]) -> tuple[list, int]:
    """Every request through the engine; request i is aborted once it has shown
    abort_after[i] tokens. Returns the final outputs in order and the steps planned ahead."""
    engine = llm.engine
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    index = {rid: i for i, rid in enumerate(ids)}
    final = {}
    with CompileCounter() as compiles:
        while engine.has_unfinished():
            for out in engine.step():
                i = index[out.request_id]
                if out.finished:
                    final[i] = out
                elif i in abort_after and len(out.token_ids) >= abort_after[i]:
                    final[i] = engine.abort(out.request_id)
    assert compiles.count == 0
    assert_idle_and_no_leak(llm)
    return [final[i] for i in range(N)], engine.num_overlapped_steps


def watch_decode_rows(engine) -> list[int]:
    """The plan.DecodeRows rows of every step the engine's runner is handed, as they come."""
    seen, runner = [], engine.runner
    for name in ("dispatch", "execute"):
        method = getattr(runner, name)
        setattr(runner, name, lambda plan, _m=method: (seen.append(plan.num_decode_rows),
                                                      _m(plan))[1])
    return seen


@pytest.fixture(scope="module")
def workload():
    """The base mix, then stop strings / stop tokens / EOS taken from a first plain run so that
    they really hit, and aborts partway."""
    prompts, params = base_requests()
    llm = make_llm(async_scheduling=False, num_pages=400)
    first, _ = run(llm, prompts, params, {})
    for i, out in enumerate(first):
        sp, text = params[i], out.text
        if i % 4 == 0 and len(text) > 6:
            params[i] = SamplingParams(max_tokens=sp.max_tokens, temperature=0.0,
                                       ignore_eos=True, stop=[text[3:5]])
        elif i % 4 == 2 and len(out.token_ids) > 5:
            params[i] = SamplingParams(max_tokens=sp.max_tokens, temperature=0.0,
                                       ignore_eos=True, stop_token_ids=[out.token_ids[4]])
        elif i % 4 == 3 and len(out.token_ids) > 3:  # this tokenizer's EOS is id 2
            params[i] = SamplingParams(max_tokens=sp.max_tokens, temperature=0.0,
                                       ignore_eos=False)
    abort_after = {i: 3 for i in range(1, N, 8) if len(first[i].token_ids) > 6}  # seeded ones
    return prompts, params, abort_after


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_async_scheduling_changes_no_token(mode, workload):
    prompts, params, abort_after = workload
    outs = {}
    # async on / off; and (recompute) async on with every decode a chunk, no plan.DecodeRows
    for on, decode_rows in ((True, True), (False, True)) + (
            ((True, False),) if mode == "recompute" else ()):
        llm = make_llm(async_scheduling=on, preemption_mode=mode, num_pages=24)
        llm.engine.scheduler.decode_rows = decode_rows  # (before any request is added)
        decode_seen = watch_decode_rows(llm.engine)
        outs[on, decode_rows], overlapped = run(llm, prompts, params, abort_after)
        assert (overlapped > 0) == on, f"async_scheduling={on}: {overlapped} steps overlapped"
        assert (sum(decode_seen) > 0) == decode_rows
        sched = llm.engine.scheduler
        assert sched.num_preemptions > 0, "the page pool was meant to force preemption"
        if mode == "swap":
            assert sched.num_swaps > 0
        llm.close()
    fields = lambda o: (o.token_ids, o.text, o.finish_reason)  # noqa: E731
    for other in outs.keys() - {(True, True)}:
        differ = [i for i in range(N) if fields(outs[True, True][i]) != fields(outs[other][i])]
        assert not differ, (other, [(fields(outs[True, True][i]), fields(outs[other][i]))
                                    for i in differ[:3]])
    outs[True] = outs[True, True]
    reasons = [o.finish_reason for o in outs[True]]
    assert reasons.count("abort") == len(abort_after)
    assert any(o.finish_reason == "stop" and params[i].stop for i, o in enumerate(outs[True]))
    assert any(o.finish_reason == "stop" and params[i].stop_token_ids
               for i, o in enumerate(outs[True]))


def test_default_model_greedy_tokens_are_the_same_with_async_scheduling():
    from jaxserve.entrypoints.llm import LLM
    from model_fixtures import real_default_model

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
               "List three colors:"]
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    tokens = {}
    for on in (True, False):  # scanned layers: a third of the unrolled engine's compile
        llm = LLM("default", loaded=real_default_model(), progress=False, max_model_len=128,
                  max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(32,),
                  seq_buckets=(4,), layer_loop="scan", async_scheduling=on)
        tokens[on] = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert (llm.engine.num_overlapped_steps > 0) == on
        llm.close()
    assert tokens[True] == tokens[False]
