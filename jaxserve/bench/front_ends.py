"""`python -m jaxserve.bench.front_ends`: one workload over gRPC and over HTTP, side by side.

Starts one `jaxserve serve` process (gRPC and the OpenAI HTTP API on free loopback ports; the
arguments after `--` go to it), waits until it serves, runs one unmeasured warm-up load per
backend (so the prefix cache holds every prompt before any measured run, whichever backend comes
first), then alternates the backends for `--rounds` rounds on the identical workload (dataset,
seed, concurrency), in A B, B A, A B ... order so that a drift in the machine's load favours
neither. Prints each run's output tokens/s and the ratio of each HTTP backend to
gRPC (mean of rounds, and best against best), and the CPU time the server process and this
load generator spent per output token (a busy machine moves wall-clock throughput far more than
CPU cost, so this says what each front end costs); `--json` writes every report. SIGTERM ends the
server. `--server-script FILE` runs a Python file taking the same flags instead (the test
suite's tiny-model server: tests/http_server_main.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from jaxserve.bench.datasets import DATASETS, build_requests
from jaxserve.bench.serve import BACKENDS, benchmark, fit_to_model, jsonable
from jaxserve.bench.targets import HttpFacts


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process so far (Linux /proc; None elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_server(command: list[str], timeout_lines: int = 100_000):
    """(process, gRPC address, HTTP base URL) once the server logs health SERVING."""
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    grpc_address = base_url = None
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if m := re.search(r"gRPC server listening on (\S+:\d+)", line):
            grpc_address = m.group(1)
        if m := re.search(r"HTTP \(OpenAI API\) server listening on (http://\S+)", line):
            base_url = m.group(1)
        if "health SERVING" in line or len(lines) > timeout_lines:
            break
    if proc.poll() is not None or grpc_address is None or base_url is None:
        proc.kill()
        raise RuntimeError("the server did not start:\n" + "".join(lines[-40:]))
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    return proc, grpc_address, base_url


def served_requests(base_url: str, args):
    """(the server's facts, args' dataset requests fitted to its max_model_len, their prompts'
    token ids): args carries dataset, num_prompts, seed, input_len, output_len."""
    with HttpFacts(base_url, None) as facts:
        info = facts.facts()
        requests = build_requests(args.dataset, args.num_prompts, info.vocab_size,
                                  args.seed, args.input_len, args.output_len)
        prompt_ids = [facts.chat_ids(list(r.messages)) if r.messages is not None
                      else list(r.prompt_token_ids) for r in requests]
    return (info, fit_to_model(requests, [len(p) for p in prompt_ids], info.max_model_len),
            prompt_ids)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, server_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) \
        if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["grpc", "openai-chat"],
                        choices=BACKENDS)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dataset", default="chat", choices=DATASETS)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--server-script", default=None,
                        help="run this Python file as the server instead of `jaxserve serve`")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(ours)
    head = [sys.executable, args.server_script] if args.server_script else \
        [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", "--host", args.host, "--port", "0",
         "--http-port", str(_free_port(args.host))]
    proc, grpc_address, base_url = start_server(head + server_args)
    runs = []
    try:
        info, requests, prompt_ids = served_requests(base_url, args)
        print(f"{info.model_name}: {len(requests)} {args.dataset} requests, max concurrency "
              f"{args.max_concurrency}, {sum(r.max_tokens for r in requests)} output tokens "
              f"per run; gRPC {grpc_address}, HTTP {base_url}", flush=True)
        for round_no in range(args.rounds + 1):
            for backend in args.backends[::-1] if round_no % 2 == 0 else args.backends:
                server_cpu, client_cpu = process_cpu_s(proc.pid), time.process_time()
                result = benchmark(grpc_address if backend == "grpc" else base_url, requests,
                                   max_concurrency=args.max_concurrency, seed=args.seed,
                                   backend=backend, model=info.model_name,
                                   prompt_ids=prompt_ids, timeout=900.0)
                num_tokens = max(result["total_output_tokens"], 1)
                client_ms = (time.process_time() - client_cpu) * 1e3 / num_tokens
                server_ms = None if server_cpu is None else \
                    (process_cpu_s(proc.pid) - server_cpu) * 1e3 / num_tokens
                kind = "warm-up" if round_no == 0 else f"round {round_no}"
                print(f"{kind:>8} {backend:<12} {result['output_throughput']:9.2f} output tok/s"
                      f"  {result['completed']}/{len(requests)} ok  mean TPOT "
                      f"{result['tpot_s']['mean'] * 1e3:7.2f} ms  CPU ms/token: server "
                      f"{server_ms if server_ms is None else f'{server_ms:.3f}'}, load "
                      f"generator {client_ms:.3f}", flush=True)
                result.pop("raw")
                runs.append(dict(result, backend=backend, round=round_no,
                                 server_cpu_ms_per_token=server_ms,
                                 client_cpu_ms_per_token=client_ms))
    finally:
        proc.send_signal(signal.SIGTERM)
        exit_code = proc.wait(timeout=120)
    measured = {b: [r["output_throughput"] for r in runs if r["backend"] == b and r["round"]]
                for b in args.backends}
    summary = {}
    for backend in args.backends:
        if backend == "grpc" or "grpc" not in measured:
            continue
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        summary[backend] = {"mean_ratio": mean(measured[backend]) / mean(measured["grpc"]),
                            "best_ratio": max(measured[backend]) / max(measured["grpc"])}
        for side in ("server", "client"):
            cpu = {b: [r[f"{side}_cpu_ms_per_token"] for r in runs
                       if r["backend"] == b and r["round"]] for b in ("grpc", backend)}
            if all(v is not None for vs in cpu.values() for v in vs):
                summary[backend][f"{side}_cpu_ms_per_token"] = {b: mean(v)
                                                                for b, v in cpu.items()}
        print(f"{backend} / grpc output tok/s: {summary[backend]['mean_ratio']:.3f} (mean of "
              f"{args.rounds} rounds), {summary[backend]['best_ratio']:.3f} (best of each)")
        for side in ("server", "client"):
            cpu = summary[backend].get(f"{side}_cpu_ms_per_token")
            if cpu:
                print(f"  {side} CPU ms per output token: grpc {cpu['grpc']:.3f}, {backend} "
                      f"{cpu[backend]:.3f}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(jsonable({"args": vars(args), "server_args": server_args, "runs": runs,
                                "summary": summary, "server_exit_code": exit_code}), f,
                      indent=2)
    return 0 if exit_code == 0 and all(r["failed"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
