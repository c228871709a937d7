"""Prometheus metrics for one engine: queue sizes, KV usage, token counts and latencies.

Two kinds, as prometheus_client intends them:
* state the scheduler and page manager already count (requests running / waiting / swapped,
  KV page usage, preemptions, prefix-cache tokens, steps) is read at scrape time by a custom
  collector from the engine's latest EngineStats snapshot (published by the engine thread
  after every step), so a scrape never touches the live queues from another thread;
* per-request events (tokens, time to first token, time per output token, end-to-end latency,
  finish reasons), queue waits and step durations are recorded by the engine thread as they
  happen.

With LoRA adapters served, vLLM's `vllm:lora_requests_info` gauge (labels running_lora_adapters
and waiting_lora_adapters, the adapters' names comma-separated, and max_lora; its value the
scrape's time, as vLLM sets it) lets routers route by adapter, next to counters of adapter loads
and evictions into device slots and host memory.

The same state and events are also exposed under vLLM's names and labels (`vllm:*`,
vllm_metrics.py), for the routers and autoscalers that read a vLLM server's metrics.

Each engine owns its own CollectorRegistry (tests and benchmarks build several engines in one
process). `jaxserve serve --metrics-port` exposes it over HTTP. No jax here.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from jaxserve.engine.info import EngineInfo, EngineStats
from jaxserve.engine.outputs import RequestOutput
from jaxserve.engine.vllm_metrics import VllmMetrics

PREFIX = "jaxserve_"
# Seconds: CPU steps take tens to hundreds of ms, accelerator steps a few ms; queues add more.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0, 600.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                         0.5, 0.75, 1.0, 2.5, 5.0)


class _EngineStateCollector(Collector):
    """Reads the engine's latest stats snapshot when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], EngineStats]):
        self.stats = stats

    def collect(self) -> Iterable:
        st = self.stats()
        for name, doc, value in (
                ("num_requests_running", "Requests in the running batch.", st.num_running),
                ("num_requests_waiting", "Requests waiting to be admitted.", st.num_waiting),
                ("num_requests_swapped", "Preempted requests whose KV pages are in host memory.",
                 st.num_swapped),
                ("kv_cache_usage_ratio", "Fraction of KV pages held by requests (0-1).",
                 st.kv_usage),
                ("kv_cache_free_pages", "KV pages allocatable now (evictable cached included).",
                 st.num_free_pages),
                ("host_prefix_cache_pages", "Pages held by the prefix cache's host tier.",
                 st.host_prefix_pages),
                ("host_prefix_cache_capacity_pages", "Pages the prefix cache's host tier holds "
                 "at most (0: no host tier).", st.host_prefix_capacity_pages)):
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        for name, doc, value in (
                ("preemptions", "Requests preempted for lack of KV pages.", st.num_preemptions),
                ("swap_outs", "Preemptions that swapped KV pages to host memory.", st.num_swaps),
                ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 st.prefix_query_tokens),
                ("prefix_cache_hits", "Prompt tokens found in the prefix cache (device and "
                 "host tier).", st.prefix_hit_tokens),
                ("host_prefix_cache_hits", "Prompt tokens found in the prefix cache's host tier "
                 "and copied back to the device.", st.host_prefix_hit_tokens),
                ("host_prefix_cache_bytes_to_host", "Bytes of evicted prefix pages copied to "
                 "the host tier.", st.host_prefix_bytes_to_host),
                ("host_prefix_cache_bytes_to_device", "Bytes of host-tier prefix pages copied "
                 "back to the device.", st.host_prefix_bytes_to_device),
                ("engine_steps", "Engine steps run.", st.num_steps)):
            yield CounterMetricFamily(PREFIX + name, doc, value=value)


