"""Speculative decoding end to end on tiny random Llamas, and the rejection sampler's statistics.

Engines with speculation share the SMALL_ENGINE shapes (cheap through the compile cache) and
speculate at every batch size (speculative_disable_by_batch_size=16), so a busy batch verifies
drafts while preemption happens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import SMALL_ENGINE, make_llm
from jaxserve import SamplingParams
from jaxserve.runner.compile_count import CompileCounter
from jaxserve.spec.rejection import rejection_sample, sample_and_compare
from test_engine import assert_idle_and_no_leak

SPEC_CONFIGS = {
    "ngram-k2": dict(speculative_method="ngram", num_speculative_tokens=2),
    "ngram-k5": dict(speculative_method="ngram", num_speculative_tokens=5),
    "draft-layers1-k3": dict(speculative_method="draft", num_speculative_tokens=3,
                             speculative_draft="layers:1"),
    "draft-dir-k4": dict(speculative_method="draft", num_speculative_tokens=4),
    "draft-dir-k4-swap": dict(speculative_method="draft", num_speculative_tokens=4,
                              preemption_mode="swap"),
}
DRAFT_DIRS = {"draft-dir-k4": "whole", "draft-dir-k4-swap": "whole",
              "draft-layer0-dir-k3": "layer0"}
BUSY_BATCH_CONFIGS = list(SPEC_CONFIGS)
SPEC_CONFIGS["draft-layer0-dir-k3"] = dict(speculative_method="draft", num_speculative_tokens=3)


@pytest.fixture(scope="module")
def draft_dirs(tmp_path_factory):
    """Hugging Face directories of the tiny target itself ("whole": a draft that always agrees)
    and of its first layer alone ("layer0": what `layers:1` cuts out of it)."""
    import dataclasses

    from model_fixtures import tiny_tokenizer
    from tiny_models import tiny_model

    from jaxserve.model.loaders.loader import save_hf_directory
    config, params = tiny_model(seed=0)
    first = {k: (v[:1] if k.startswith("layers.") else v) for k, v in params.items()}
    dirs = {"whole": tmp_path_factory.mktemp("whole"), "layer0": tmp_path_factory.mktemp("l0")}
    save_hf_directory(dirs["whole"], config, params, tiny_tokenizer())
    save_hf_directory(dirs["layer0"], dataclasses.replace(config, num_layers=1), first,
                      tiny_tokenizer())
    return dirs


@pytest.fixture(scope="module")
def spec_llm(draft_dirs):
    """name -> LLM with that speculative config, each built once for the module."""
    @functools.cache
    def build(name):
        settings = dict(SPEC_CONFIGS[name], speculative_disable_by_batch_size=16)
        if name not in DRAFT_DIRS:
            return make_llm(**settings)
        from model_fixtures import tiny_tokenizer
        from tiny_models import TinyLoaded, tiny_model

        from jaxserve.entrypoints.llm import LLM
        loaded = TinyLoaded(*tiny_model(seed=0), tokenizer=tiny_tokenizer())
        return LLM(loaded=loaded, progress=False,
                   speculative_draft=str(draft_dirs[DRAFT_DIRS[name]]),
                   **{**SMALL_ENGINE, **settings})
    return build


def repetitive_requests(n=64, seed=0, vocab=128, max_prompt=300, max_out=100):
    """Prompts that repeat a short unit (with a few edits), some plain random ones."""
    rng = np.random.default_rng(seed)
    prompts, params = [], []
    for i in range(n):
        length = int(rng.integers(1, max_prompt + 1))
        if i % 4 == 3:
            prompt = rng.integers(3, vocab, length)
        else:
            prompt = np.resize(rng.integers(3, vocab, rng.integers(2, 16)), length)
            edits = rng.integers(0, length, length // 20)
            prompt[edits] = rng.integers(3, vocab, len(edits))
        prompts.append(prompt.tolist())
        params.append(SamplingParams(max_tokens=int(rng.integers(1, max_out + 1)),
                                     temperature=0.0, ignore_eos=True))
    return prompts, params


@pytest.fixture(scope="module")
def greedy_plain(small_llm):
    prompts, params = repetitive_requests()
    return [o.token_ids for o in small_llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("name", BUSY_BATCH_CONFIGS)
def test_greedy_busy_batch_with_preemption_is_token_identical(name, spec_llm, greedy_plain):
    llm = spec_llm(name)
    stats, sched = llm.engine.speculation.policy.stats, llm.engine.scheduler
    accepted0, drafts0 = stats.num_accepted_tokens, stats.num_draft_tokens
    preemptions0, swaps0 = sched.num_preemptions, sched.num_swaps
    prompts, params = repetitive_requests()
    with CompileCounter() as compiles:
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert sched.num_preemptions > preemptions0, "the page pool was meant to force preemption"
    if name.endswith("swap"):
        assert sched.num_swaps > swaps0, "swap mode never swapped"
    num_drafts = stats.num_draft_tokens - drafts0
    acceptance = (stats.num_accepted_tokens - accepted0) / max(num_drafts, 1)
    assert num_drafts > 0 and acceptance > 0, f"{num_drafts} drafts, acceptance {acceptance}"
    if name.startswith("ngram"):
        assert acceptance > 0.3, f"n-gram acceptance {acceptance:.0%} is too low"
    if name.startswith("draft-dir"):  # the draft is the target: its KV must follow exactly
        assert acceptance > 0.99, f"a draft equal to the target accepted only {acceptance:.1%}"
    mismatched = [i for i, (o, ref) in enumerate(zip(outs, greedy_plain)) if o.token_ids != ref]
    assert not mismatched, f"{len(mismatched)} requests differ from the plain run: {mismatched}"
    assert compiles.count == 0, "serving compiled something after warm-up"
    assert_idle_and_no_leak(llm)


def test_many_rejections_leak_no_pages(spec_llm):
    llm = spec_llm("draft-layers1-k3")
    stats = llm.engine.speculation.policy.stats
    rejected0 = stats.num_draft_tokens - stats.num_accepted_tokens
    prompts, params = repetitive_requests(n=24, seed=3, max_prompt=120, max_out=60)
    llm.generate(prompts, params, use_tqdm=False)
    rejected = stats.num_draft_tokens - stats.num_accepted_tokens - rejected0
    assert rejected > 500, f"only {rejected} drafts were rejected"
    assert_idle_and_no_leak(llm)


def test_a_layers_draft_is_the_targets_first_layers_sharing_its_arrays(spec_llm):
    from flax import nnx
    runner = spec_llm("draft-layers1-k3").engine.runner
    target_state, draft_state = runner.verify.state
    draft = dict(nnx.to_flat_state(draft_state))
    target = dict(nnx.to_flat_state(target_state))
    assert ("layers", 0, "wq") in draft and ("layers", 1, "wq") not in draft
    for path in [("embed",), ("lm_head",), ("final_norm",), ("layers", 0, "wq")]:
        assert draft[path].get_value() is target[path].get_value(), f"{path} was copied"


def test_a_layers_draft_in_the_targets_cache_proposes_like_the_same_layers_loaded(spec_llm):
    """layers:1 works in the target's KV cache; the same layer loaded from a directory keeps a
    cache of its own, synced every step. Same weights, same proposals: same acceptance."""
    prompts, params = repetitive_requests(n=16, seed=4, max_prompt=100, max_out=40)
    counts = []
    for name in ("draft-layers1-k3", "draft-layer0-dir-k3"):
        llm = spec_llm(name)
        stats = llm.engine.speculation.policy.stats
        before = (stats.num_draft_tokens, stats.num_accepted_tokens)
        llm.generate(prompts, params, use_tqdm=False)
        counts.append((stats.num_draft_tokens - before[0], stats.num_accepted_tokens - before[1]))
        assert_idle_and_no_leak(llm)
    (drafts_a, accepted_a), (drafts_b, accepted_b) = counts
    assert drafts_a == drafts_b and accepted_a > 20, counts
    assert abs(accepted_a - accepted_b) <= max(2, accepted_a // 50), counts


def test_stops_inside_accepted_runs_match_the_plain_engine(spec_llm, small_llm):
    llm = spec_llm("ngram-k5")
    prompt = [9, 10, 11, 12] * 6
    plain = dict(max_tokens=40, temperature=0, ignore_eos=True)
    free = small_llm.generate([prompt], SamplingParams(**plain), use_tqdm=False)[0]
    text, tokens = free.text, free.token_ids
    stops = [dict(max_tokens=17), dict(stop_token_ids=[tokens[11]]), dict(stop=[text[9:11]])]
    accepted0 = llm.engine.speculation.policy.stats.num_accepted_tokens
    for stop in stops:
        sp = SamplingParams(**{**plain, **stop})
        want = small_llm.generate([prompt], sp, use_tqdm=False)[0]
        got = llm.generate([prompt], sp, use_tqdm=False)[0]
        assert (got.token_ids, got.text, got.finish_reason) == (
            want.token_ids, want.text, want.finish_reason), f"stop {stop} differs"
    assert llm.engine.speculation.policy.stats.num_accepted_tokens > accepted0
    assert_idle_and_no_leak(llm)


def test_seeded_sampling_with_ngram_draws_the_same_tokens_as_without(spec_llm, small_llm):
    prompts, _ = repetitive_requests(n=12, seed=1, max_prompt=60)
    params = [SamplingParams(max_tokens=30, temperature=0.8, top_k=20, top_p=0.95, seed=7 + i,
                             ignore_eos=True) for i in range(len(prompts))]
    llm = spec_llm("ngram-k5")
    accepted0 = llm.engine.speculation.policy.stats.num_accepted_tokens
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    want = [o.token_ids for o in small_llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert llm.engine.speculation.policy.stats.num_accepted_tokens > accepted0
    assert_idle_and_no_leak(llm)


def test_seeded_sampling_with_a_draft_model_is_reproducible(spec_llm):
    """Rejection sampling draws differ from plain sampling and depend on the drafts a request
    got, so the same requests under the same schedule (prefix cache emptied) repeat exactly."""
    prompts, _ = repetitive_requests(n=12, seed=2, max_prompt=60)
    params = [SamplingParams(max_tokens=30, temperature=1.0, seed=11 + i, ignore_eos=True)
              for i in range(len(prompts))]
    llm = spec_llm("draft-dir-k4")
    stats = llm.engine.speculation.policy.stats
    accepted0 = stats.num_accepted_tokens
    llm.engine.pages.reset_prefix_cache()
    first = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert stats.num_accepted_tokens > accepted0, "no sampled draft was accepted"
    llm.engine.pages.reset_prefix_cache()
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == first
    assert_idle_and_no_leak(llm)


# ---- the rejection sampler's output distribution -----------------------------------------
VOCAB = 6
NUM_SAMPLES = 40_000
CHI2_CRITICAL = 20.52  # chi-square, 5 degrees of freedom, p = 0.001
P = np.array([0.30, 0.25, 0.20, 0.12, 0.08, 0.05])
Q = np.array([0.05, 0.10, 0.15, 0.20, 0.20, 0.30])


def draws(rule, p, q, seed=0):
    """NUM_SAMPLES emitted tokens: a draft d ~ q per sample, then `rule` decides."""
    key_draft, key_rule = jax.random.split(jax.random.key(seed))
    probs = lambda x: jnp.broadcast_to(jnp.asarray(x, jnp.float32), (NUM_SAMPLES, VOCAB))
    drafts = jax.random.categorical(key_draft, jnp.log(probs(q))).astype(jnp.int32)
    accepted, tokens = rule(probs(p), probs(q), drafts, jax.random.split(key_rule, NUM_SAMPLES))
    return np.asarray(tokens), np.asarray(accepted), np.asarray(drafts)


def chi_square(tokens, p) -> float:
    expected = NUM_SAMPLES * p
    observed = np.bincount(tokens, minlength=VOCAB)
    return float(((observed - expected) ** 2 / expected).sum())


def wrong_rule_resampling_from_p(p, q, drafts, keys):
    """Accepts with min(1, p/q) but resamples from p instead of the residual: biased."""
    accepted, _ = rejection_sample(p, q, drafts, keys)
    resampled = jax.vmap(jax.random.categorical)(keys, jnp.log(p)).astype(jnp.int32)
    return accepted, jnp.where(accepted, drafts, resampled)


def test_rejection_sampling_reproduces_the_target_distribution():
    tokens, accepted, _ = draws(rejection_sample, P, Q)
    assert chi_square(tokens, P) < CHI2_CRITICAL, np.bincount(tokens) / NUM_SAMPLES
    want_rate = np.minimum(P, Q).sum()  # P(accept) = sum_x min(p, q) = 1 - TV(p, q)
    assert abs(accepted.mean() - want_rate) < 0.01, (accepted.mean(), want_rate)


def test_the_chi_square_check_catches_a_wrong_acceptance_rule():
    tokens, _, _ = draws(wrong_rule_resampling_from_p, P, Q)
    assert chi_square(tokens, P) > 10 * CHI2_CRITICAL, "the test has no power: it would not " \
                                                       "notice a wrong rule"


def test_one_hot_proposals_accept_with_probability_p_of_the_draft():
    """n-gram drafts: q is one-hot, so P(accept d) = p(d) and the output is still p."""
    rule = lambda p, q, d, keys: sample_and_compare(jnp.log(p), d, keys)
    tokens, accepted, drafts = draws(rule, P, Q)
    assert chi_square(tokens, P) < CHI2_CRITICAL
    for d in range(VOCAB):
        rate = accepted[drafts == d].mean()
        assert abs(rate - P[d]) < 0.03, f"draft {d} accepted at {rate:.3f}, want {P[d]}"
    one_hot = lambda p, q, d, keys: rejection_sample(p, jax.nn.one_hot(d, VOCAB), d, keys)
    tokens, _, _ = draws(one_hot, P, Q, seed=1)
    assert chi_square(tokens, P) < CHI2_CRITICAL, "the general rule with a one-hot q"
