"""Request host state, SamplingParams (validated) and the events a request emits.

Plain Python over integers: no jax, no tokenizer, no device state. The scheduler owns the
lifecycle (status, num_computed_tokens); the engine owns text.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field


class FinishReason(str, enum.Enum):
    STOP = "stop"        # EOS, a stop token id or a stop string
    LENGTH = "length"    # max_tokens or max_model_len
    ABORT = "abort"      # cancelled by the caller
    ERROR = "error"      # rejected or failed; Request.error says why


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self.validate()

    def validate(self) -> None:
        def bad(name, value, limit):
            raise ValueError(f"{name}={value!r} is invalid: must be {limit}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", self.max_tokens, "an integer >= 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", self.temperature, ">= 0 (0 means greedy)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", self.top_k, "an integer >= 0 (0 disables top-k)")
        if not (0.0 < self.top_p <= 1.0):
            bad("top_p", self.top_p, "in (0, 1]")
        if not (0.0 <= self.min_p <= 1.0):
            bad("min_p", self.min_p, "in [0, 1]")
        if self.seed is not None and not (0 <= self.seed < 2**32):
            bad("seed", self.seed, "in [0, 2**32)")
        if any(not s for s in self.stop):
            bad("stop", self.stop, "non-empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", self.stop_token_ids, "non-negative token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    seed: int                      # sampling keys derive from (seed, output index)
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0              # lower value runs first
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_seq: int = 0           # tie-break: earlier arrival wins
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0   # tokens whose KV is in the cache
    num_cached_tokens: int = 0     # prompt tokens served by the prefix cache at admission
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None
    first_token_time: float | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: priority first, then arrival."""
        return (self.priority, self.arrival_seq)


@dataclass(frozen=True)
class TokenEvent:
    """What one step produced for one request (the scheduler's output, before text)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[float, ...]
    finish_reason: FinishReason | None = None
    error: str | None = None
