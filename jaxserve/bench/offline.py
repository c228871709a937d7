"""`jaxserve bench offline`: a workload through the engine in-process, all requests at t=0.

Reports output tokens/s, requests/s, TTFT and TPOT (mean/p50/p99), preemptions, prefix-cache
hit rate and compilations after warm-up. `--compare-batching` runs static and continuous
batching side by side on the same requests and prints the ratio; `--compare-speculative` does
the same with and without speculative decoding (jaxserve/bench/spec_metrics.py), and a speculative run
reports its acceptance rate and accepted tokens per verification. `--workload repeat` sends the
bundled copy-and-edit prompts through the chat template. Timing excludes start-up (loading,
compiling); it measures generation only.
"""

from __future__ import annotations

import json
import time

from jaxserve.bench.stats import RequestTimeline, report
from jaxserve.bench.workloads import build_workload
from jaxserve.core.request import SamplingParams


def add_offline_flags(parser) -> None:
    parser.add_argument("--workload", default="anyscale",
                        choices=["random", "anyscale", "shared-prefix", "repeat"],
                        help="which requests (jaxserve/bench/workloads.py); default: anyscale")
    parser.add_argument("--num-requests", type=int, default=200,
                        help="requests in the workload; default: 200")
    parser.add_argument("--input-len", type=int, default=128,
                        help="prompt tokens (random, shared-prefix); default: 128")
    parser.add_argument("--output-len", type=int, default=128,
                        help="max_tokens per request; default: 128")
    parser.add_argument("--compare-batching", action="store_true",
                        help="run static and continuous batching on the same requests")
    parser.add_argument("--compare-speculative", action="store_true",
                        help="run with and without the speculative settings on the same "
                             "requests, alternating for --rounds rounds")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of --compare-speculative")
    parser.add_argument("--json", dest="json_path", default=None, help="write results here")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def run_workload(engine, requests, ignore_eos: bool = True) -> dict:
    from jaxserve.runner.compile_count import CompileCounter
    from jaxserve.bench import spec_metrics as spec_bench

    sched, pages = engine.scheduler, engine.pages
    preempt0, swaps0, steps0 = sched.num_preemptions, sched.num_swaps, engine.num_steps
    q0, h0 = pages.stats().prefix_query_tokens, pages.stats().prefix_hit_tokens
    spec0 = spec_bench.snapshot(engine)
    start = time.perf_counter()
    timelines: dict[str, RequestTimeline] = {}
    with CompileCounter() as compiles:
        for r in requests:
            rid = engine.add_request(r.prompt_token_ids, SamplingParams(
                max_tokens=r.max_tokens, temperature=0.0, ignore_eos=ignore_eos))
            timelines[rid] = RequestTimeline(start, num_prompt_tokens=len(r.prompt_token_ids))
        while engine.has_unfinished():
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                timelines[out.request_id].token_times.extend([now] * len(out.new_token_ids))
                if out.finished and out.error:
                    timelines[out.request_id].ok = False
    duration = time.perf_counter() - start
    stats = pages.stats()
    queried = stats.prefix_query_tokens - q0
    result = report(list(timelines.values()), duration)
    result.update(
        num_steps=engine.num_steps - steps0,
        preemptions=sched.num_preemptions - preempt0, swaps=sched.num_swaps - swaps0,
        prefix_cache_hit_rate=(stats.prefix_hit_tokens - h0) / queried if queried else 0.0,
        compilations_after_warmup=compiles.count,
        total_prompt_tokens=sum(len(r.prompt_token_ids) for r in requests))
    result.update(spec_bench.metrics(engine, spec0))
    return result


def _print(label: str, r: dict) -> None:
    ms = lambda d: f"mean {d['mean'] * 1e3:8.1f}  p50 {d['median'] * 1e3:8.1f}  p99 {d['p99'] * 1e3:8.1f} ms"
    print(f"== {label}")
    print(f"  requests        {r['completed']} ok, {r['failed']} failed in {r['duration_s']:.1f} s "
          f"({r['num_steps']} steps)")
    print(f"  throughput      {r['output_throughput']:.1f} output tok/s, "
          f"{r['request_throughput']:.2f} req/s")
    print(f"  TTFT            {ms(r['ttft_s'])}")
    print(f"  TPOT            {ms(r['tpot_s'])}")
    print(f"  preemptions     {r['preemptions']} (swaps {r['swaps']}), prefix-cache hit rate "
          f"{r['prefix_cache_hit_rate']:.1%}, compilations after warm-up "
          f"{r['compilations_after_warmup']}")
    from jaxserve.bench.spec_metrics import print_metrics
    print_metrics(r)


def run_offline_bench(args, config) -> int:
    from jaxserve.engine.engine import Engine
    from jaxserve.model.loaders.loader import load_model

    loaded = load_model(config.model.model, progress=not args.quiet)
    if args.workload == "repeat":  # natural answers: they end at EOS
        from jaxserve.bench.spec_workload import repeat_workload
        requests = repeat_workload(loaded.tokenizer, args.num_requests, args.output_len)
    else:
        requests = build_workload(args.workload, args.num_requests, loaded.config.vocab_size,
                                  config.model.seed, args.input_len, args.output_len)
    ignore_eos = args.workload != "repeat"
    if args.compare_speculative:
        from jaxserve.bench.spec_metrics import compare_speculative
        results = compare_speculative(config, loaded, requests, run_workload, _print,
                                      rounds=args.rounds, ignore_eos=ignore_eos,
                                      progress=not args.quiet)
        if args.json_path:
            with open(args.json_path, "w") as f:
                json.dump(results, f, indent=2)
        return 0
    modes = ["static", "continuous"] if args.compare_batching else [config.scheduler.batching]
    results = {"workload": args.workload, "num_requests": args.num_requests,
               "config": config.as_kwargs(), "runs": {}}
    for mode in modes:
        with Engine(config.replace(batching=mode), loaded=loaded,
                    progress=not args.quiet) as engine:
            results["runs"][mode] = run_workload(engine, requests, ignore_eos)
        _print(f"{mode} batching, {args.workload}, {len(requests)} requests", results["runs"][mode])
        del engine
    if args.compare_batching:
        ratio = (results["runs"]["continuous"]["output_throughput"]
                 / results["runs"]["static"]["output_throughput"])
        results["continuous_over_static"] = ratio
        print(f"continuous / static output tokens/s: {ratio:.2f}x")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(results, f, indent=2)
    return 0
