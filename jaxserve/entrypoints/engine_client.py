"""EngineClient: what the gRPC and HTTP front ends (and serve.py) may use of the engine they
serve. Two implementations: engine/async_engine.py's AsyncEngine (one engine on a thread of
this process) and data_parallel/client.py's DataParallelClient (N engine processes). A
declaration only: no behaviour here; tests check both classes have every member.
"""

from __future__ import annotations

from typing import AsyncIterator, Protocol


class EngineClient(Protocol):
    # engine: the served engine's facts: tokenizer, info (EngineInfo), config, metrics
    # (.registry, .serve_http), lora_registry (None: no adapters)
    engine: object
    error: BaseException | None     # set once no engine is left to serve (health NOT_SERVING)
    limits: object                  # prompt_intake.PromptLimits
    text_pool: object               # prompt_intake.TextPool: tokenizing off the event loop
    clients: object                 # client_limits.ClientLimits: requests in flight per key
    data_parallel_size: int         # engines behind it (1: one engine, which also runs the
    #                                 rollout verbs through engine.rollout)

    def generate(self, prompt=None, params=None, *, request_id: str | None = None,
                 priority: int = 0, prompt_token_ids: list[int] | None = None,
                 deadline: float | None = None, lora_request=None) -> AsyncIterator:
        """RequestOutputs of one request; leaving early aborts it."""

    def abort(self, request_id: str) -> None: ...

    async def reset_prefix_cache(self) -> None:
        """Empty every engine's prefix cache between steps; returns once all have."""

    def abort_all(self, error: BaseException) -> int: ...

    @property
    def num_in_flight(self) -> int: ...

    def rank_health(self) -> dict[int, str] | None:
        """Per data-parallel rank "serving" / "not_serving"; None: one engine."""

    def start(self) -> None: ...

    def stop(self, timeout: float | None = None) -> None: ...
