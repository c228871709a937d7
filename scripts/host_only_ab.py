"""The engine loop's host work alone (no device), two commits side by side, in pairs.

  python scripts/host_only_ab.py BASE [--head HEAD] [--requests 256] [--prompt-len 8]
                                 [--pairs 4] [--cold] [--json OUT]

`jaxserve bench overhead` times the whole loop, whose host phases on a CPU meet caches the
step's compute has flushed, and measures the host work alone once per run. This script runs only
that host-only loop (overhead_probe.host_only: scheduler, input layout, update with a fixed
token, output processing; N requests decoding after their prefill), three times per process,
in fresh processes for BASE and HEAD (git worktrees) alternating A B, B A ..., and prints each
pair's medians and their ratio: the pair's two sides ran within seconds of each other, so the
VM's drift (~2x within minutes here) falls on both. --cold flushes every cache before each
step: what the engine's phases meet on a CPU, where the step's compute runs between them.
The probe is this checkout's copy, run against each side's jaxserve (checked). It measures and
prints; it never edits a checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "jaxserve" / "bench" / "overhead_probe.py"
RUNNER = """
import json, sys
sys.path.insert(0, sys.argv[1])
import overhead_probe as probe
probe.PROMPT_LEN = int(sys.argv[3])
import jaxserve
from jaxserve.model.loader import load_model
tokenizer = load_model("default", progress=False).tokenizer
cold = sys.argv[4] == "cold"
runs = [probe.host_only(int(sys.argv[2]), 40, tokenizer, cold) for _ in range(3)]
print(json.dumps({"jaxserve_path": jaxserve.__file__, "runs": runs}))
"""


def run_side(checkout: Path, tmp: Path, n: int, prompt_len: int, cold: bool) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(checkout), "JAX_PLATFORMS": "cpu"}
    argv = [sys.executable, str(tmp / "runner.py"), str(tmp), str(n), str(prompt_len),
            "cold" if cold else "warm"]
    proc = subprocess.run(argv, cwd=checkout, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"host-only run in {checkout} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if not result["jaxserve_path"].startswith(str(checkout)):
        raise RuntimeError(f"{checkout}: imported {result['jaxserve_path']}")
    return result["runs"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="the 'before' commit")
    parser.add_argument("--head", default="HEAD", help="the 'after' commit")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--cold", action="store_true",
                        help="flush every cache before each step (as a CPU step's compute does)")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args()
    results: dict[str, list[list[dict]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        shutil.copy(PROBE, tmp / "overhead_probe.py")
        (tmp / "runner.py").write_text(RUNNER)
        sides = {"before": tmp / "before", "after": tmp / "after"}
        for side, commit in (("before", args.base), ("after", args.head)):
            subprocess.run(["git", "worktree", "add", "--detach", str(sides[side]), commit],
                           cwd=ROOT, check=True, capture_output=True)
        try:
            for p in range(args.pairs):
                for side in ("after", "before") if p % 2 == 0 else ("before", "after"):
                    results[side].append(run_side(sides[side], tmp, args.requests,
                                                  args.prompt_len, args.cold))
        finally:
            for path in sides.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT,
                               capture_output=True)
    total = lambda runs: statistics.median(sum(r.values()) for r in runs)  # noqa: E731
    print(f"host-only ms per decode step{' (cold caches)' if args.cold else ''}, "
          f"{args.requests} requests, prompts of {args.prompt_len} tokens "
          f"(median of 3 runs of 40 steps per process)")
    print(f"{'pair':>4} {'before':>7} {'after':>7} {'before/after':>12}")
    ratios = []
    for p, (b, a) in enumerate(zip(results["before"], results["after"])):
        ratios.append(total(b) / total(a))
        print(f"{p + 1:>4} {total(b):7.2f} {total(a):7.2f} {ratios[-1]:12.2f}")
    phases = {side: {k: statistics.median(r[k] for runs in by_pair for r in runs)
                     for k in by_pair[0][0]} for side, by_pair in results.items()}
    print("median by phase: " + "; ".join(
        f"{k} {phases['before'][k]:.2f} -> {phases['after'][k]:.2f}" for k in phases["after"]))
    print(f"median pair ratio before/after: {statistics.median(ratios):.2f}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(
            {"base": args.base, "head": args.head, "requests": args.requests,
             "prompt_len": args.prompt_len, "cold": args.cold, "pairs": results,
             "ratios": ratios}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
