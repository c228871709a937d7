"""Prometheus metrics under vLLM's names (`vllm:*`), next to jaxserve's own, for the routers and
autoscalers that read a vLLM server's: llm-d, the Gateway API inference extension's endpoint
picker (queue depth, KV-cache use), HPA rules on vllm:num_requests_waiting, vLLM dashboards.

Same names, labels (model_name: the served model's name; engine: the engine's index, "0"
without data parallelism), units and meanings as vLLM's v1 metrics; docs/metrics.md has the
table. State (queues, KV-cache use, preemptions, prefix-cache queries and hits) is read at
scrape time from the engine's latest EngineStats snapshot, as jaxserve's own gauges are; the
request histograms and token counters are recorded by EngineMetrics on the engine thread. The
inter-token latency, one observation per request and step, goes through a bulk histogram
(bisect over the bounds, one lock per step) to keep its cost off the step. No jax here.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)
from prometheus_client.registry import Collector

from jaxserve.engine.info import EngineStats

LABELS = ["model_name", "engine"]
FINISH_REASONS = ("stop", "length", "abort", "error")
# vLLM's buckets, so that dashboards and alert rules written for it read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class _StateCollector(Collector):
    """vLLM's scheduler and cache state, from the latest EngineStats at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats], labels: list[str]):
        self.stats, self.labels = stats, labels

    def collect(self) -> Iterable:
        st = self.stats()
        for kind, name, doc, value in (
                (GaugeMetricFamily, "num_requests_running",
                 "Number of requests in model execution batches.", st.num_running),
                (GaugeMetricFamily, "num_requests_waiting", "Number of requests waiting to be "
                 "processed (preempted ones included, swapped to host memory or not).",
                 st.num_waiting + st.num_swapped),
                (GaugeMetricFamily, "kv_cache_usage_perc",
                 "KV-cache usage. 1 means 100 percent usage.", st.kv_usage),
                (GaugeMetricFamily, "gpu_cache_usage_perc", "KV-cache usage. 1 means 100 "
                 "percent usage. DEPRECATED in vLLM: use vllm:kv_cache_usage_perc.",
                 st.kv_usage),
                (CounterMetricFamily, "num_preemptions",
                 "Cumulative number of preemption from the engine.", st.num_preemptions),
                (CounterMetricFamily, "prefix_cache_queries",
                 "Prefix cache queries, in terms of number of queried tokens.",
                 st.prefix_query_tokens),
                (CounterMetricFamily, "prefix_cache_hits",
                 "Prefix cache hits, in terms of number of cached tokens.",
                 st.prefix_hit_tokens)):
            family = kind("vllm:" + name, doc, labels=LABELS)
            family.add_metric(self.labels, value)
            yield family


class _BulkHistogram(Collector):
    """A histogram fed a step's observations at once, exposed under one or more names."""

    def __init__(self, names: tuple[tuple[str, str], ...], bounds: tuple[float, ...],
                 labels: list[str]):
        self.names, self.bounds, self.labels = names, bounds, labels
        self._counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe_many(self, values: list[float]) -> None:
        bounds, counts = self.bounds, self._counts
        with self._lock:
            for v in values:
                counts[bisect_left(bounds, v)] += 1
            self._sum += sum(values)

    def collect(self) -> Iterable:
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, count in zip((*map(str, self.bounds), "+Inf"), counts):
            running += count
            cumulative.append((bound, running))
        for name, doc in self.names:
            family = HistogramMetricFamily(name, doc, labels=LABELS)
            family.add_metric(self.labels, cumulative, total)
            yield family


class VllmMetrics:
    """vLLM-named metrics of one engine, in the engine's registry."""

    def __init__(self, registry: CollectorRegistry, stats: Callable[[], EngineStats],
                 model_name: str, max_model_len: int, engine_index: int = 0):
        self.labels = [model_name, str(engine_index)]  # (shared with the collectors)
        registry.register(_StateCollector(stats, self.labels))
        self.inter_token = _BulkHistogram(
            (("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in "
              "seconds."),
             ("vllm:time_per_output_token_seconds", "Histogram of time per output token in "
              "seconds. DEPRECATED in vLLM: use vllm:inter_token_latency_seconds.")),
            TOKEN_BUCKETS, self.labels)
        registry.register(self.inter_token)
        token_buckets = buckets_1_2_5(max_model_len)
        self._parents = {
            "prompt_tokens": Counter("vllm:prompt_tokens", "Number of prefill tokens "
                                     "processed.", LABELS, registry=registry),
            "generation_tokens": Counter("vllm:generation_tokens", "Number of generation "
                                         "tokens processed.", LABELS, registry=registry),
            "ttft": Histogram("vllm:time_to_first_token_seconds", "Histogram of time to "
                              "first token in seconds.", LABELS, buckets=TTFT_BUCKETS,
                              registry=registry),
            "e2e": Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request "
                             "latency in seconds.", LABELS, buckets=REQUEST_BUCKETS,
                             registry=registry),
            "queue": Histogram("vllm:request_queue_time_seconds", "Histogram of time spent in "
                               "WAITING phase for request.", LABELS, buckets=REQUEST_BUCKETS,
                               registry=registry),
            "tpot": Histogram("vllm:request_time_per_output_token_seconds", "Histogram of "
                              "time_per_output_token_seconds per request.", LABELS,
                              buckets=TOKEN_BUCKETS, registry=registry),
            "prompt_len": Histogram("vllm:request_prompt_tokens", "Number of prefill tokens "
                                    "processed.", LABELS, buckets=token_buckets,
                                    registry=registry),
            "output_len": Histogram("vllm:request_generation_tokens", "Number of generation "
                                    "tokens processed.", LABELS, buckets=token_buckets,
                                    registry=registry),
        }
        self._success = Counter("vllm:request_success", "Count of successfully processed "
                                "requests.", LABELS + ["finished_reason"], registry=registry)
        self._bind()

    def _bind(self) -> None:
        for attr, parent in self._parents.items():
            setattr(self, attr, parent.labels(*self.labels))
        self.success = {reason: self._success.labels(*self.labels, reason)
                        for reason in FINISH_REASONS}

    def set_model_name(self, model_name: str) -> None:
        """Label everything with the name clients use (the served model name); before serving:
        what was recorded under the old name is dropped."""
        old = list(self.labels)
        if model_name == old[0]:
            return
        for parent in self._parents.values():
            parent.remove(*old)
        for reason in FINISH_REASONS:
            self._success.remove(*old, reason)
        self.labels[0] = model_name
        self._bind()

    def finished(self, reason: str | None, latency: float | None, num_prompt_tokens: int,
                 num_generation_tokens: int, time_per_output_token: float | None) -> None:
        counter = self.success.get(reason)
        if counter is None and reason is not None:  # (a reason vLLM has no label for)
            counter = self.success[reason] = self._success.labels(*self.labels, reason)
        if counter is not None:
            counter.inc()
        if latency is not None:
            self.e2e.observe(latency)
        self.prompt_len.observe(num_prompt_tokens)
        self.output_len.observe(num_generation_tokens)
        if time_per_output_token is not None:
            self.tpot.observe(time_per_output_token)