class _LoRACollector(Collector):
    """The adapters in use (vLLM's gauge) and adapter loads and evictions, at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats], adapters, max_loras: int):
        self.stats, self.adapters, self.max_loras = stats, adapters, max_loras

    def collect(self) -> Iterable:
        st, names = self.stats(), self.adapters.name_of
        info = GaugeMetricFamily(
            "vllm:lora_requests_info", "Running and waiting LoRA adapters (names, "
            "comma-separated); the value is the time of the scrape.",
            labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        info.add_metric([",".join(names(i) for i in st.lora_running),
                         ",".join(names(i) for i in st.lora_waiting), str(self.max_loras)],
                        time.time())
        yield info
        for name, doc, value in (
                ("lora_slot_loads", "LoRA adapters written into a device slot.",
                 st.lora_slot_loads),
                ("lora_slot_evictions", "Idle LoRA adapters whose device slot another took.",
                 st.lora_slot_evictions),
                ("lora_host_loads", "LoRA adapters read into host memory.",
                 self.adapters.num_loads),
                ("lora_host_evictions", "Idle LoRA adapters dropped from host memory for "
                 "another (max_cpu_loras).", self.adapters.num_evictions)):
            yield CounterMetricFamily(PREFIX + name, doc, value=value)


class EngineMetrics:
    def __init__(self, stats: Callable[[], EngineStats], info: EngineInfo | None = None,
                 lora_registry=None, max_loras: int = 0, engine_index: int = 0):
        """stats: returns the engine's latest snapshot (called at scrape time); info: the
        engine's start-up facts (the weights' bytes on device, the model's name); lora_registry:
        the engine's LoRA adapters (lora/registry.py; None: none served), max_loras device
        slots; engine_index: the vLLM metrics' `engine` label."""
        self.registry = registry = CollectorRegistry()
        registry.register(_EngineStateCollector(stats))
        self.vllm = VllmMetrics(registry, stats, info.model_name if info else "unknown",
                                info.max_model_len if info else 2048, engine_index)
        self._last_token_time: dict[str, float] = {}  # request id -> its latest token's
        if lora_registry is not None:
            registry.register(_LoRACollector(stats, lora_registry, max_loras))
        if info is not None:
            weights = Gauge(PREFIX + "model_weight_bytes",
                            "Bytes of the model's weights on device (all shards; quantized "
                            "weights in their stored form).", registry=registry)
            weights.set(info.weight_bytes)
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of requests that produced a first token.",
            registry=registry)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Output tokens generated.", registry=registry)
        self.finished = Counter(
            PREFIX + "requests_finished", "Requests finished, by finish reason.",
            ["finish_reason"], registry=registry)
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Arrival to first output token.",
            buckets=LATENCY_BUCKETS, registry=registry)
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "A finished request's mean time per output token after its first.",
            buckets=TOKEN_LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Arrival to finish.",
            buckets=LATENCY_BUCKETS, registry=registry)
        self.queue_time = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Arrival to first scheduled: time spent waiting in the queue.",
            buckets=LATENCY_BUCKETS, registry=registry)
        self.deadline_expired = Counter(
            PREFIX + "requests_deadline_expired",
            "Requests dropped because their deadline passed while they waited in the queue.",
            registry=registry)
        self.step_seconds = Histogram(
            PREFIX + "step_duration_seconds", "One engine step: schedule, execute, update.",
            buckets=TOKEN_LATENCY_BUCKETS, registry=registry)

    def observe_step(self, seconds: float) -> None:
        self.step_seconds.observe(seconds)

    def observe_queue_time(self, seconds: float) -> None:
        """Arrival to first scheduled, of one request."""
        self.queue_time.observe(seconds)
        self.vllm.queue.observe(seconds)

    def observe_outputs(self, outputs: Iterable[RequestOutput]) -> None:
        total_new = total_prompt = 0  # one counter update per step, not per request
        vllm, last, now, gaps = self.vllm, self._last_token_time, time.monotonic(), []
        for out in outputs:
            samples = out.outputs
            if len(samples) == 1:  # (per request and step: no generator for the usual n = 1)
                num_new = samples[0].num_new_tokens
                first = num_new and samples[0].num_tokens == num_new
            else:
                num_new = sum(c.num_new_tokens for c in samples)  # every sample's
                first = num_new and sum(c.num_tokens for c in samples) == num_new
            if num_new:
                total_new += num_new
                if first:  # the request's first tokens
                    total_prompt += len(out.prompt_token_ids)
                    self.ttft.observe(out.time_to_first_token)
                    vllm.ttft.observe(out.time_to_first_token)
                elif (previous := last.get(out.request_id)) is not None:
                    gaps.append(now - previous)
                last[out.request_id] = now
            if out.finished:
                last.pop(out.request_id, None)
                self.finished.labels(out.finish_reason).inc()
                num_tokens = out.outputs[0].num_tokens
                tpot = None
                if out.latency is not None:
                    self.e2e.observe(out.latency)
                    if num_tokens > 1 and out.time_to_first_token is not None:
                        tpot = (out.latency - out.time_to_first_token) / (num_tokens - 1)
                        self.tpot.observe(tpot)
                vllm.finished(out.finish_reason, out.latency, len(out.prompt_token_ids),
                              sum(c.num_tokens for c in out.outputs), tpot)
        if total_new:
            self.generation_tokens.inc(total_new)
            vllm.generation_tokens.inc(total_new)
        if total_prompt:
            self.prompt_tokens.inc(total_prompt)
            vllm.prompt_tokens.inc(total_prompt)
        if gaps:
            vllm.inter_token.observe_many(gaps)

    def serve_http(self, port: int, addr: str = "127.0.0.1"):
        """Expose /metrics on addr:port (0: any free port); returns (server, thread)."""
        return start_http_server(port, addr=addr, registry=self.registry)
