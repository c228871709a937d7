"""Runner: what the engine needs from whatever runs its steps, and StepResult, what comes back.

Implemented by runner.model_runner.ModelRunner, spec.runner.SpeculativeRunner and the
multi-host LeaderRunner / FollowerRunner (runner/multihost.py). The engine calls warmup() once,
execute(plan) every step and close() at the end; wait() blocks until dispatched work is done
(multi-host start-up orders its collectives with it). Declarations only: no jax here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from jaxserve.core.plan import StepPlan
from jaxserve.runner.buckets import BucketTable


@dataclass
class StepResult:
    # [num_chunks] i32, or [num_chunks, k+1] for speculative steps (-1 after the accepted run);
    # entries of chunks that do not sample are meaningless.
    token_ids: np.ndarray
    logprobs: np.ndarray   # f32, the shape of token_ids
    # Plain steps: [num_chunks, MAX_TOP_LOGPROBS] most likely token ids and their logprobs
    # (zeros when no row asked); None from speculative steps (which never carry such rows).
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    # Steps with prompt-logprob rows: [T, 1 + K] per token row (the next prompt token, then
    # the alternatives), None otherwise.
    prompt_ids: np.ndarray | None = None
    prompt_logprobs: np.ndarray | None = None


class Runner(Protocol):
    buckets: BucketTable

    def warmup(self, progress: bool = True) -> None:
        """Compile and run every executable once; serving never compiles after this."""

    def execute(self, plan: StepPlan) -> StepResult:
        """Apply the plan's swaps, run its step, return its sampled tokens."""

    @property
    def num_host_swapped(self) -> int:
        """Requests whose KV pages are in host memory now."""

    def wait(self) -> None:
        """Block until every computation dispatched so far has finished."""

    def close(self) -> None:
        """Release what outlives the engine (multi-host: stop the followers). Idempotent."""
