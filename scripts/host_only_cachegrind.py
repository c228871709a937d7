"""The engine loop's host work (no device) under valgrind's cachegrind, two commits side by side.

  python scripts/host_only_cachegrind.py BASE [--head HEAD] [--requests 256] [--cold]

Wall-clock A/B runs on this 2-core VM spread by +-25% (a neighbour's load on the shared L3 and
memory), more than most host-side changes gain. cachegrind counts instead: per decode step of
overhead_probe.host_only (scheduler, input layout, update, output processing; N requests
decoding), the instructions, first-level data-cache misses and last-level misses, simulated
for this machine (D1 32 KiB, LL the 32 MiB L3), the same run to run to ~2%. --cold flushes the
caches before each step (the probe's cold mode: what the engine's phases meet on a CPU, where
the step's compute runs between them); its flush's own misses (one per line) are subtracted,
its own instructions are not. Each side runs twice, for 10 and 70 steps; the difference / 60
is one step's (the set-up and prefill cancel out). The default model's tokenizer is loaded
once here and handed over as JSON (no model load under valgrind). It measures and prints; it
never edits a checkout. Needs valgrind (Debian package `valgrind`).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "jaxserve" / "bench" / "overhead_probe.py"
STEPS = (10, 70)
CACHES = ["--D1=32768,8,64", "--LL=33554432,16,64"]
RUNNER = """
import sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import overhead_probe as probe
from tokenizers import Tokenizer
import jaxserve
if not jaxserve.__file__.startswith(sys.argv[1]):
    raise SystemExit(f"imported {jaxserve.__file__}")

class Tok:  # what the output processor reads of a tokenizer: its backend
    backend = Tokenizer.from_str(open(sys.argv[3]).read())

probe.host_only(int(sys.argv[4]), int(sys.argv[5]), Tok(), cold=sys.argv[6] == "cold")
"""


def counts(checkout: Path, tmp: Path, n: int, steps: int, cold: bool) -> dict[str, int]:
    # (one thread each: a BLAS or OpenMP worker's spin-wait would count as instructions)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONHASHSEED": "0",
           "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        ["valgrind", "--tool=cachegrind", "--cache-sim=yes", *CACHES,
         "--cachegrind-out-file=/dev/null", sys.executable, str(tmp / "runner.py"),
         str(checkout), str(tmp), str(tmp / "tokenizer.json"), str(n), str(steps),
         "cold" if cold else "warm"], cwd=checkout, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"cachegrind run in {checkout} failed:\n{proc.stderr[-3000:]}")
    found = {}
    for key, label in (("instructions", "I   refs"), ("d1_misses", "D1  misses"),
                       ("ll_misses", "LLd misses")):
        match = re.search(label + r":\s+([\d,]+)", proc.stderr)
        if match is None:
            raise RuntimeError(f"no '{label}' in cachegrind's summary:\n{proc.stderr[-2000:]}")
        found[key] = int(match.group(1).replace(",", ""))
    return found


def per_step(checkout: Path, tmp: Path, n: int, cold: bool, flush_lines: int) -> dict:
    short, long = (counts(checkout, tmp, n, steps, cold) for steps in STEPS)
    step = {k: (long[k] - short[k]) / (STEPS[1] - STEPS[0]) for k in short}
    step["d1_misses"] -= flush_lines
    step["ll_misses"] -= flush_lines
    return step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="the 'before' commit")
    parser.add_argument("--head", default="HEAD", help="the 'after' commit")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--cold", action="store_true",
                        help="flush the caches before each step (as a CPU step's compute does)")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    sys.path.insert(0, str(PROBE.parent))
    import overhead_probe

    from jaxserve.model.loader import load_model

    flush_lines = overhead_probe.FLUSH_BYTES // 64 if args.cold else 0
    results = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        shutil.copy(PROBE, tmp / "overhead_probe.py")
        (tmp / "runner.py").write_text(RUNNER)
        tokenizer = load_model("default", progress=False).tokenizer
        (tmp / "tokenizer.json").write_text(tokenizer.backend.to_str())
        for side, commit in (("before", args.base), ("after", args.head)):
            path = tmp / side
            subprocess.run(["git", "worktree", "add", "--detach", str(path), commit], cwd=ROOT,
                           check=True, capture_output=True)
            try:
                results[side] = per_step(path, tmp, args.requests, args.cold, flush_lines)
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT,
                               capture_output=True)
    print(f"cachegrind, host-only loop per decode step, {args.requests} requests"
          f"{', cold caches (flush misses subtracted)' if args.cold else ''}: "
          f"{args.base} -> {args.head}")
    for key in ("instructions", "d1_misses", "ll_misses"):
        b, a = results["before"][key], results["after"][key]
        print(f"  {key:12} {b / 1e3:10.1f} k -> {a / 1e3:10.1f} k   after/before {a / b:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
