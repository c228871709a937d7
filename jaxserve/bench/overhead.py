"""`jaxserve bench overhead`: the engine loop's host time per step, before and after.

    jaxserve bench overhead [--requests 1,16,64,256] [--steps 40] [--prompt-len 8]
                            [--baseline COMMIT | --baseline-json FILE] [--rounds=1] [--json OUT]

For each request count N, overhead_probe.py (a tiny random model, N requests all decoding,
prompts of --prompt-len tokens: longer ones show the host work that grows with a request's
context) runs in a fresh process on JAX's default device (the GPU or TPU where there is one)
and reports wall time per step, the host's share split into
schedule / build / dispatch / wait / update / emit, tokens/s and the fraction of wall time the
device was busy. With --baseline COMMIT the same probe also runs in a git worktree of that
commit, the two sides alternating (A B, then B A ...) so that changes in the machine's load
fall on both alike; --baseline-json compares with a saved run instead. The probe is copied out
of the package first, so each side imports only its own checkout's jaxserve (checked). It
measures and prints; it never edits a checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PROBE = Path(__file__).with_name("overhead_probe.py")
CHECKOUT = Path(__file__).resolve().parents[2]


def add_arguments(parser) -> None:
    parser.add_argument("--requests", default="1,16,64,256",
                        help="request counts to measure, comma-separated (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=40,
                        help="decode steps timed per request count (default: %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=8,
                        help="prompt tokens per request (default: %(default)s)")
    parser.add_argument("--baseline", default=None, metavar="COMMIT",
                        help="also measure this git commit (a temporary worktree), side by side")
    parser.add_argument("--baseline-json", default=None, metavar="FILE",
                        help="compare with a saved run (the --json output of an earlier run)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs per side and request count, alternating; medians are kept")
    parser.add_argument("--json", dest="json_path", default=None, metavar="OUT",
                        help="write every measurement here")


def probe(checkout: Path, n: int, steps: int, probe_path: Path, prompt_len: int = 8) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}  # JAX's default device, as the engine
    proc = subprocess.run([sys.executable, str(probe_path), str(n), str(steps), str(prompt_len)],
                          cwd=checkout, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"overhead probe (N={n}) in {checkout} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if not result["jaxserve_path"].startswith(str(checkout)):
        raise RuntimeError(f"{checkout}: the probe imported {result['jaxserve_path']}")
    return result


def _median_run(runs: list[dict]) -> dict:
    """The run with the median wall time (its phases stay consistent with its wall), with
    every round's host ms, host-only ms and tokens/s in run order (rounds[i] of one side ran
    next to rounds[i] of the other: a pair)."""
    median = sorted(runs, key=lambda r: r["wall_ms"])[len(runs) // 2]
    return {**median, "rounds": [{k: r[k] for k in ("host_ms", "host_only_total_ms",
                                                   "host_only_cold_total_ms", "tokens_per_s")
                                if k in r} for r in runs]}


def measure(sides: dict[str, Path], counts: list[int], steps: int, rounds: int,
            prompt_len: int = 8) -> dict:
    results: dict[str, dict[int, list[dict]]] = {side: {n: [] for n in counts} for side in sides}
    with tempfile.TemporaryDirectory() as tmp:
        probe_path = Path(tmp) / "overhead_probe.py"
        shutil.copy(PROBE, probe_path)
        order = list(sides)
        for r in range(rounds):
            for n in counts:
                for side in (order if r % 2 == 0 else order[::-1]):
                    results[side][n].append(probe(sides[side], n, steps, probe_path,
                                                  prompt_len))
                    print(f"  measured {side} N={n} (round {r + 1})", file=sys.stderr)
    return {side: {str(n): _median_run(runs) for n, runs in by_n.items()}
            for side, by_n in results.items()}


def _cold(result: dict) -> float:
    """Host-only with cold caches (nan in a saved run from before it was measured)."""
    return result.get("host_only_cold_total_ms", float("nan"))


def print_table(after: dict, before: dict | None, prompt_len: int = 8) -> None:
    backend = next(iter(after.values())).get("backend", "cpu")
    print(f"ms per decode step of a tiny model (4 layers, hidden 64) on {backend}, all N "
          f"decoding, prompts of {prompt_len} tokens; host-only: the same host work with no "
          f"device (overhead_probe.py), cold: with every cache flushed before each step, as the "
          f"CPU's compute does")
    head = f"{'N':>5} {'wall':>7} {'host':>6} {'sched':>6} {'build':>6} {'disp':>6} " \
           f"{'wait':>6} {'upd':>6} {'emit':>6} {'busy':>5} {'tok/s':>8}"
    head += f" {'host-only':>9} {'cold':>6}"
    if before:
        head += (f" | {'before wall':>11} {'host':>6} {'host-only':>9} {'cold':>6} {'tok/s':>8} "
                 f"{'x tok/s':>8}")
    print(head)
    for n, a in after.items():
        ph = a["phases_ms"]
        line = (f"{n:>5} {a['wall_ms']:7.2f} {a['host_ms']:6.2f} "
                + " ".join(f"{ph.get(k, float('nan')):6.2f}" for k in
                           ("schedule", "build", "dispatch", "wait", "update", "emit"))
                + f" {a['device_busy']:5.2f} {a['tokens_per_s']:8.0f}"
                + f" {a['host_only_total_ms']:9.2f} {_cold(a):6.2f}")
        b = (before or {}).get(n)
        if b:
            line += (f" | {b['wall_ms']:11.2f} {b['host_ms']:6.2f} "
                     f"{b['host_only_total_ms']:9.2f} {_cold(b):6.2f} {b['tokens_per_s']:8.0f} "
                     f"{a['tokens_per_s'] / b['tokens_per_s']:8.2f}")
        print(line)
    if before and len(next(iter(after.values())).get("rounds", ())) > 1:
        print("by round (each after run beside its before run): host ms after/before, "
              "tokens/s after/before")
        for n, a in after.items():
            b = before.get(n, {}).get("rounds")
            if b:
                pairs = list(zip(a["rounds"], b))
                print(f"{n:>5} host " + " ".join(f"{x['host_ms']:.2f}/{y['host_ms']:.2f}"
                                                  for x, y in pairs)
                      + "  x tok/s " + " ".join(f"{x['tokens_per_s'] / y['tokens_per_s']:.2f}"
                                               for x, y in pairs))


def main(args) -> int:
    counts = [int(x) for x in str(args.requests).split(",") if x.strip()]
    sides = {"after": CHECKOUT}
    worktree = None
    if args.baseline:
        worktree = Path(tempfile.mkdtemp(prefix="jaxserve-baseline-"))
        shutil.rmtree(worktree)
        subprocess.run(["git", "worktree", "add", "--detach", str(worktree), args.baseline],
                       cwd=CHECKOUT, check=True, capture_output=True)
        sides["before"] = worktree
    try:
        results = measure(sides, counts, args.steps, args.rounds, args.prompt_len)
    finally:
        if worktree is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)],
                           cwd=CHECKOUT, capture_output=True)
    before = results.get("before")
    if args.baseline_json:
        before = json.loads(Path(args.baseline_json).read_text())["after"]
    print_table(results["after"], before, args.prompt_len)
    if args.json_path:
        record = {"after": results["after"], "before": before, "baseline": args.baseline,
                  "steps": args.steps, "rounds": args.rounds, "prompt_len": args.prompt_len,
                  "median_note": "each entry: the run with the median wall time"}
        Path(args.json_path).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))

