"""Counts XLA backend compilations in this process (every jit, AOT or eager op).

The engine records the count after warm-up; serving must never move it. Registering the
listener is the only side effect; it must not change how anything compiles.
"""

from __future__ import annotations

import threading

import jax

_EVENT = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_count = 0
_registered = False


def _listener(event: str, duration: float, **kwargs) -> None:
    global _count
    if event == _EVENT:
        with _lock:
            _count += 1


def num_compilations() -> int:
    """Backend compilations since this module was first used."""
    global _registered
    if not _registered:
        jax.monitoring.register_event_duration_secs_listener(_listener)
        _registered = True
    return _count


num_compilations()
