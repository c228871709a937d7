"""Time `jaxserve serve` from process start to health SERVING: a cold start, then a warm one.

    python scripts/measure_startup.py [--runs-warm 1] [--pythonpath DIR] [-- SERVE FLAGS]

Cold: a fresh, empty persistent compile cache directory; warm: the same directory again.
Each run prints seconds to SERVING, the CPU seconds the server used, the load average and the
server's own phase lines (load, trace, compile, warm-up). --pythonpath runs another checkout
(e.g. `git archive` of an older commit) to measure before/after in one sitting. It only
starts and stops servers; it measures nothing inside them.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

PHASE = re.compile(r"(loaded|traced|compiled|warm-up|warmed|ready|SERVING|KV cache)", re.I)


def one_start(cache_dir: str, pythonpath: str | None, serve_flags: list[str]) -> dict:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    command = [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", "--port", "0", "--http-port", "0",
               "--compile-cache-dir", cache_dir, *serve_flags]
    load = os.getloadavg()[0]
    start = time.monotonic()
    proc = subprocess.Popen(command, stderr=subprocess.STDOUT, stdout=subprocess.PIPE, text=True,
                            env=env)
    lines = []
    for line in proc.stdout:
        lines.append(f"{time.monotonic() - start:7.1f}s | {line.rstrip()}")
        if "health SERVING" in line:
            break
    elapsed = time.monotonic() - start
    with open(f"/proc/{proc.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    proc.send_signal(signal.SIGTERM)
    try:
        proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
    ok = any("health SERVING" in line for line in lines)
    return dict(seconds=elapsed, cpu_s=cpu, load=load, ok=ok, lines=lines)


def main() -> int:
    argv = sys.argv[1:]
    ours, serve_flags = ((argv[:argv.index("--")], argv[argv.index("--") + 1:])
                         if "--" in argv else (argv, []))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs-warm", type=int, default=1)
    parser.add_argument("--pythonpath", default=None)
    parser.add_argument("--label", default="")
    args = parser.parse_args(ours)
    with tempfile.TemporaryDirectory(prefix="jaxserve-cc-") as cache_dir:
        for i in range(1 + args.runs_warm):
            kind = "cold" if i == 0 else "warm"
            r = one_start(cache_dir, args.pythonpath, serve_flags)
            print(f"== {args.label} {kind}: {r['seconds']:.1f} s to SERVING, server CPU "
                  f"{r['cpu_s']:.1f} s, load {r['load']:.2f}, ok={r['ok']}", flush=True)
            for line in r["lines"]:
                if PHASE.search(line) or not r["ok"]:
                    print("   ", line[:400])
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
