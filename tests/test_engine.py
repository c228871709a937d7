"""The continuous-batching engine end to end on a tiny random Llama."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import make_llm
from jaxserve import SamplingParams
from jaxserve.runner.compile_count import CompileCounter


def mixed_requests(n=64, seed=0, vocab=128, max_prompt=300, max_out=200):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, vocab, rng.integers(1, max_prompt + 1)).tolist() for _ in range(n)]
    params = [SamplingParams(max_tokens=int(rng.integers(1, max_out + 1)), temperature=0.0,
                             ignore_eos=True) for _ in range(n)]
    return prompts, params


@pytest.fixture(scope="module")
def greedy_alone(small_llm):
    """Each mixed request run alone through the engine: the reference output."""
    prompts, params = mixed_requests()
    return [small_llm.generate([p], sp, use_tqdm=False)[0].token_ids
            for p, sp in zip(prompts, params)]


def assert_idle_and_no_leak(llm):
    engine = llm.engine
    assert not engine.has_unfinished()
    stats = engine.pages.stats()
    assert stats.num_free == stats.num_pages, f"pages leaked: {stats}"
    assert engine.runner.num_host_swapped == 0, "host swap copies leaked"
    engine.pages.check_invariants()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_busy_batch_with_preemption_matches_requests_run_alone(mode, greedy_alone):
    llm = make_llm(preemption_mode=mode)
    prompts, params = mixed_requests()
    with CompileCounter() as compiles:
        outs = llm.generate(prompts, params, use_tqdm=False)
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0, "the page pool was meant to force preemption"
    if mode == "swap":
        assert sched.num_swaps > 0, "swap mode never swapped"
    mismatched = [i for i, (o, ref) in enumerate(zip(outs, greedy_alone)) if o.token_ids != ref]
    assert not mismatched, f"{len(mismatched)} requests differ from their solo run: {mismatched}"
    assert compiles.count == 0, "serving compiled something after warm-up"
    assert_idle_and_no_leak(llm)


def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(small_llm):
    prompts, _ = mixed_requests(n=12, seed=1, max_prompt=40)
    params = [SamplingParams(max_tokens=24, temperature=0.9, top_k=40, top_p=0.9, min_p=0.01,
                             seed=100 + i, ignore_eos=True) for i in range(len(prompts))]
    busy = small_llm.generate(prompts, params, use_tqdm=False)
    alone = [small_llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    assert [o.token_ids for o in busy] == [o.token_ids for o in alone]
    greedy = small_llm.generate(prompts[:1], SamplingParams(max_tokens=24, temperature=0,
                                                            ignore_eos=True), use_tqdm=False)
    assert greedy[0].token_ids != busy[0].token_ids, "sampling looks greedy"
    assert_idle_and_no_leak(small_llm)


def test_abort_mid_generation_frees_pages_within_one_step(small_llm):
    engine = small_llm.engine
    request = engine.make_request([5] * 40, SamplingParams(max_tokens=200, ignore_eos=True,
                                                           temperature=0))
    other = engine.make_request([7] * 10, SamplingParams(max_tokens=5, ignore_eos=True,
                                                         temperature=0))
    engine.add(request)
    engine.add(other)
    rid, other = request.request_id, other.request_id  # the engine's ids key its pages
    for _ in range(4):
        engine.step()
    assert engine.pages.has_request(rid)
    out = engine.abort(request.external_id)
    assert out.finished and out.finish_reason == "abort"
    assert not engine.pages.has_request(rid), "aborted request still holds pages"
    while engine.has_unfinished():
        engine.step()
    assert not engine.pages.has_request(other)
    assert_idle_and_no_leak(small_llm)


def test_static_batching_gives_the_same_greedy_tokens_as_continuous(small_llm):
    prompts, params = mixed_requests(n=20, seed=2, max_prompt=60, max_out=30)
    static = make_llm(batching="static")
    want = [o.token_ids for o in small_llm.generate(prompts, params, use_tqdm=False)]
    got = [o.token_ids for o in static.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert_idle_and_no_leak(static)


def test_stop_conditions(small_llm):
    prompt = [9, 10, 11]
    free = small_llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0,
                                                       ignore_eos=True), use_tqdm=False)[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    stop_tok = free.token_ids[5]
    first = free.token_ids.index(stop_tok)
    out = small_llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0,
                                                      stop_token_ids=[stop_tok]),
                             use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[:first + 1]
    tokens_as_eos = small_llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0),
                                       use_tqdm=False)[0]
    assert 2 not in tokens_as_eos.token_ids[:-1]
    text = free.text
    assert len(text) >= 4, f"need some text to cut: {text!r}"
    stop_str = text[2:4]
    cut = small_llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0,
                                                      ignore_eos=True, stop=[stop_str]),
                             use_tqdm=False)[0]
    assert cut.finish_reason == "stop"
    assert cut.text == text[:text.index(stop_str)], (cut.text, text, stop_str)
    assert_idle_and_no_leak(small_llm)


def test_invalid_requests_raise_naming_the_field(small_llm):
    engine = small_llm.engine
    with pytest.raises(ValueError, match="max_model_len"):
        engine.make_request([5] * 500, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.make_request([5, 128], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.make_request([], SamplingParams())
    for field, value in [("temperature", -1.0), ("top_p", 0.0), ("top_k", -1), ("min_p", 1.5),
                         ("max_tokens", 0)]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: value})


def test_request_that_can_never_fit_is_refused_at_intake_naming_the_pool():
    from jaxserve import RequestError

    llm = make_llm(num_pages=48, max_model_len=2048)
    with pytest.raises(RequestError, match="KV page pool holds 47 pages") as info:
        llm.generate([[5] * 900], SamplingParams(max_tokens=100), use_tqdm=False)
    assert (info.value.field, info.value.exceeds_kv_pool) == ("prompt_token_ids", True)
    assert_idle_and_no_leak(llm)


def test_pallas_kernels_in_interpret_mode_give_the_reference_greedy_tokens(small_llm):
    prompts, params = mixed_requests(n=6, seed=4, max_prompt=40, max_out=12)
    want = [o.token_ids for o in small_llm.generate(prompts, params, use_tqdm=False)]
    pallas = make_llm(attention_impl="pallas-interpret", token_buckets=(32,), seq_buckets=(16,))
    got = [o.token_ids for o in pallas.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert_idle_and_no_leak(pallas)


def test_a_failure_while_emitting_one_request_fails_only_that_request(small_llm):
    engine = small_llm.engine
    errors_before = engine.metrics.registry.get_sample_value(
        "jaxserve_requests_finished_total", {"finish_reason": "error"}) or 0.0
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = small_llm.generate([[7, 8, 9]], params, use_tqdm=False)[0].token_ids
    good = engine.add_request([7, 8, 9], params)
    bad = engine.add_request([10, 11, 12, 13], params)

    def broken(token_ids, final):
        raise RuntimeError("detokenizer broke")

    sample_id, = engine._outputs.samples_of(bad)  # the engine's id of its one sample
    engine._outputs._samples[sample_id].detok.feed = broken
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
    assert outs[bad].finish_reason == "error" and "detokenizer broke" in outs[bad].error
    assert outs[good].finish_reason == "length" and outs[good].token_ids == want
    assert engine.metrics.registry.get_sample_value(
        "jaxserve_requests_finished_total", {"finish_reason": "error"}) == errors_before + 1
    assert_idle_and_no_leak(small_llm)


def test_dynamic_rope_beyond_its_exact_length_is_refused_and_the_default_stays_inside():
    from jaxserve.model.decoder.rope import RopeScaling

    dynamic = dict(rope_scaling=RopeScaling(2.0, rope_type="dynamic"),
                   max_position_embeddings=128)
    with pytest.raises(ValueError, match="rope_type='dynamic'.*max_model_len=512"):
        make_llm(model_overrides=dynamic)  # SMALL_ENGINE asks for max_model_len 512
    assert make_llm(model_overrides=dynamic, max_model_len=None).engine.max_model_len == 128
