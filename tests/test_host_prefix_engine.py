"""The prefix cache's host tier in the engine: a tiny model, a device pool too small to keep
every conversation's prefix, conversations that come back.

* Greedy tokens are identical with the tier on and off, with preemption forced in both modes,
  and the tier really served the returning turns (host hit tokens > 0); also with fp8 pages
  (kv_cache_dtype fp8: the tier and swap space hold fp8 pages).
* A host hit's KV, copied back into fresh device pages, equals the KV the first computation
  wrote (bit for bit) and the KV a recompute in another engine writes (on the arrays).
* Nothing leaks: every device page free or cached at the end, zero compilations after warm-up.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import make_llm
from jaxserve import SamplingParams
from jaxserve.runner.compile_count import CompileCounter
from test_engine import assert_idle_and_no_leak

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
TIER = 64 << 20


def conversations(num: int = 8, history: int = 100, seed: int = 3):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 128, history).tolist() for _ in range(num)], rng


def multi_turn(llm, turns: int = 3) -> list[list[int]]:
    """Each turn, every conversation at once: history + answer + a new user message."""
    histories, rng = conversations()
    outs = []
    with CompileCounter() as compiles:
        for _ in range(turns):
            prompts = [h + rng.integers(3, 128, 5).tolist() for h in histories]
            results = llm.generate(prompts, GREEDY, use_tqdm=False)
            for i, r in enumerate(results):
                histories[i] = prompts[i] + list(r.outputs[0].token_ids)
                outs.append(list(r.outputs[0].token_ids))
    assert compiles.count == 0
    assert_idle_and_no_leak(llm)
    return outs


@pytest.mark.parametrize("mode,kv_cache_dtype", [("recompute", "auto"), ("swap", "auto"),
                                                 ("swap", "fp8")])
def test_greedy_tokens_identical_with_the_tier_on_and_off(mode, kv_cache_dtype):
    runs = {}
    for size in (TIER, 0):
        llm = make_llm(preemption_mode=mode, host_prefix_cache_size=size, num_pages=20,
                       kv_cache_dtype=kv_cache_dtype)
        if kv_cache_dtype == "fp8":  # the tier's host copies keep the pool's dtype
            runner = llm.engine.runner
            assert str(runner.kv[0].dtype) == "float8_e4m3fn", runner.kv[0].dtype
            assert size == 0 or runner.cache.prefix_pool.k.dtype == runner.kv[0].dtype
        runs[size] = multi_turn(llm)
        stats = llm.engine.pages.stats()
        if size:
            assert stats.host.hit_tokens > 0 and stats.host.loaded_pages > 0, stats
            assert llm.engine.scheduler.num_preemptions > 0  # the mix really preempts
            assert llm.engine.stats.host_prefix_hit_tokens == stats.host.hit_tokens
        else:
            assert stats.host is None
    assert runs[TIER] == runs[0]


def _prefix_kv(llm, request_id: str, num_pages: int) -> tuple[np.ndarray, np.ndarray]:
    """K and V of the request's first num_pages pages: [layers, num_pages, page, heads, dim]."""
    llm.engine.runner.wait()
    table = llm.engine.pages.page_table(request_id)[:num_pages]
    k, v = (np.asarray(x) for x in llm.engine.runner.kv)
    return k[:, table], v[:, table]


def _prompt_kv(llm, prompt, num_pages: int):
    """Admit one request, step until its prompt is computed (its first token is out), read its
    prefix pages; then let it finish."""
    engine = llm.engine
    request = engine.make_request(prompt, SamplingParams(max_tokens=3, temperature=0.0,
                                                         ignore_eos=True))
    engine.add(request)
    while not any(out.token_ids for out in engine.step()
                  if out.request_id == request.external_id):
        pass
    kv = _prefix_kv(llm, request.request_id, num_pages)  # (the engine's id keys its pages)
    while engine.has_unfinished():
        engine.step()
    return kv


def test_a_host_hit_loads_the_kv_a_recompute_writes():
    llm = make_llm(host_prefix_cache_size=TIER, num_pages=20)
    (prompt, *fillers), _ = conversations(num=6, history=64)
    ps = llm.engine.pages.page_size
    num_full = (len(prompt) - 1) // ps
    first_k, first_v = _prompt_kv(llm, prompt, num_full)
    llm.generate([f * 2 for f in fillers], GREEDY, use_tqdm=False)  # evicts the prompt's pages
    host = llm.engine.pages.stats().host
    assert host.num_used > 0 and llm.engine.pages.lookup_prefix(prompt)[0] == 0  # on the host
    loaded_before = host.loaded_pages
    hit_k, hit_v = _prompt_kv(llm, prompt, num_full)
    host = llm.engine.pages.stats().host
    assert host.loaded_pages - loaded_before == num_full
    np.testing.assert_array_equal(hit_k, first_k)
    np.testing.assert_array_equal(hit_v, first_v)
    fresh = make_llm(enable_prefix_caching=False)
    again_k, again_v = _prompt_kv(fresh, prompt, num_full)
    np.testing.assert_allclose(hit_k, again_k, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(hit_v, again_v, rtol=1e-5, atol=1e-6)
    assert_idle_and_no_leak(llm)


def test_bench_prefix_tier_runs_both_sides_on_the_same_requests(tmp_path):
    """`jaxserve bench prefix-tier` end to end on a tiny checkpoint: both sides ran, the tier
    side was served from the host, and the greedy answers match (no speed threshold here)."""
    import json

    from jaxserve.entrypoints.cli import main
    from scale_out_fixtures import save_tiny_checkpoint

    checkpoint = save_tiny_checkpoint(tmp_path / "tiny")
    out = tmp_path / "tier.json"
    assert main(["bench", "prefix-tier", "--model", str(checkpoint), "--conversations", "5",
                 "--turns", "2", "--history", "60", "--device-conversations", "1.5",
                 "--unique-requests", "2", "--max-num-seqs", "4", "--max-num-batched-tokens",
                 "32", "--max-model-len", "256", "--token-buckets", "16", "32", "--seq-buckets",
                 "4", "--quiet", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    on, off = result["runs"]["on"][0], result["runs"]["off"][0]
    assert result["summary"]["answers_identical"]
    assert on["host_hit_tokens"] > 0 and on["bytes_to_device"] > 0 and "host_hit_tokens" not in off
    assert result["summary"]["mean_ttft_off_over_on"] > 0
