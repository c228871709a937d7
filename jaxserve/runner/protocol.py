"""Runner: what the engine needs from whatever runs its steps. Declarations only: no jax here.

Implemented by runner.model_runner.ModelRunner, spec.runner.SpeculativeRunner and the
multi-host LeaderRunner / FollowerRunner (runner/multihost.py). The engine calls warmup() once,
then every step dispatch(plan) and, for that step's results, collect(pending): the same two
calls whether or not the runner overlaps. A runner whose dispatch returns before the device is
done (can_overlap) lets the engine plan and dispatch the next step before collecting this one;
the others run the step inside dispatch (RunsInDispatch) and collect hands its result over.
wait() blocks until dispatched work is done (multi-host start-up orders its collectives with
it); close() at the end. What comes back is core.plan.StepResult: plain numpy arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from jaxserve.core.plan import StepPlan, StepResult  # noqa: F401 (StepResult: re-export)
from jaxserve.runner.step_timings import StepTimings
from jaxserve.runner.buckets import BucketTable


class Runner(Protocol):
    buckets: BucketTable
    timings: StepTimings | None  # the engine's, to time the runner's phases (None: untimed)
    can_overlap: bool  # dispatch returns before the step is done on the device

    def warmup(self, progress: bool = True) -> None:
        """Compile and run every executable once; serving never compiles after this."""

    def dispatch(self, plan: StepPlan) -> object:
        """Apply the plan's swaps and start its step; a handle for collect()."""

    def collect(self, pending: object) -> StepResult:
        """The dispatched step's sampled tokens on the host (blocks until they are)."""

    def execute(self, plan: StepPlan) -> StepResult:
        """dispatch, then collect: one step start to end."""

    @property
    def num_host_swapped(self) -> int:
        """Requests whose KV pages are in host memory now."""

    def wait(self) -> None:
        """Block until every computation dispatched so far has finished."""

    def close(self) -> None:
        """Release what outlives the engine (multi-host: stop the followers). Idempotent."""

    def rollout_memory(self) -> object:
        """What the rollout verbs (weight updates, sleep, wake_up: engine/rollout.py) act on:
        a runner/rollout_memory.py RunnerMemory over this runner's weights and KV pool; a
        runner that cannot give one raises NotImplementedError saying why."""


@dataclass(frozen=True, slots=True)
class DoneStep:
    """The handle of a step that ran inside dispatch: its result."""

    result: StepResult


class RunsInDispatch:
    """The Runner members of a runner that runs each step to its end inside dispatch (it reads
    every result before the next plan: speculation, multi-host); the runner defines execute."""

    can_overlap = False
    timings: StepTimings | None = None

    def dispatch(self, plan: StepPlan) -> DoneStep:
        return DoneStep(self.execute(plan))

    def collect(self, pending: DoneStep) -> StepResult:
        return pending.result

    def rollout_memory(self) -> object:
        raise NotImplementedError(self.rollout_refusal)

    rollout_refusal = "this runner does not support weight updates, sleep or wake_up"
