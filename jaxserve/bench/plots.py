"""PNG plots for the benchmark suite (matplotlib, Agg): rate sweeps and latency CDFs.

Pure drawing from the suite's result dicts; nothing here measures anything.
"""

from __future__ import annotations

import math

import numpy as np


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _rate_label(rate) -> str:
    return "inf" if rate in ("inf", None) or (isinstance(rate, float) and math.isinf(rate)) \
        else f"{float(rate):g}"


def plot_rate_sweep(sweeps: dict[str, list[dict]], path: str, title: str) -> None:
    """sweeps: label -> results (each with request_rate, output_throughput, e2e_s, ttft_s),
    in rate order; a rate of inf sits at the right end."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for label, runs in sweeps.items():
        xs = np.arange(len(runs))
        axes[0].plot(xs, [r["output_throughput"] for r in runs], "o-", label=label)
        axes[1].plot(xs, [r["e2e_s"]["p99"] for r in runs], "o-", label=label)
        axes[2].plot(xs, [r["ttft_s"]["p99"] for r in runs], "o-", label=label)
    first = next(iter(sweeps.values()))
    for ax, ylabel in zip(axes, ("output tokens/s", "p99 end-to-end latency (s)",
                                 "p99 TTFT (s)")):
        ax.set_xticks(np.arange(len(first)))
        ax.set_xticklabels([_rate_label(r["request_rate"]) for r in first])
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cdf(ax, values, label: str) -> None:
    v = np.sort(np.asarray(values, dtype=float))
    if v.size:
        ax.step(v * 1e3, np.arange(1, v.size + 1) / v.size, where="post", label=label)


def plot_cdfs(runs: dict[str, dict], path: str, title: str) -> None:
    """runs: label -> a bench-serve result (its raw ttft_s and itl_s lists)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, result in runs.items():
        _cdf(axes[0], result["raw"]["ttft_s"], label)
        _cdf(axes[1], result["raw"]["itl_s"], label)
    for ax, name in zip(axes, ("TTFT", "inter-token latency")):
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of " + ("requests" if name == "TTFT" else "token gaps"))
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
