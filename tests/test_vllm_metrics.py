"""vLLM-named Prometheus metrics (`vllm:*`) scraped from /metrics during a load, checked against
the engine's own counts: its stats snapshot (queues, KV-cache use, prefix cache, preemptions)
while the engine is held between steps, jaxserve's own counters and histograms, and at the end
what the clients received (tokens, finish reasons, one inter-token gap per later token).

One in-process HttpServer over an AsyncEngine on the tiny model, four running slots, so that
requests wait, and every step 20 ms slower, so that a scrape finds them; the vLLM model_name
label is the served name.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

SERVED = "tiny-served"
LABELS = {"model_name": SERVED, "engine": "0"}


@pytest.fixture(scope="module")
def server():
    from conftest import make_llm

    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.entrypoints.openai.http_server import HttpServer, HttpSettings

    llm = make_llm(max_num_seqs=4, seq_buckets=(4,))
    llm.engine.metrics.vllm.set_model_name(SERVED)  # (serve.py does this for --served-model-name)
    step = llm.engine.step  # 20 ms more a step: the load lasts long enough to be scraped
    llm.engine.step = lambda: (time.sleep(0.02), step())[1]
    async_engine = AsyncEngine(llm.engine)
    async_engine.start()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    http = asyncio.run_coroutine_threadsafe(
        HttpServer.start("127.0.0.1", HttpSettings(port=0)), loop).result(60)
    http.attach(async_engine)
    yield SimpleNamespace(url=http.url, model=http.state.serving.model_name, engine=llm.engine,
                          async_engine=async_engine)
    asyncio.run_coroutine_threadsafe(http.shutdown(timeout=1), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    async_engine.stop(timeout=10)
    llm.close()


def scrape(server) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of /metrics."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def vllm(samples, name: str, **extra) -> float:
    key = (name, tuple(sorted({**LABELS, **extra}.items())))
    assert key in samples, f"{name} {extra} is not on /metrics"
    return samples[key]


def own(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def check_against_the_engine(server, samples) -> None:
    st = server.engine.stats
    assert vllm(samples, "vllm:num_requests_running") == st.num_running
    assert vllm(samples, "vllm:num_requests_waiting") == st.num_waiting + st.num_swapped
    assert vllm(samples, "vllm:kv_cache_usage_perc") == pytest.approx(st.kv_usage)
    assert vllm(samples, "vllm:gpu_cache_usage_perc") == pytest.approx(st.kv_usage)
    assert 0 <= st.kv_usage <= 1
    assert vllm(samples, "vllm:num_preemptions_total") == st.num_preemptions
    assert vllm(samples, "vllm:prefix_cache_queries_total") == st.prefix_query_tokens
    assert vllm(samples, "vllm:prefix_cache_hits_total") == st.prefix_hit_tokens
    for ours, theirs in (("prompt_tokens_total", "prompt_tokens_total"),
                         ("generation_tokens_total", "generation_tokens_total"),
                         ("time_to_first_token_seconds_count",
                          "time_to_first_token_seconds_count"),
                         ("e2e_request_latency_seconds_count", "e2e_request_latency_seconds_count"),
                         ("request_queue_time_seconds_count", "request_queue_time_seconds_count"),
                         ("time_per_output_token_seconds_count",
                          "request_time_per_output_token_seconds_count")):
        assert vllm(samples, "vllm:" + theirs) == own(samples, "jaxserve_" + ours), theirs
    for reason in ("stop", "length", "abort", "error"):
        assert vllm(samples, "vllm:request_success_total", finished_reason=reason) == own(
            samples, "jaxserve_requests_finished_total", finish_reason=reason), reason
    assert vllm(samples, "vllm:inter_token_latency_seconds_count") == vllm(
        samples, "vllm:time_per_output_token_seconds_count")


def held(server):
    """The engine thread waiting between steps (its stats stand still) until resumed."""
    server.async_engine.paused.set()
    deadline = time.monotonic() + 30
    while not server.async_engine.holding.is_set():
        assert time.monotonic() < deadline, "the engine never paused"
        time.sleep(0.005)


def test_vllm_gauges_and_histograms_match_the_engine_during_a_load_and_after(server):
    prefix = list(range(3, 35))  # two shared pages: prefix-cache hits
    prompts = [prefix + [40 + i, 41 + i] for i in range(10)]
    max_tokens = [12 + 3 * i for i in range(10)]
    before = scrape(server)
    results: list = []

    async def load():
        async with httpx.AsyncClient(timeout=120) as client:
            answers = await asyncio.gather(*(client.post(
                server.url + "/v1/completions", json={
                    "model": server.model, "prompt": p, "max_tokens": n, "temperature": 0.0,
                    "ignore_eos": True}) for p, n in zip(prompts, max_tokens)))
        results.extend(r.json() for r in answers)

    runner = threading.Thread(target=lambda: asyncio.run(load()))
    runner.start()
    seen_waiting = seen_running = num_scrapes = 0
    while runner.is_alive():  # scraped while the load runs, the engine held between steps
        time.sleep(0.1)
        num_scrapes += 1
        held(server)
        try:
            samples = scrape(server)
            check_against_the_engine(server, samples)
            seen_running = max(seen_running, vllm(samples, "vllm:num_requests_running"))
            seen_waiting = max(seen_waiting, vllm(samples, "vllm:num_requests_waiting"))
        finally:
            server.async_engine.paused.clear()
    runner.join(120)
    assert num_scrapes >= 2
    assert seen_running > 0 and seen_waiting > 0, "the scrapes saw requests running and waiting"

    after = scrape(server)
    check_against_the_engine(server, after)

    def delta(name, **extra):
        return vllm(after, name, **extra) - before.get(
            (name, tuple(sorted({**LABELS, **extra}.items()))), 0.0)

    usage = [r["usage"] for r in results]
    assert [u["completion_tokens"] for u in usage] == max_tokens
    assert delta("vllm:generation_tokens_total") == sum(max_tokens)
    assert delta("vllm:request_generation_tokens_sum") == sum(max_tokens)
    assert delta("vllm:prompt_tokens_total") == sum(len(p) for p in prompts)
    assert delta("vllm:request_prompt_tokens_sum") == sum(len(p) for p in prompts)
    assert delta("vllm:request_success_total", finished_reason="length") == len(prompts)
    assert delta("vllm:e2e_request_latency_seconds_count") == len(prompts)
    assert delta("vllm:time_to_first_token_seconds_count") == len(prompts)
    assert delta("vllm:request_queue_time_seconds_count") == len(prompts)
    # One token per request and step: every token after a request's first is one gap.
    assert delta("vllm:inter_token_latency_seconds_count") == sum(n - 1 for n in max_tokens)
    assert delta("vllm:prefix_cache_hits_total") >= 32 * (len(prompts) - 4)
    assert vllm(after, "vllm:num_requests_running") == 0
    assert vllm(after, "vllm:num_requests_waiting") == 0
    assert vllm(after, "vllm:kv_cache_usage_perc") == 0
    assert vllm(after, "vllm:inter_token_latency_seconds_bucket", le="+Inf") == vllm(
        after, "vllm:inter_token_latency_seconds_count")
