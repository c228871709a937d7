"""`jaxserve bench serve`: load a running server over gRPC or HTTP; report latency and throughput.

In the style of vLLM's benchmark_serving.py: requests from a dataset (random, anyscale,
shared-prefix, or the bundled chat prompts sent as chat messages) arrive as a Poisson or Gamma
process (`--request-rate`, `--burstiness`; inf sends all at once), optionally capped at
`--max-concurrency` in flight. Reports completed / failed, request and token throughput, TTFT,
TPOT, ITL and end-to-end latency (mean, median, p99) and goodput under `--goodput` SLOs.
`--backend grpc` (default) drives the gRPC Generate API at `--address`; `--backend openai`
(/v1/completions, token-id prompts) and `openai-chat` (/v1/chat/completions, messages) drive the
OpenAI HTTP API at `--base-url`, streamed, so one load generator measures both front ends.
`benchmark()` is the library entry point (scripts/bench_suite.py calls it); the arithmetic is
in stats.py, the sending and timing in load.py (gRPC) and load_http.py (HTTP).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import sys

import numpy as np

from jaxserve.bench.arrivals import arrival_times
from jaxserve.bench.datasets import DATASETS, ServeRequest, build_requests
from jaxserve.bench.load import request_message, run_load_sync
from jaxserve.bench.load_http import PATHS, request_body, run_load_http_sync
from jaxserve.bench.stats import goodput, report
from jaxserve.bench.targets import GrpcFacts, HttpFacts

_GOODPUT_KEYS = ("ttft", "tpot")
BACKENDS = ("grpc", *PATHS)


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="grpc", choices=BACKENDS,
                        help="grpc: the Generate API at --address; openai: /v1/completions "
                             "(token ids); openai-chat: /v1/chat/completions (--dataset chat); "
                             "both HTTP ones streamed, at --base-url")
    parser.add_argument("--address", default="127.0.0.1:50051", help="gRPC server host:port")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="OpenAI HTTP API server (--backend openai, openai-chat)")
    parser.add_argument("--api-key", default=os.environ.get("JAXSERVE_API_KEY"),
                        help="the server's API key, both backends (default: "
                             "$JAXSERVE_API_KEY)")
    parser.add_argument("--dataset", default="chat", choices=DATASETS,
                        help="the prompts (jaxserve/bench/datasets.py); default: chat")
    parser.add_argument("--dataset-path", default=None,
                        help="chat prompts JSONL (default: the bundled set)")
    parser.add_argument("--num-prompts", type=int, default=64,
                        help="requests sent; default: 64")
    parser.add_argument("--input-len", type=int, default=128,
                        help="random: prompt tokens; shared-prefix: prefix 4x, suffix 1/8")
    parser.add_argument("--output-len", type=int, default=None,
                        help="max_tokens per request (default: chat: each prompt's own, "
                             "others 128)")
    parser.add_argument("--range-ratio", type=float, default=0.0,
                        help="output lengths uniform in [len*(1-r), len*(1+r)]")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="mean requests/s; inf sends every request at t=0")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="Gamma shape of the gaps: 1 Poisson, <1 burstier, >1 smoother")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="most requests in flight at once; default: no limit")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature of every request; default: 0 (greedy)")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="generate exactly max_tokens (default) or stop at EOS")
    parser.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                        help="SLOs for goodput, e.g. ttft:2000 tpot:500 (milliseconds)")
    parser.add_argument("--timeout", type=float, default=None, help="per-request deadline, s")
    parser.add_argument("--wait-ready", type=float, default=0.0, metavar="S",
                        help="wait up to S seconds for the server's health to be SERVING")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the prompts and arrival times; default: 0")
    parser.add_argument("--json", dest="json_path", default=None, help="write results here")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or key not in _GOODPUT_KEYS:
            raise ValueError(f"--goodput {item!r} is invalid: must be KEY:MS with KEY one of "
                             f"{_GOODPUT_KEYS}")
        slos[key] = float(value)
        if not slos[key] > 0:
            raise ValueError(f"--goodput {item!r} is invalid: the SLO must be > 0 ms")
    return slos


def fit_to_model(requests: list[ServeRequest], prompt_lens: list[int],
                 max_model_len: int) -> list[ServeRequest]:
    """Clip max_tokens so prompt + max_tokens fits max_model_len (never below 1)."""
    return [ServeRequest(max(1, min(r.max_tokens, max_model_len - n)), r.prompt_token_ids,
                         r.messages) for r, n in zip(requests, prompt_lens)]


def benchmark(address: str, requests: list[ServeRequest], *, request_rate: float = math.inf,
              burstiness: float = 1.0, send_offsets=None, max_concurrency: int | None = None,
              seed: int = 0, temperature: float = 0.0, ignore_eos: bool = True,
              goodput_slos_ms: dict[str, float] | None = None,
              timeout: float | None = None, backend: str = "grpc", model: str | None = None,
              prompt_ids: list[list[int]] | None = None, api_key: str | None = None) -> dict:
    """Run one load and return the report (stats.report keys, goodput, errors, raw values).
    address: gRPC host:port, or the HTTP base URL for the openai backends (which also need the
    served `model` name, and for chat requests sent as completions their `prompt_ids`)."""
    if send_offsets is None:
        send_offsets = arrival_times(len(requests), request_rate, burstiness, seed)
    if backend == "grpc":
        messages = [request_message(r, temperature, ignore_eos) for r in requests]
        load = run_load_sync(address, messages, send_offsets, max_concurrency, timeout,
                             api_key)
    else:
        bodies = [request_body(backend, r, model, temperature, ignore_eos, ids)
                  for r, ids in zip(requests, prompt_ids or [None] * len(requests))]
        load = run_load_http_sync(address, PATHS[backend], bodies, send_offsets,
                                  max_concurrency, timeout, api_key)
    result = report(load.timelines, load.duration)
    slos = goodput_slos_ms or {}
    result["goodput"] = (goodput(load.timelines, load.duration,
                                 ttft_slo=slos["ttft"] / 1e3 if "ttft" in slos else None,
                                 tpot_slo=slos["tpot"] / 1e3 if "tpot" in slos else None)
                         if slos else None)
    done = [t for t in load.timelines if t.ok]
    result.update(
        request_rate=request_rate, burstiness=burstiness, max_concurrency=max_concurrency,
        goodput_slos_ms=slos, cached_prompt_tokens=sum(load.cached_prompt_tokens),
        errors=dict(collections.Counter(e for e in load.errors if e)),
        raw={"ttft_s": [t.ttft for t in done], "e2e_s": [t.e2e for t in done],
             "tpot_s": [t.tpot for t in done if t.tpot is not None],
             "itl_s": [x for t in done for x in t.itls],
             "send_offsets_s": load.send_offsets})
    return result


def jsonable(value):
    """Strict JSON: inf and nan become strings, tuples lists."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def print_result(result: dict, title: str = "Serving Benchmark Result") -> None:
    line = lambda name, value: print(f"{name:<40} {value}")  # noqa: E731
    print(f"{' ' + title + ' ':=^60}")
    line("Successful requests:", result["completed"])
    line("Failed requests:", result["failed"])
    for error, count in result["errors"].items():
        line(f"  x{count}", error[:80])
    line("Benchmark duration (s):", f"{result['duration_s']:.2f}")
    line("Total input tokens:", result["total_input_tokens"])
    line("Total generated tokens:", result["total_output_tokens"])
    line("Request throughput (req/s):", f"{result['request_throughput']:.3f}")
    if result["goodput"] is not None:
        slos = " ".join(f"{k}<={v:g}ms" for k, v in result["goodput_slos_ms"].items())
        line(f"Request goodput (req/s, {slos}):", f"{result['goodput']:.3f}")
    line("Output token throughput (tok/s):", f"{result['output_throughput']:.2f}")
    line("Total token throughput (tok/s):",
         f"{result['output_throughput'] + result['input_throughput']:.2f}")
    line("Cached prompt tokens:", result["cached_prompt_tokens"])
    for key, name in (("ttft_s", "Time to First Token"), ("tpot_s", "Time per Output Token "
                      "(excl. 1st)"), ("itl_s", "Inter-token Latency"),
                      ("e2e_s", "End-to-end Latency")):
        print(f"{' ' + name + ' ':-^60}")
        for stat in ("mean", "median", "p99"):
            line(f"{stat.capitalize()} {key.split('_')[0].upper()} (ms):",
                 f"{result[key][stat] * 1e3:.2f}")
    print("=" * 60)


