"""The serving benchmark: metric arithmetic on hand-made timelines, arrival times, request sets,
and one small `jaxserve bench serve` run against an in-process tiny-model server."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from jaxserve.bench.arrivals import arrival_times
from jaxserve.bench.datasets import (ServeRequest, build_requests, chat_requests,
                                     load_chat_prompts, vary_lengths)
from jaxserve.bench.serve import fit_to_model, parse_goodput
from jaxserve.bench.stats import RequestTimeline, goodput, report, summarize


# ---- metrics ----------------------------------------------------------------------------------
def test_ttft_tpot_itl_and_e2e_of_one_timeline():
    t = RequestTimeline(arrival=10.0, token_times=[10.5, 10.7, 11.0, 11.1])
    assert t.ttft == pytest.approx(0.5), "TTFT is first token time minus arrival"
    assert t.e2e == pytest.approx(1.1), "end-to-end is last token time minus arrival"
    assert t.tpot == pytest.approx(0.6 / 3), "TPOT averages the gaps after the first token"
    assert t.itls == pytest.approx([0.2, 0.3, 0.1]), "ITL lists every gap between tokens"


def test_tpot_is_undefined_for_a_single_token():
    t = RequestTimeline(arrival=0.0, token_times=[0.3])
    assert t.tpot is None and t.itls == []


def test_summary_mean_median_and_p99_interpolate_like_numpy():
    s = summarize(range(1, 101))
    assert s["mean"] == pytest.approx(50.5) and s["median"] == pytest.approx(50.5)
    assert s["p99"] == pytest.approx(99.01), "p99 uses linear interpolation"


def test_summary_skips_none_and_is_nan_when_empty():
    assert summarize([None, 2.0, None, 4.0])["mean"] == pytest.approx(3.0)
    assert all(math.isnan(v) for v in summarize([None]).values())


def test_goodput_counts_only_finished_requests_that_meet_every_slo():
    timelines = [
        RequestTimeline(0.0, [0.1, 0.2, 0.3]),          # meets both
        RequestTimeline(0.0, [0.9, 1.0]),               # TTFT 0.9 > 0.5
        RequestTimeline(0.0, [0.1, 0.5, 0.9]),          # TPOT 0.4 > 0.2
        RequestTimeline(0.0, [0.2]),                    # single token: TPOT does not apply
        RequestTimeline(0.0, [0.1, 0.2], ok=False),     # failed
    ]
    assert goodput(timelines, 2.0, ttft_slo=0.5, tpot_slo=0.2) == pytest.approx(1.0)
    assert goodput(timelines, 2.0, ttft_slo=0.5) == pytest.approx(1.5)
    assert goodput(timelines, 2.0) == pytest.approx(2.0), "no SLO: every finished request"


def test_report_counts_tokens_and_throughputs_over_finished_requests():
    timelines = [RequestTimeline(0.0, [1.0, 2.0], num_prompt_tokens=10),
                 RequestTimeline(1.0, [1.5, 2.0, 3.0], num_prompt_tokens=20),
                 RequestTimeline(0.0, [], num_prompt_tokens=30, ok=False)]
    r = report(timelines, duration=4.0)
    assert (r["completed"], r["failed"]) == (2, 1)
    assert r["total_output_tokens"] == 5 and r["total_input_tokens"] == 30
    assert r["output_throughput"] == pytest.approx(1.25)
    assert r["input_throughput"] == pytest.approx(7.5)
    assert r["request_throughput"] == pytest.approx(0.5)
    assert r["ttft_s"]["mean"] == pytest.approx(0.75)
    assert r["itl_s"]["median"] == pytest.approx(1.0), "ITLs pooled over requests: 1, .5, 1"


# ---- arrivals ---------------------------------------------------------------------------------
def test_infinite_rate_sends_everything_at_once():
    assert arrival_times(5, math.inf).tolist() == [0.0] * 5


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0])
def test_arrivals_keep_the_mean_rate_whatever_the_burstiness(burstiness):
    t = arrival_times(20_000, 4.0, burstiness, seed=1)
    assert t[0] == 0.0 and np.all(np.diff(t) >= 0)
    assert len(t) / t[-1] == pytest.approx(4.0, rel=0.05), "mean rate is the request rate"


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_burstiness_sets_the_spread_of_the_gaps(burstiness):
    gaps = np.diff(arrival_times(20_000, 2.0, burstiness, seed=2))
    cv2 = gaps.var() / gaps.mean() ** 2
    assert cv2 == pytest.approx(1 / burstiness, rel=0.1), (
        "Gamma(shape=b) gaps have squared coefficient of variation 1/b (Poisson: 1)")


def test_arrivals_are_deterministic_for_a_seed_and_reject_bad_rates():
    assert np.array_equal(arrival_times(50, 3.0, seed=7), arrival_times(50, 3.0, seed=7))
    assert not np.array_equal(arrival_times(50, 3.0, seed=7), arrival_times(50, 3.0, seed=8))
    for rate, burst in [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0), (1.0, math.inf)]:
        with pytest.raises(ValueError):
            arrival_times(3, rate, burst)


# ---- datasets ---------------------------------------------------------------------------------
def test_bundled_chat_prompts_are_well_formed_conversations():
    records = load_chat_prompts()
    assert len(records) >= 100
    for i, r in enumerate(records):
        roles = [m["role"] for m in r["messages"]]
        assert set(roles) <= {"system", "user", "assistant"}, f"record {i}: roles {roles}"
        assert roles[-1] == "user", f"record {i} must end with the user's turn"
        assert all(m["content"].strip() for m in r["messages"]), f"record {i}: empty content"
        assert r["output_len"] >= 1
    assert len({r["messages"][-1]["content"] for r in records}) == len(records), "duplicates"


def test_chat_requests_cycle_the_prompts_in_a_seeded_order():
    a, b = chat_requests(250, seed=3), chat_requests(250, seed=3)
    assert a == b and len(a) == 250
    assert len({repr(r.messages) for r in a[:100]}) == 100, "the first pass uses every prompt once"
    assert chat_requests(10, seed=4) != chat_requests(10, seed=3)
    assert all(r.prompt_token_ids is None and r.messages for r in a)


def test_output_len_and_range_ratio_override_the_dataset_lengths():
    reqs = chat_requests(200, seed=0, output_len=40, range_ratio=0.5)
    lengths = [r.max_tokens for r in reqs]
    assert min(lengths) >= 20 and max(lengths) <= 60 and len(set(lengths)) > 10
    assert vary_lengths(7, 4, 0.0, np.random.default_rng(0)) == [7, 7, 7, 7]
    with pytest.raises(ValueError):
        vary_lengths(7, 4, 1.0, np.random.default_rng(0))


def test_token_datasets_have_the_asked_shapes():
    rand = build_requests("random", 6, vocab_size=100, input_len=12, output_len=5)
    assert all(len(r.prompt_token_ids) == 12 and r.max_tokens == 5 for r in rand)
    assert all(3 <= t < 100 for r in rand for t in r.prompt_token_ids)
    shared = build_requests("shared-prefix", 4, vocab_size=100, input_len=16, output_len=3)
    prefixes = {r.prompt_token_ids[:64] for r in shared}
    assert len(prefixes) == 1, "shared-prefix requests share a 4 x input_len prefix"
    assert len({r.prompt_token_ids for r in shared}) == 4, "each has its own suffix"
    anyscale = build_requests("anyscale", 20, vocab_size=100)
    assert all(16 <= len(r.prompt_token_ids) <= 512 for r in anyscale)
    with pytest.raises(ValueError, match="dataset must be"):
        build_requests("sharegpt", 1, vocab_size=100)


def test_goodput_flag_parsing_and_fitting_requests_to_the_model():
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    for bad in (["e2e:5"], ["ttft"], ["tpot:0"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    fitted = fit_to_model([ServeRequest(100, (1, 2)), ServeRequest(5, (1,))], [30, 10], 64)
    assert [r.max_tokens for r in fitted] == [34, 5]


# ---- end to end -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_server():
    from conftest import SMALL_ENGINE
    from tiny_models import tiny_loaded

    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.config import EngineConfig
    from jaxserve.engine.engine import Engine
    from jaxserve.entrypoints.grpc.background import ServerThread

    engine = Engine(EngineConfig.from_kwargs(**SMALL_ENGINE), loaded=tiny_loaded(),
                    progress=False)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    server = ServerThread(async_engine, "127.0.0.1", 0)
    yield server.address
    server.stop(timeout=1.0)
    async_engine.stop(timeout=10.0)


def test_bench_serve_reports_every_request_of_a_poisson_load(tiny_server, tmp_path):
    from jaxserve.entrypoints.cli import main

    out = tmp_path / "result.json"
    rc = main(["bench", "serve", "--address", tiny_server, "--dataset", "random",
               "--num-prompts", "8", "--input-len", "24", "--output-len", "6",
               "--request-rate", "20", "--goodput", "ttft:60000", "--json", str(out),
               "--quiet"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert (r["completed"], r["failed"]) == (8, 0), r["errors"]
    assert r["total_output_tokens"] == 48 and r["total_input_tokens"] == 8 * 24
    assert len(r["raw"]["itl_s"]) == 8 * 5, "one ITL per token after the first"
    assert r["goodput"] == pytest.approx(r["request_throughput"])
    assert 0 < r["ttft_s"]["median"] <= r["e2e_s"]["median"]


def test_bench_serve_sends_chat_prompts_through_the_template(tiny_server, tmp_path):
    from jaxserve.bench.serve import benchmark

    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}],
                                        "output_len": 4}) + "\n"
                            for q in ("hi", "what is 2+2?", "name a color")))
    requests = chat_requests(5, seed=0, path=path)
    r = benchmark(tiny_server, requests, request_rate=math.inf, max_concurrency=2)
    assert (r["completed"], r["failed"]) == (5, 0), r["errors"]
    # CharTokenizer's template: "user: {q}\nassistant: " -> one token per byte.
    want = sum(len(f"user: {m['content']}\nassistant: ")
               for q in requests for m in q.messages)
    assert r["total_input_tokens"] == want, "prompt tokens come from the rendered template"
