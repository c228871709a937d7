"""RequestOutput and CompletionOutput: what the engine hands back after a step (plain data, no jax).

As vLLM shapes them: a RequestOutput is one caller's request (its prompt, its timing) and holds
`outputs`, one CompletionOutput per sample (`n` of them). Each output carries its totals so far
and this step's deltas (`new_*`). For the usual n = 1 the request's own `text`, `token_ids`,
`finish_reason` ... read its only sample. A snapshot: later steps never change an output already
returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int                                              # which sample (0 .. n-1)
    token_ids: list[int] = field(default_factory=list)      # all output tokens so far
    text: str = ""                                          # all output text so far
    new_token_ids: list[int] = field(default_factory=list)  # this step's tokens
    new_text: str = ""                                      # this step's text delta
    cumulative_logprob: float = 0.0                         # sum of the sampled tokens' logprobs
    logprobs: list[float] | None = None                     # sampling.logprobs is not None
    new_logprobs: list[float] = field(default_factory=list)
    # sampling.logprobs = k > 0: per output token, its k most likely {token id: logprob}
    top_logprobs: list[dict[int, float]] | None = None
    new_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None                        # stop, length, abort, error

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def snapshot(self) -> "CompletionOutput":
        return CompletionOutput(
            self.index, list(self.token_ids), self.text, list(self.new_token_ids), self.new_text,
            self.cumulative_logprob, None if self.logprobs is None else list(self.logprobs),
            list(self.new_logprobs),
            None if self.top_logprobs is None else list(self.top_logprobs),
            list(self.new_top_logprobs), self.finish_reason)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=lambda: [CompletionOutput(0)])
    finished: bool = False          # every sample has finished
    error: str | None = None
    num_cached_tokens: int = 0
    time_to_first_token: float | None = None  # arrival to the first token of any sample
    latency: float | None = None    # arrival to finish, seconds (set when finished)
    # sampling.prompt_logprobs = k: per prompt position None (the first), then {token id:
    # logprob} of the prompt token there and the k most likely; set with the first tokens
    prompt_logprobs: list[dict[int, float] | None] | None = None

    # ---- the first sample's fields (the only sample, unless n > 1) ------------------------
    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def new_token_ids(self) -> list[int]:
        return self.outputs[0].new_token_ids

    @property
    def new_text(self) -> str:
        return self.outputs[0].new_text

    @property
    def logprobs(self) -> list[float] | None:
        return self.outputs[0].logprobs

    @property
    def new_logprobs(self) -> list[float]:
        return self.outputs[0].new_logprobs

    @property
    def top_logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].top_logprobs

    @property
    def new_top_logprobs(self) -> list[dict[int, float]]:
        return self.outputs[0].new_top_logprobs

    @property
    def finish_reason(self) -> str | None:
        """The first sample's (abort and error end every sample)."""
        return self.outputs[0].finish_reason
