"""Prometheus metrics of a data-parallel server: every rank's own families, labelled by rank.

Each rank sends its engine's exposition (engine/metrics.py: queue gauges, KV usage, prefix-cache
counters, latency histograms, whatever that registry holds) with its stats (rank.py, every
STATS_PERIOD_S while they change). At scrape time the collector parses each live rank's latest
text and yields each family once, its samples from every rank with a `data_parallel_rank`
label added (as vLLM labels its engines; sum by that label for the server's totals). A dead
rank's families are dropped; `jaxserve_data_parallel_rank_up` says which ranks live, and the
front end's own routing counts are per rank too. Reads the client's rank table only: no I/O
beyond serve_http's listener, no jax.
"""

from __future__ import annotations

from typing import Iterable

from prometheus_client import CollectorRegistry, Metric, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

RANK_LABEL = "data_parallel_rank"
PREFIX = "jaxserve_data_parallel_"


class _RanksCollector(Collector):
    def __init__(self, client):
        self.client = client

    def collect(self) -> Iterable:
        client = self.client
        up = GaugeMetricFamily(PREFIX + "rank_up", "1 while the rank's process runs, 0 once "
                               "it exited.", labels=[RANK_LABEL])
        in_flight = GaugeMetricFamily(PREFIX + "requests_in_flight", "Requests the front end "
                                      "has sent the rank that have not ended.",
                                      labels=[RANK_LABEL])
        waiting = GaugeMetricFamily(PREFIX + "waiting_tokens", "The router's waiting tokens "
                                    "of the rank (prefill still to do, plus one per decoding "
                                    "request).", labels=[RANK_LABEL])
        routed = CounterMetricFamily(PREFIX + "requests_routed", "Requests sent to the rank.",
                                     labels=[RANK_LABEL])
        families: dict[str, Metric] = {}
        for rank, state in enumerate(client.ranks):
            label = str(rank)
            up.add_metric([label], 1.0 if state.exit_code is None else 0.0)
            if client.router is not None:
                load = client.router.ranks[rank]
                in_flight.add_metric([label], load.num_in_flight)
                waiting.add_metric([label], load.waiting_tokens)
                routed.add_metric([label], load.num_routed)
            if state.exit_code is None and state.exposition:
                _relabel(state.exposition.decode(), label, families)
        yield from (up, in_flight, waiting, routed)
        yield from families.values()


def _relabel(text: str, rank: str, families: dict[str, Metric]) -> None:
    for family in text_string_to_metric_families(text):
        merged = families.get(family.name)
        if merged is None:
            merged = families[family.name] = Metric(family.name, family.documentation,
                                                    family.type, family.unit)
        for sample in family.samples:
            merged.add_sample(sample.name, {**sample.labels, RANK_LABEL: rank}, sample.value,
                              sample.timestamp, sample.exemplar)


class DataParallelMetrics:
    """EngineMetrics' surface for serve.py and the HTTP /metrics route: registry, serve_http."""

    def __init__(self, client):
        self.registry = CollectorRegistry()
        self.registry.register(_RanksCollector(client))

    def serve_http(self, port: int, addr: str = "127.0.0.1"):
        """Expose /metrics on addr:port (0: any free port); returns (server, thread)."""
        return start_http_server(port, addr=addr, registry=self.registry)
