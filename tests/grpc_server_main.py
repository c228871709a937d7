"""Run `run_server` with the tiny test model, for tests that need a real server process.

    python tests/grpc_server_main.py [--port 0] [--shutdown-timeout 30] [--metrics-port 0]
        [--num-pages N] [--preemption-mode swap] [--swap-space BYTES] [--max-num-seqs N]
        [--step-delay-ms MS] [--fail-after-steps N] [--fail-swap-in]

Uses the shapes in conftest.SMALL_ENGINE (overridable here) so warm-up hits the persistent
compile cache the test session configured (the environment is inherited). Logs "listening on
HOST:PORT" on stderr; exits with run_server's return code. Fault injection for tests:
--fail-after-steps N makes the engine's step raise after N steps, --fail-swap-in makes the
first swap-in of KV pages raise a device (JaxRuntimeError) error. It serves nothing but the
tiny random model. `server_process(*args)` runs it for a test: started, serving, its stderr
kept read.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conftest import SMALL_ENGINE  # noqa: E402  (needs the path set above)
from tiny_models import tiny_loaded  # noqa: E402

from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.entrypoints.serve import run_server  # noqa: E402


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    address: str                   # 127.0.0.1:PORT
    metrics_url: str | None        # http://127.0.0.1:PORT/metrics (with --metrics-port)
    lines: list[str] = field(default_factory=list)  # its stderr so far

    @property
    def log(self) -> str:
        return "".join(self.lines)


@contextlib.contextmanager
def server_process(*args: str):
    """This script as a subprocess, once its health is SERVING; killed on exit if still up.
    Its stderr is read all along on a thread (a full pipe would block the server)."""
    proc = subprocess.Popen([sys.executable, __file__, *args], stderr=subprocess.PIPE,
                            text=True, cwd=Path(__file__).resolve().parent.parent)
    lines, address, metrics_url = [], None, None
    for line in proc.stderr:
        lines.append(line)
        if m := re.search(r"gRPC server listening on (\S+:\d+)", line):
            address = m.group(1)
        if m := re.search(r"Prometheus metrics on (\S+)", line):
            metrics_url = m.group(1)
        if "health SERVING" in line:
            break
    else:
        proc.wait()
        raise RuntimeError(f"the server exited before serving:\n{''.join(lines)}")
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        yield ServerProcess(proc, address, metrics_url, lines)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        reader.join(timeout=5)


def inject_faults(step_delay_ms: float, fail_after_steps: int | None, fail_swap_in: bool):
    """Patch the engine's step and the KV cache's swaps, as the flags ask."""
    from jaxserve.engine.engine import Engine
    from jaxserve.runner.kv_cache import DeviceKV

    step, num_steps = Engine.step, [0]

    def patched_step(self):
        if step_delay_ms:
            time.sleep(step_delay_ms / 1e3)
        if fail_after_steps is not None and num_steps[0] >= fail_after_steps:
            raise RuntimeError(f"injected failure in engine step {num_steps[0]}")
        num_steps[0] += 1
        return step(self)

    Engine.step = patched_step
    if fail_swap_in:
        from jax.errors import JaxRuntimeError

        apply_swaps = DeviceKV.apply_swaps

        def failing_swaps(self, plan):
            if plan.swap_in:
                raise JaxRuntimeError("INTERNAL: injected device error copying KV pages in")
            return apply_swaps(self, plan)

        DeviceKV.apply_swaps = failing_swaps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--shutdown-timeout", type=float, default=30.0)
    parser.add_argument("--metrics-port", type=int, default=None)
    parser.add_argument("--num-pages", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--preemption-mode", default=None)
    parser.add_argument("--swap-space", type=int, default=None)
    parser.add_argument("--step-delay-ms", type=float, default=0.0)
    parser.add_argument("--fail-after-steps", type=int, default=None)
    parser.add_argument("--fail-swap-in", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    inject_faults(args.step_delay_ms, args.fail_after_steps, args.fail_swap_in)
    overrides = {k: v for k, v in (("num_pages", args.num_pages),
                                   ("max_num_seqs", args.max_num_seqs),
                                   ("preemption_mode", args.preemption_mode),
                                   ("swap_space", args.swap_space)) if v is not None}
    config = EngineConfig.from_kwargs(**{**SMALL_ENGINE, **overrides})
    return run_server(config, host=args.host, port=args.port,
                      shutdown_timeout=args.shutdown_timeout, loaded=tiny_loaded(),
                      metrics_port=args.metrics_port)


if __name__ == "__main__":
    sys.exit(main())
