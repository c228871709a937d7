"""Latency metric arithmetic: TTFT, TPOT, ITL, end-to-end, percentiles and goodput.

Pure functions over per-request timelines (arrival, token timestamps); no clocks read here,
so tests can check them on hand-made timelines.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestTimeline:
    arrival: float                                      # seconds
    token_times: list[float] = field(default_factory=list)  # one per output token
    num_prompt_tokens: int = 0
    ok: bool = True

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for a single token."""
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        return list(np.diff(self.token_times))


def summarize(values) -> dict[str, float]:
    v = np.asarray([x for x in values if x is not None], dtype=np.float64)
    if v.size == 0:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    return {"mean": float(v.mean()), "median": float(np.median(v)),
            "p99": float(np.percentile(v, 99))}


def goodput(timelines: list[RequestTimeline], duration: float, ttft_slo: float | None = None,
            tpot_slo: float | None = None) -> float:
    """Requests per second that finished and met every given SLO (seconds)."""
    good = 0
    for t in timelines:
        if not t.ok or not t.token_times:
            continue
        if ttft_slo is not None and t.ttft > ttft_slo:
            continue
        if tpot_slo is not None and t.tpot is not None and t.tpot > tpot_slo:
            continue
        good += 1
    return good / duration if duration > 0 else 0.0


def report(timelines: list[RequestTimeline], duration: float) -> dict:
    done = [t for t in timelines if t.ok and t.token_times]
    num_out = sum(len(t.token_times) for t in done)
    num_in = sum(t.num_prompt_tokens for t in done)
    return {
        "completed": len(done), "failed": len(timelines) - len(done),
        "duration_s": duration,
        "request_throughput": len(done) / duration if duration > 0 else 0.0,
        "output_throughput": num_out / duration if duration > 0 else 0.0,
        "input_throughput": num_in / duration if duration > 0 else 0.0,
        "total_output_tokens": num_out, "total_input_tokens": num_in,
        "ttft_s": summarize(t.ttft for t in done),
        "tpot_s": summarize(t.tpot for t in done),
        "itl_s": summarize(x for t in done for x in t.itls),
        "e2e_s": summarize(t.e2e for t in done),
    }
