"""Before/after comparison of two jaxserve commits, side by side in one run.

  python scripts/ab_commits.py BASE [--head HEAD] [--rounds=2] [--json out.json]

Checks BASE and HEAD out into temporary git worktrees (so uncommitted edits in this checkout
never enter either side) and runs scripts/engine_probe.py (this checkout's copy) once per
checkout for the tokens, which must be identical, and then A B B A ... for the
timings, so drift in the machine's load falls on both sides alike. Each run is a fresh process
with cwd and PYTHONPATH set to its checkout (the check that the right jaxserve was imported is
the probe's own `jaxserve_path`). Prints medians and after/before ratios. It never edits either
checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "scripts" / "engine_probe.py"


def probe(checkout: Path, mode: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(PROBE), mode], cwd=checkout, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"probe {mode} in {checkout} failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if not result["jaxserve_path"].startswith(str(checkout)):
        raise RuntimeError(f"{checkout}: the probe imported {result['jaxserve_path']}")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="the 'before' commit")
    parser.add_argument("--head", default="HEAD", help="the 'after' commit")
    parser.add_argument("--rounds", type=int, default=2, help="A B pairs, order alternating")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args()
    rev = lambda c: subprocess.run(["git", "rev-parse", "--short", c], cwd=ROOT, text=True,
                                   capture_output=True, check=True).stdout.strip()
    base, head = rev(args.base), rev(args.head)
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"before": Path(tmp) / "before", "after": Path(tmp) / "after"}
        for side, commit in (("before", base), ("after", head)):
            subprocess.run(["git", "worktree", "add", "--detach", str(sides[side]), commit],
                           cwd=ROOT, check=True, capture_output=True)
        try:
            tok = {name: probe(path, "tokens") for name, path in sides.items()}
            cases = list(tok["before"]["tokens"])
            differ = [c for c in cases
                      if tok["before"]["tokens"][c] != tok["after"]["tokens"].get(c)]
            runs: dict[str, list[dict]] = {"before": [], "after": []}
            for r in range(args.rounds):
                order = ("before", "after") if r % 2 == 0 else ("after", "before")
                for name in order:
                    runs[name].append(probe(sides[name], "bench"))
                    print(f"round {r} {name}: {runs[name][-1]}", file=sys.stderr)
        finally:
            for path in sides.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT)
    metrics = [k for k, v in runs["after"][0].items()
               if isinstance(v, float) and k in runs["before"][0]]
    summary = {m: {side: statistics.median(run[m] for run in runs[side]) for side in runs}
               for m in metrics}
    for m, s in summary.items():
        s["after/before"] = s["after"] / s["before"]
    only_after = sorted(set(runs["after"][0]) - set(runs["before"][0]) - {"jaxserve_path"})
    for m in only_after:  # features the 'before' checkout lacks: reported, not compared
        summary[m] = {"after": statistics.median(run[m] for run in runs["after"])}
    report = {"before": base, "after": head, "rounds": args.rounds,
              "token_cases": cases, "token_cases_differing": differ,
              "preemptions": {side: t["preemptions"] for side, t in tok.items()},
              "summary": summary, "runs": runs}
    print(f"tokens: {len(cases) - len(differ)}/{len(cases)} cases identical"
          + (f"; DIFFER: {', '.join(differ)}" if differ else ""))
    for m, s in summary.items():
        if "before" not in s:
            print(f"{m}: after {s['after']:.2f} (no 'before' figure)")
            continue
        print(f"{m}: before {s['before']:.2f}  after {s['after']:.2f}  "
              f"after/before {s['after/before']:.3f}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
