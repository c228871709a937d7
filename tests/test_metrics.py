"""Prometheus metrics: what the engine counts matches what it did, and /metrics serves it."""

from __future__ import annotations

import urllib.request

from jaxserve import SamplingParams
from jaxserve.entrypoints.cli import build_parser

FINISHED = "jaxserve_requests_finished_total"


def sample(llm, name: str, **labels) -> float:
    return llm.engine.metrics.registry.get_sample_value(name, labels) or 0.0


def test_tokens_latencies_and_finish_reasons_match_the_run(small_llm):
    names = ["jaxserve_generation_tokens_total", "jaxserve_prompt_tokens_total",
             "jaxserve_time_to_first_token_seconds_count",
             "jaxserve_time_per_output_token_seconds_count",
             "jaxserve_e2e_request_latency_seconds_count", "jaxserve_engine_steps_total",
             "jaxserve_step_duration_seconds_count"]
    before = {n: sample(small_llm, n) for n in names}
    length_before = sample(small_llm, FINISHED, finish_reason="length")
    prompts = [[5, 6, 7], list(range(3, 40)), [9]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (5, 7, 1)]
    outs = small_llm.generate(prompts, params, use_tqdm=False)
    delta = {n: sample(small_llm, n) - before[n] for n in names}

    assert delta["jaxserve_generation_tokens_total"] == sum(len(o.token_ids) for o in outs) == 13
    assert delta["jaxserve_prompt_tokens_total"] == 3 + 37 + 1
    assert delta["jaxserve_time_to_first_token_seconds_count"] == 3
    assert delta["jaxserve_e2e_request_latency_seconds_count"] == 3
    assert delta["jaxserve_time_per_output_token_seconds_count"] == 2  # 1-token request: none
    assert sample(small_llm, FINISHED, finish_reason="length") - length_before == 3
    assert delta["jaxserve_engine_steps_total"] == delta["jaxserve_step_duration_seconds_count"]
    assert delta["jaxserve_engine_steps_total"] >= 7  # the longest request decodes 7 tokens
    # Idle again: nothing queued or running, no KV page held (cached pages count as free).
    for gauge in ("running", "waiting", "swapped"):
        assert sample(small_llm, f"jaxserve_num_requests_{gauge}") == 0
    assert sample(small_llm, "jaxserve_kv_cache_usage_ratio") == 0


def test_abort_is_counted_and_gauges_follow_the_engine_between_steps(small_llm):
    engine = small_llm.engine
    before = sample(small_llm, FINISHED, finish_reason="abort")
    rid = engine.add_request([4, 5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
    assert sample(small_llm, "jaxserve_num_requests_waiting") == 1
    engine.step()
    assert sample(small_llm, "jaxserve_num_requests_running") == 1
    assert sample(small_llm, "jaxserve_kv_cache_usage_ratio") > 0
    engine.abort(rid)
    assert sample(small_llm, FINISHED, finish_reason="abort") - before == 1
    assert sample(small_llm, "jaxserve_num_requests_running") == 0
    assert sample(small_llm, "jaxserve_kv_cache_usage_ratio") == 0
    assert not engine.has_unfinished()


def test_metrics_endpoint_serves_the_prometheus_text_format(small_llm):
    small_llm.generate([[3, 4, 5]], SamplingParams(max_tokens=2, ignore_eos=True),
                       use_tqdm=False)
    server, thread = small_llm.engine.metrics.serve_http(0)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200
            text = response.read().decode()
    finally:
        server.shutdown()
        thread.join(10)
    assert 'jaxserve_requests_finished_total{finish_reason="length"}' in text
    assert "jaxserve_num_requests_running 0.0" in text
    assert "# TYPE jaxserve_time_to_first_token_seconds histogram" in text
    assert "# TYPE jaxserve_preemptions_total counter" in text


def test_serve_flag():
    assert build_parser().parse_args(["serve", "--metrics-port", "9100"]).metrics_port == 9100
    assert build_parser().parse_args(["serve"]).metrics_port is None
