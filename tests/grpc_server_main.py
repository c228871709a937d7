"""Run `run_server` with the tiny test model, for tests that need a real server process.

    python tests/grpc_server_main.py [--port 0] [--shutdown-timeout 30] [--metrics-port 0]

Uses the shapes in conftest.SMALL_ENGINE so warm-up hits the persistent compile cache the test
session configured (the environment is inherited). Logs "listening on HOST:PORT" on stderr;
exits with run_server's return code. It serves nothing but the tiny random model.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conftest import SMALL_ENGINE  # noqa: E402  (needs the path set above)
from tiny_models import tiny_loaded  # noqa: E402

from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.server.grpc_server import run_server  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--shutdown-timeout", type=float, default=30.0)
    parser.add_argument("--metrics-port", type=int, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    config = EngineConfig.from_kwargs(**SMALL_ENGINE)
    return run_server(config, host=args.host, port=args.port,
                      shutdown_timeout=args.shutdown_timeout, loaded=tiny_loaded(),
                      metrics_port=args.metrics_port)


if __name__ == "__main__":
    sys.exit(main())