def run_serve_bench(args) -> int:
    from jaxserve.entrypoints.grpc.client import JaxServeClient, JaxServeError

    slos = parse_goodput(args.goodput)
    if args.backend != "grpc":
        import httpx
        try:
            return _run(args, slos, HttpFacts(args.base_url, args.api_key))
        except (httpx.HTTPError, ValueError) as exc:
            print(f"jaxserve bench serve: {args.base_url}: {exc}", file=sys.stderr)
            return 1
    try:
        return _run(args, slos, GrpcFacts(JaxServeClient(args.address, timeout=30.0,
                                                            api_key=args.api_key)))
    except JaxServeError as exc:
        print(f"jaxserve bench serve: {args.address}: {exc}", file=sys.stderr)
        return 1


def _run(args, slos: dict, server) -> int:
    with server:
        server.wait_ready(args.wait_ready)
        info = server.facts()
        requests = build_requests(args.dataset, args.num_prompts, info.vocab_size, args.seed,
                                  args.input_len, args.output_len, args.range_ratio,
                                  args.dataset_path)
        prompt_ids = [server.chat_ids(list(r.messages)) if r.messages is not None
                      else list(r.prompt_token_ids) for r in requests]
    requests = fit_to_model(requests, [len(p) for p in prompt_ids], info.max_model_len)
    target = args.address if args.backend == "grpc" else args.base_url
    if not args.quiet:
        print(f"{len(requests)} {args.dataset} requests to {target} over {args.backend} "
              f"({info.model_name}); rate {args.request_rate} req/s, burstiness "
              f"{args.burstiness}, max concurrency {args.max_concurrency}; prompt tokens mean "
              f"{np.mean([len(p) for p in prompt_ids]):.0f}, max_tokens mean "
              f"{np.mean([r.max_tokens for r in requests]):.0f}")
    result = benchmark(target, requests, request_rate=args.request_rate,
                       burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                       seed=args.seed, temperature=args.temperature,
                       ignore_eos=args.ignore_eos, goodput_slos_ms=slos, timeout=args.timeout,
                       backend=args.backend, model=info.model_name, prompt_ids=prompt_ids,
                       api_key=args.api_key)
    result.update(dataset=args.dataset, num_prompts=len(requests), address=target,
                  backend=args.backend, model=info.model_name)
    print_result(result, f"Serving Benchmark Result ({args.backend})")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(jsonable(result), f, indent=2)
    return 0 if result["completed"] else 1
