"""RequestOutput: what the engine hands back for one request after a step (plain data, no jax).

A snapshot: later steps never change an output already returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)    # all output tokens so far
    text: str = ""                                          # all output text so far
    new_token_ids: list[int] = field(default_factory=list)  # this step's tokens
    new_text: str = ""                                      # this step's text delta
    new_logprobs: list[float] = field(default_factory=list)
    logprobs: list[float] | None = None                     # sampling.logprobs is not None
    # sampling.logprobs = k > 0: per output token, its k most likely {token id: logprob}
    new_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] | None = None
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    time_to_first_token: float | None = None
    latency: float | None = None  # arrival to finish, seconds (set when finished)
