"""XLA's CPU compute threads at a lower scheduling priority than the engine's host loop.

On the CPU backend the "device" is XLA's thread pool on the same cores as the serving loop,
and with async scheduling the host's bookkeeping for one step runs while the next computes:
with every core busy in XLA, the loop's thread gets a share of a core and every host phase
stretches (1.2-2x measured on 2 cores at 256 requests), which is time the next step then waits
for. A higher nice value on XLA's threads lets the host thread take its core when it is
runnable and leaves XLA every core the rest of the time; it wins back the share of a core, not
what sharing caches and memory with XLA's compute costs (docs/host_loop.md). Linux only (threads are found by name
in /proc); elsewhere, and on accelerators (whose compute is not on these cores), it does
nothing. It never touches threads other than XLA's compute pool.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

XLA_CPU_THREAD_NAME = "tf_XLAEigen"  # the name XLA's CPU client gives its compute threads


def lower_xla_cpu_threads(increment: int, tasks: Path = Path("/proc/self/task")) -> int:
    """Set XLA's compute threads to nice `increment` above this process's nice (an unprivileged
    process can only raise it; a thread already there is left); returns how many threads are
    at it now."""
    if increment <= 0 or not tasks.is_dir():
        return 0
    target = os.getpriority(os.PRIO_PROCESS, 0) + increment
    done = 0
    for task in tasks.iterdir():
        try:
            if (task / "comm").read_text().strip() != XLA_CPU_THREAD_NAME:
                continue
            tid = int(task.name)
            if os.getpriority(os.PRIO_PROCESS, tid) < target:
                os.setpriority(os.PRIO_PROCESS, tid, target)
            done += 1
        except (OSError, ValueError):  # a thread that ended meanwhile
            continue
    log.debug("XLA CPU compute threads at nice %d: %d", target, done)
    return done
