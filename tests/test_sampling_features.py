"""Logits processors and top-k logprobs through the engine on a tiny random Llama.

Greedy tokens with penalties and biases equal a transformers forward loop that applies the
numpy reference processors; they are the same alone and inside a busy batch with chunked
prefill and forced preemption (recompute and swap); a speculative engine gives the plain
engine's tokens; nothing compiles after warm-up; every slot and page is free afterwards.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import make_llm
from jaxserve import SamplingParams
from jaxserve.core.request import Request
from jaxserve.runner.compile_count import CompileCounter
from test_engine import assert_idle_and_no_leak, mixed_requests
from test_logits_processors import reference

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7], list(range(20, 60)), [40] * 25]
FEATURES = [
    dict(repetition_penalty=1.8),
    dict(frequency_penalty=1.5, presence_penalty=0.7),
    dict(logit_bias={40: 4.0, 41: -100.0, 87: 3.5}),
    dict(allowed_token_ids=list(range(30, 90)), repetition_penalty=1.3),
    dict(min_tokens=15, stop_token_ids=[48, 87], frequency_penalty=0.3),
    dict(bad_words=["!#", "%"], presence_penalty=0.4),  # CharTokenizer: id = byte + 3
]


def params(i: int, **extra) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 20, "temperature": 0.0, "ignore_eos": True,
                             **FEATURES[i], **extra})


def requests():
    return [(p, params(i)) for i in range(len(FEATURES)) for p in PROMPTS[:2]]


@pytest.fixture(scope="module")
def llm():
    return make_llm()


@pytest.fixture(scope="module")
def alone(llm):
    return [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in requests()]


def test_greedy_tokens_equal_transformers_with_the_reference_processors(llm, alone):
    from tiny_models import hf_logits, hf_model, tiny_model

    model = hf_model(*tiny_model())
    for (prompt, sp), out in zip(requests()[::3], alone[::3]):
        request = Request("r", list(prompt), sp, seed=0, eos_token_ids=(2,),
                          bad_words_ids=llm.engine.make_request(prompt, sp).bad_words_ids)
        for _ in range(sp.max_tokens):
            logits = hf_logits(model, request.all_token_ids)[-1]
            request.output_token_ids.append(int(np.argmax(reference(logits, request))))
        assert out.token_ids == request.output_token_ids, sp


def test_each_feature_changes_the_tokens_and_masked_tokens_never_appear(llm, alone):
    plain = llm.generate([p for p, _ in requests()],
                         SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
                         use_tqdm=False)
    assert sum(a.token_ids != b.token_ids for a, b in zip(alone, plain)) >= len(alone) - 2
    for (_, sp), out in zip(requests(), alone):
        if sp.allowed_token_ids:
            assert set(out.token_ids) <= set(sp.allowed_token_ids)
        if 41 in dict(sp.logit_bias):
            assert 41 not in out.token_ids
        if sp.min_tokens:
            assert not set(out.token_ids[:sp.min_tokens]) & {48, 87}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_alone_and_in_a_busy_preempted_batch_give_the_same_tokens(mode, llm, alone,
                                                                  monkeypatch):
    busy = make_llm(preemption_mode=mode, max_num_batched_tokens=16, num_pages=20,
                    token_buckets=(16,), seq_buckets=(4, 16))
    preempted = []
    sched = busy.engine.scheduler
    original = sched._preempt
    monkeypatch.setattr(sched, "_preempt",
                        lambda victim, plan: (preempted.append(victim.external_id),
                                              original(victim, plan))[1])
    filler, filler_params = mixed_requests(n=12, seed=3, max_prompt=60, max_out=40)
    extras = [(PROMPTS[2], params(0, logprobs=5)),
              (PROMPTS[1], params(1, temperature=0.8, seed=9, n=2))]
    alone = alone + [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in extras]
    feats = requests() + extras
    # The featured requests arrive last: the latest arrivals are the preemption victims.
    prompts = filler + [p for p, _ in feats]
    sps = filler_params + [sp for _, sp in feats]
    with CompileCounter() as compiles:
        outs = busy.generate(prompts, sps, use_tqdm=False)[len(filler):]
    featured = {o.request_id for o in outs}
    assert len(featured & set(preempted)) > 2, "featured requests were meant to be preempted"
    differ = [i for i, (a, b) in enumerate(zip(outs, alone))
              if [c.token_ids for c in a.outputs] != [c.token_ids for c in b.outputs]]
    assert [list(t) for t in outs[-2].top_logprobs] == [list(t) for t in alone[-2].top_logprobs]
    assert not differ, f"featured requests {differ} differ from their solo runs"
    assert compiles.count == 0, "serving compiled something after warm-up"
    assert sched.processor_slots.num_assigned == 0, "processor slots leaked"
    assert_idle_and_no_leak(busy)


def test_top_logprobs_follow_the_processed_distribution(llm):
    prompt, sp = PROMPTS[0], params(2, logprobs=5)
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert len(out.top_logprobs) == len(out.token_ids) == 20
    for token, logprob, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        best = max(top, key=top.get)
        assert best == token and abs(top[best] - logprob) < 1e-6, "greedy = top-1"
        assert len(top) == 5 and 41 not in top, "a -100 bias leaves the top 5"
        assert sum(np.exp(v) for v in top.values()) <= 1.0 + 1e-5
    plain = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, logprobs=0),
                         use_tqdm=False)[0]
    assert plain.top_logprobs is None and len(plain.logprobs) == 3


def test_seeded_sampling_with_processors_is_reproducible(llm):
    sp = params(1, temperature=0.9, seed=11)
    first = llm.generate([PROMPTS[1]], sp, use_tqdm=False)[0].token_ids
    again = llm.generate([PROMPTS[1], PROMPTS[0]], [sp, params(0)], use_tqdm=False)[0].token_ids
    assert first == again


def test_speculation_pauses_while_a_request_uses_processors():
    spec = make_llm(speculative_method="ngram", num_speculative_tokens=3)
    feats = requests()[:4]
    outs = spec.generate([p for p, _ in feats], [sp for _, sp in feats], use_tqdm=False)
    plain = make_llm().generate([p for p, _ in feats], [sp for _, sp in feats], use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    stats = spec.engine.speculation.policy.stats
    drafts0 = stats.num_draft_tokens
    spec.generate([[7, 8, 9, 10] * 6], SamplingParams(max_tokens=20, temperature=0.0),
                  use_tqdm=False)
    assert stats.num_draft_tokens > drafts0, "speculation resumes once they are gone"
    assert_idle_and_no_leak(spec)


@pytest.mark.parametrize("kwargs, field", [
    (dict(logit_bias={500: 1.0}), "logit_bias"),
    (dict(allowed_token_ids=[3, 128]), "allowed_token_ids"),
])
def test_token_ids_outside_the_vocabulary_are_refused(llm, kwargs, field):
    with pytest.raises(ValueError, match=f"{field}.*vocabulary"):
        llm.engine.make_request([5, 6], SamplingParams(**kwargs))


def test_n_samples_share_one_prefill_and_each_reproduces_alone(llm, monkeypatch):
    from jaxserve.core.request import sample_seed

    prompt = list(range(5, 75))  # 70 tokens: four full pages of 16 and a partial one
    sp = SamplingParams(max_tokens=12, temperature=0.9, seed=5, n=4, ignore_eos=True,
                        presence_penalty=0.5)
    sched, plans = llm.engine.scheduler, []
    original = sched.schedule
    monkeypatch.setattr(sched, "schedule", lambda: plans.append(original()) or plans[-1])
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    monkeypatch.undo()
    assert [c.index for c in out.outputs] == [0, 1, 2, 3] and out.finished
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4, "each sample has its own seed"
    prefill = {}  # sample id -> prompt tokens it computed
    tables = {}
    for plan in plans:
        for chunk in plan.chunks:
            if chunk.start_position < len(prompt):
                prefill[chunk.request_id] = prefill.get(chunk.request_id, 0) + min(
                    chunk.kv_len, len(prompt)) - chunk.start_position
            if chunk.pages is not None:  # (the change of its table since its last chunk)
                tables[chunk.request_id] = chunk.pages.apply(tables.get(chunk.request_id, ()))
    first, = [rid for rid in prefill if "#" not in rid]  # sample 0 (the engine's id)
    assert prefill[first] == len(prompt)
    others = [rid for rid in prefill if rid != first]
    assert len(others) == 3 and all(prefill[rid] == len(prompt) - 64 for rid in others), prefill
    assert all(tables[rid][:4] == tables[first][:4] for rid in others), "prompt pages shared"
    assert len({tables[rid][4] for rid in tables}) == 4, "each sample its own last page"
    for i, c in enumerate(out.outputs):
        alone = SamplingParams(max_tokens=12, temperature=0.9, seed=sample_seed(5, i),
                               ignore_eos=True, presence_penalty=0.5)
        assert llm.generate([prompt], alone, use_tqdm=False)[0].token_ids == c.token_ids, i
    assert_idle_and_no_leak(llm)


def test_aborting_an_n_request_aborts_every_sample(llm):
    engine = llm.engine
    rid = engine.add_request(list(range(5, 40)), SamplingParams(max_tokens=50, n=3))
    engine.step()
    out = engine.abort(rid)
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"] * 3
    while engine.has_unfinished():
        engine.step()
    assert_idle_and_no_leak(llm)


def test_prompt_logprobs_equal_transformers_through_chunks_preemption_and_a_cached_prefix():
    from tiny_models import hf_logits, hf_model, tiny_model

    model = hf_model(*tiny_model())
    busy = make_llm(max_num_batched_tokens=16, num_pages=12, token_buckets=(16,),
                    seq_buckets=(4, 16))
    shared = list(range(5, 40))
    prompts = [shared + [50, 51, 52], shared + [60, 61]]  # the second finds the first cached
    sp = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    filler, filler_params = mixed_requests(n=6, seed=8, max_prompt=40, max_out=30)
    outs = busy.generate(prompts + filler, [sp, sp] + filler_params, use_tqdm=False)
    assert busy.engine.scheduler.num_preemptions > 0, "meant to force preemption"
    for prompt, out in zip(prompts, outs):
        logits = hf_logits(model, prompt).astype(np.float64)
        logsm = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(
            -1, keepdims=True)) - logits.max(-1, keepdims=True)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for p in range(len(prompt) - 1):
            entry = out.prompt_logprobs[p + 1]
            assert abs(entry[prompt[p + 1]] - logsm[p, prompt[p + 1]]) < 1e-4, p
            best = np.argsort(-logsm[p])[:3]
            assert set(best) <= set(entry) and len(entry) <= 4
    assert_idle_and_no_leak(busy)
