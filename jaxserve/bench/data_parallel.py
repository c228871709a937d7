"""`python -m jaxserve.bench.data_parallel`: one workload on `jaxserve serve` at several
`--data-parallel-size` values, side by side in one run.

Starts one server per size (`--sizes`, default 1 2; gRPC and HTTP on free loopback ports; the
arguments after `--` go to every server, e.g. the model), all before any load, so every size
meets the same machine. Each gets one unmeasured warm-up load (compiles done, the prefix cache
holding every prompt), then the sizes take turns for `--rounds` rounds on the identical workload
(dataset, seed, `--max-concurrency`, default 32) in A B, B A, A B ... order, so that a drift in
the machine's load favours none. Prints each run's output tokens/s, mean TTFT and TPOT, and each
size's ratio to the first (mean of rounds and best against best); `--json` writes every report.
SIGTERM ends the servers. Load only: no routing or engine code here.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

from jaxserve.bench.datasets import DATASETS
from jaxserve.bench.front_ends import _free_port, served_requests, start_server
from jaxserve.bench.serve import benchmark, jsonable


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, server_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) \
        if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dataset", default="chat", choices=DATASETS)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(ours)
    servers = {}
    runs, exit_codes = [], {}
    try:
        for size in args.sizes:
            command = [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", "--host",
                       args.host, "--port", "0", "--http-port", str(_free_port(args.host)),
                       "--data-parallel-size", str(size), *server_args]
            servers[size] = start_server(command)
            print(f"data_parallel_size {size}: serving on {servers[size][1]}", flush=True)
        info, requests, _ = served_requests(servers[args.sizes[0]][2], args)
        print(f"{info.model_name}: {len(requests)} {args.dataset} requests, max concurrency "
              f"{args.max_concurrency}, {sum(r.max_tokens for r in requests)} output tokens "
              f"per run", flush=True)
        for round_no in range(args.rounds + 1):
            for size in args.sizes[::-1] if round_no % 2 == 0 else args.sizes:
                result = benchmark(servers[size][1], requests,
                                   max_concurrency=args.max_concurrency, seed=args.seed,
                                   backend="grpc", timeout=900.0)
                kind = "warm-up" if round_no == 0 else f"round {round_no}"
                print(f"{kind:>8} dp={size:<3} {result['output_throughput']:9.2f} output tok/s"
                      f"  {result['completed']}/{len(requests)} ok  mean TTFT "
                      f"{result['ttft_s']['mean'] * 1e3:8.1f} ms  mean TPOT "
                      f"{result['tpot_s']['mean'] * 1e3:7.2f} ms", flush=True)
                result.pop("raw")
                runs.append(dict(result, data_parallel_size=size, round=round_no))
    finally:
        for size, (proc, _, _) in servers.items():
            proc.send_signal(signal.SIGTERM)
        for size, (proc, _, _) in servers.items():
            exit_codes[size] = proc.wait(timeout=120)
    measured = {s: [r["output_throughput"] for r in runs
                    if r["data_parallel_size"] == s and r["round"]] for s in args.sizes}
    base = args.sizes[0]
    summary = {}
    for size in args.sizes[1:]:
        if not measured[size] or not measured[base]:
            continue
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        summary[size] = {"mean_ratio": mean(measured[size]) / mean(measured[base]),
                         "best_ratio": max(measured[size]) / max(measured[base])}
        print(f"dp={size} / dp={base} output tok/s: {summary[size]['mean_ratio']:.3f} (mean of "
              f"{args.rounds} rounds), {summary[size]['best_ratio']:.3f} (best of each)")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(jsonable({"args": vars(args), "server_args": server_args, "runs": runs,
                                "summary": summary, "server_exit_codes": exit_codes}), f,
                      indent=2)
    return 0 if all(c == 0 for c in exit_codes.values()) and all(
        r["failed"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
