"""StepTimings: where the engine loop's host time goes, per phase, summed over steps.

Phases: schedule (the scheduler's plan), build (the plan laid out as step inputs), dispatch
(handing them and the executable to the device), wait (blocked on a step's tokens), update (the
scheduler takes them in), emit (outputs with text). `jaxserve bench overhead` reads them. A
perf_counter pair per phase: cheap enough to be always on. No jax, no decisions.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

PHASES = ("schedule", "build", "dispatch", "wait", "update", "emit")


class StepTimings:
    def __init__(self):
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def per_step_ms(self, num_steps: int) -> dict[str, float]:
        return {name: 1000 * s / max(num_steps, 1) for name, s in self.seconds.items()}
