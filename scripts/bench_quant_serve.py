"""float32 against `--quantization int8`, server to server on the default model: warm start to
SERVING, then output tokens/s and inter-token latency at each concurrency, one client.

    python scripts/bench_quant_serve.py [--rounds 2] [--concurrency 1,16,32,64]
        [--output-len 128] [--cache-dir DIR] [--start-with float32|int8]
        [--out scripts/bench_results/quant_serve.json]
        [-- SERVE FLAGS]

Each variant is `jaxserve serve` in its own process (no flags, and `--quantization int8`; the
SERVE FLAGS go to both), all on one fresh compile cache directory (or DIR, kept: a run on a
cache another run filled skips the compiles and the int8 measurement). A first start of each
fills the compile cache and the quantized-weight cache (cold: reported, not compared); then
each round starts every variant again (warm), loads it with the bundled chat prompts at each
concurrency (greedy, `--output-len` tokens each, ignore_eos; max(8, 2 x concurrency)
requests) through the gRPC API and stops it, the order alternating round by round (A B, B A;
--start-with picks A) so load from elsewhere hits both. Each variant reports its best round
and every round, the int8 server's log line naming its form per token bucket (measured at its
first start, read back after), and the CPU's model and flags. It measures and prints; it
asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jaxserve.bench.datasets import chat_requests  # noqa: E402
from jaxserve.bench.serve import benchmark, jsonable  # noqa: E402

VARIANTS = {"float32": [], "int8": ["--quantization", "int8"]}
LISTENING = re.compile(r"listening on (\S+:\d+)")
FORMS = "int8 matmul form per token bucket"


def cpu() -> dict:
    """The CPU's model name and flags (/proc/cpuinfo; empty where there is none)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return {}
    first = {k.strip(): v.strip() for k, _, v in (x.partition(":") for x in lines) if v}
    return {"model": first.get("model name"), "flags": first.get("flags", "").split()}


def forms_line(lines: list[str]) -> str | None:
    return next((x[x.index(FORMS):] for x in lines if FORMS in x), None)


def start(flags: list[str], cache_dir: str) -> tuple[subprocess.Popen, str, float, list[str]]:
    """A server process, its gRPC address, seconds to health SERVING and its log lines."""
    command = [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", "--port", "0",
               "--http-port", "0", "--compile-cache-dir", cache_dir, *flags]
    began = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    address, lines = None, []
    for line in proc.stdout:
        lines.append(line.rstrip())
        if address is None and (m := LISTENING.search(line)):
            address = m.group(1)
        if "health SERVING" in line:
            return proc, address, time.monotonic() - began, lines
    raise RuntimeError("the server exited before SERVING:\n" + "\n".join(lines[-30:]))


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def loads(address: str, concurrency: list[int], output_len: int) -> dict:
    out = {}
    for c in concurrency:
        requests = chat_requests(max(8, 2 * c), 0, output_len)
        r = benchmark(address, requests, max_concurrency=c)
        if r["failed"]:
            raise RuntimeError(f"{r['failed']} requests failed: {r['errors']}")
        out[str(c)] = dict(output_tok_s=r["output_throughput"],
                           itl_median_ms=1e3 * r["itl_s"]["median"],
                           tpot_mean_ms=1e3 * r["tpot_s"]["mean"])
    return out


def main() -> int:
    argv = sys.argv[1:]
    ours, serve_flags = ((argv[:argv.index("--")], argv[argv.index("--") + 1:])
                         if "--" in argv else (argv, []))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", default="1,16,32,64")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--out", default=None)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--start-with", choices=tuple(VARIANTS), default="float32")
    args = parser.parse_args(ours)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    runs = {name: {"cold_s": None, "warm_s": [], "rounds": [], "forms": []}
            for name in VARIANTS}
    load_before = os.getloadavg()
    with (tempfile.TemporaryDirectory(prefix="jaxserve-quant-serve-") if args.cache_dir is None
          else contextlib.nullcontext(args.cache_dir)) as cache_dir:
        for name, flags in VARIANTS.items():
            proc, _, seconds, lines = start(flags + serve_flags, cache_dir)
            stop(proc)
            runs[name]["cold_s"] = seconds
            runs[name]["forms"].append(forms_line(lines))
            print(f"{name}: cold start {seconds:.1f} s", flush=True)
        for i in range(args.rounds):
            first = [args.start_with, *(v for v in VARIANTS if v != args.start_with)]
            order = first if i % 2 == 0 else first[::-1]
            for name in order:
                proc, address, seconds, lines = start(VARIANTS[name] + serve_flags, cache_dir)
                runs[name]["forms"].append(forms_line(lines))
                try:
                    result = loads(address, concurrency, args.output_len)
                finally:
                    stop(proc)
                runs[name]["warm_s"].append(seconds)
                runs[name]["rounds"].append(result)
                print(f"round {i + 1} {name}: warm start {seconds:.1f} s, " + ", ".join(
                    f"c={c} {r['output_tok_s']:.1f} tok/s ITL {r['itl_median_ms']:.1f} ms"
                    for c, r in result.items()), flush=True)
    best = {name: {c: max((r[c] for r in v["rounds"]), key=lambda r: r["output_tok_s"])
                   for c in map(str, concurrency)} for name, v in runs.items()}
    base = best["float32"]
    print(f"\n{'':8} {'warm s':>7} " + " ".join(f"{'c=' + str(c) + ' tok/s':>13} {'x f32':>6}"
                                              for c in concurrency))
    for name, v in runs.items():
        print(f"{name:8} {min(v['warm_s']):7.1f} " + " ".join(
            f"{best[name][str(c)]['output_tok_s']:13.1f} "
            f"{best[name][str(c)]['output_tok_s'] / base[str(c)]['output_tok_s']:6.2f}"
            for c in concurrency))
    warm = {name: min(v["warm_s"]) for name, v in runs.items()}
    print(f"int8 warm start / float32's: {warm['int8'] / warm['float32']:.2f}")
    for line in dict.fromkeys(runs["int8"]["forms"]):
        print(f"int8 server: {line}")
    if args.out:
        Path(args.out).write_text(json.dumps(jsonable(dict(
            serve_flags=serve_flags, concurrency=concurrency, output_len=args.output_len,
            cpu=cpu(), ratio={c: best["int8"][str(c)]["output_tok_s"]
                              / base[str(c)]["output_tok_s"] for c in concurrency},
            load_before=load_before, load_after=os.getloadavg(), best=best, runs=runs)),
            indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
