"""Multi-host SPMD: process 0 schedules and broadcasts each step's plan; every process runs it.

In a cluster of several JAX processes the step is one SPMD program over a mesh that spans all
of them, so every process must call the same executable with the same inputs, in the same
order. Process 0's Engine gets a LeaderRunner: before running a plan it sends it to the others.
Every other process builds the same Engine (same config, same warm-up order, hence the same
executables) and runs FollowerRunner.follow(), which executes each received plan until
process 0 sends stop.

Transport: jax.experimental.multihost_utils.broadcast_one_to_all of uint8 arrays (a [2] i32
header, kind and length, then the pickled plan padded to a power of two, so only a few
broadcast shapes ever compile). The processes are one trusted job, so a pickle is fine here.
Only plans that touch the device (chunks, swaps) or host swap state (dropped swaps) are sent;
an idle leader pings every minute instead, so a waiting follower's collective never times out.
Every broadcast and every step is waited for before the next starts (the processes' Gloo/ICI
collectives must come in the same order everywhere, and async dispatch could reorder them).
This module never schedules and must not change what a step computes.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from typing import Callable

import jax
import numpy as np

from jaxserve.core.plan import StepPlan
from jaxserve.runner.protocol import RunsInDispatch

log = logging.getLogger(__name__)
_STOP, _PLAN, _PING = 0, 1, 2
_MIN_PAYLOAD = 1024
KEEPALIVE_S = 60.0  # well under Gloo's 30-minute collective timeout


def _broadcast(array: np.ndarray) -> np.ndarray:
    """Process 0's array, on every process (each passes an array of the same shape)."""
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.broadcast_one_to_all(array))


def _payload_size(num_bytes: int) -> int:
    size = _MIN_PAYLOAD
    while size < num_bytes:
        size *= 2
    return size


class PlanChannel:
    """Process 0 -> every process: StepPlans, keep-alive pings and stop, in order.

    broadcast: process 0's array on every process (tests pass a fake).
    """

    def __init__(self, broadcast: Callable[[np.ndarray], np.ndarray] = _broadcast):
        self.broadcast = broadcast

    def send(self, plan: StepPlan | None) -> None:
        """plan to every process; None sends stop."""
        payload = b"" if plan is None else pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        self.broadcast(np.array([_STOP if plan is None else _PLAN, len(payload)], np.int32))
        if plan is not None:
            buf = np.zeros(_payload_size(len(payload)), np.uint8)  # [bucket]
            buf[:len(payload)] = np.frombuffer(payload, np.uint8)
            self.broadcast(buf)

    def ping(self) -> None:
        self.broadcast(np.array([_PING, 0], np.int32))

    def receive(self) -> StepPlan | None:
        """The next plan (pings skipped); None once process 0 sent stop."""
        while True:
            kind, size = (int(v) for v in self.broadcast(np.zeros(2, np.int32)))
            if kind == _STOP:
                return None
            if kind == _PLAN:
                buf = self.broadcast(np.zeros(_payload_size(size), np.uint8))
                return pickle.loads(buf[:size].tobytes())


def _touches_runner(plan: StepPlan) -> bool:
    return bool(plan.chunks or plan.decode or plan.swap_out or plan.swap_in or plan.dropped_swaps
                or plan.prefix_stores or plan.prefix_loads or plan.released)


class _Wrapping(RunsInDispatch):
    """The Runner members a leader or follower passes straight to the runner it wraps."""

    runner: object
    rollout_refusal = ("weight updates, sleep and wake_up are not supported with several JAX "
                       "processes yet (every process would have to run each verb together)")

    @property
    def buckets(self):
        return self.runner.buckets

    @property
    def num_host_swapped(self) -> int:
        return self.runner.num_host_swapped

    def warmup(self, progress: bool = True) -> None:
        self.runner.warmup(progress)

    def wait(self) -> None:
        self.runner.wait()


class LeaderRunner(_Wrapping):
    """Process 0's Runner: sends each plan to the followers, then runs it itself; close()
    (the engine's, at the end of the command) sends stop.

    While the engine idles, a daemon thread pings the followers every keepalive_s seconds:
    a follower waits for the next plan inside a collective, and Gloo (CPU) gives up on a
    collective after 30 minutes. One lock orders pings, plans and stop, so the processes see
    the same sequence of collectives.
    """

    def __init__(self, runner, channel: PlanChannel | None = None,
                 keepalive_s: float = KEEPALIVE_S):
        self.runner = runner
        self.channel = channel or PlanChannel()
        self.stopped = False
        self.num_pings = 0
        self._lock = threading.Lock()
        self._last_sent = time.monotonic()
        self._closed = threading.Event()
        threading.Thread(target=self._keep_alive, args=(keepalive_s,), daemon=True,
                         name="jaxserve-keepalive").start()

    def close(self) -> None:
        self.stop_followers()
        self.runner.close()

    def execute(self, plan: StepPlan):
        with self._lock:
            if self.stopped:
                raise RuntimeError("the follower processes were stopped; this engine cannot "
                                   "run more steps")
            if _touches_runner(plan):
                self.channel.send(plan)
                self._last_sent = time.monotonic()
            return self.runner.execute(plan)

    def stop_followers(self) -> None:
        """Tell the followers to leave their loop (they return from follow())."""
        with self._lock:
            if not self.stopped:
                self.stopped = True
                self._closed.set()
                self.channel.send(None)

    def _keep_alive(self, period: float) -> None:
        while not self._closed.wait(period / 2):
            with self._lock:
                if not self.stopped and time.monotonic() - self._last_sent >= period:
                    self.channel.ping()
                    self.num_pings += 1
                    self._last_sent = time.monotonic()


class FollowerRunner(_Wrapping):
    """A non-zero process's Runner: it runs process 0's plans (follow), and never plans."""

    def __init__(self, runner, channel: PlanChannel | None = None):
        self.runner = runner
        self.channel = channel or PlanChannel()

    def close(self) -> None:
        self.runner.close()

    def execute(self, plan: StepPlan):
        raise RuntimeError(f"process {jax.process_index()} follows process 0's plans "
                           "(FollowerRunner.follow); only process 0 schedules")

    def follow(self) -> int:
        """Run received plans until process 0 sends stop; returns how many ran."""
        num_plans = 0
        while (plan := self.channel.receive()) is not None:
            self.runner.execute(plan)
            num_plans += 1
        return num_plans


def for_this_process(runner):
    """The runner as is in a one-process job; else a LeaderRunner on process 0 and a
    FollowerRunner elsewhere."""
    if jax.process_count() == 1:
        return runner
    # Computations run asynchronously, and two that both hold collectives may overlap; the
    # processes must issue collectives in one order, so warm-up ends before the first plan.
    runner.wait()
    if jax.process_index() == 0:
        return LeaderRunner(runner)
    return FollowerRunner(runner)
