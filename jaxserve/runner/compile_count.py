"""CompileCounter: counts XLA backend compilations (every jit, AOT or eager op) while it is open.

    with CompileCounter() as compiles:
        serve()
    assert compiles.count == 0

The engine compiles everything at warm-up; a counter opened after it must stay at zero. Each
counter owns its jax.monitoring listener and removes it on exit; it must not change how
anything compiles.
"""

from __future__ import annotations

import threading

import jax

_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    def __init__(self):
        self.count = 0
        self._lock = threading.Lock()

    def _listener(self, event: str, duration: float, **kwargs) -> None:
        if event == _EVENT:
            with self._lock:
                self.count += 1

    def __enter__(self) -> "CompileCounter":
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listener)
