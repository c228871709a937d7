"""Start-up phases in the log: each phase's start, then how long it took.

A context manager for the engine builder's long steps (loading, compiling, profiling), so a
start-up never has a silent stretch longer than one phase. Logging only: no timing decisions.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager


@contextmanager
def phase(log: logging.Logger, what: str):
    """Log `what` as it starts and how long it took as it ends ("loading model ... done in
    3.2 s")."""
    log.info("%s ...", what)
    start = time.perf_counter()
    yield
    log.info("%s: done in %.1f s", what, time.perf_counter() - start)
