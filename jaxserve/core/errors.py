"""RequestError: the one error a request refused at intake raises (core/intake.py checks), and
QueueFullError, the one load refusal (the waiting queue is full: retry later).

Its own module so that the modules intake reads (request.py's SamplingParams, the structured
output parameters) can raise it without importing the intake. Plain Python, nothing else.
"""

from __future__ import annotations


class RequestError(ValueError):
    """A request refused at intake. `field` is the request field at fault (the engine's name:
    "prompt", "prompt_token_ids", "max_tokens", "logit_bias", ...); the message names the field,
    the value and the limit. exceeds_kv_pool: the request is well formed but the KV page pool
    can never hold it (still bad input to the front ends: no retry can pass)."""

    def __init__(self, field: str, message: str, *, exceeds_kv_pool: bool = False):
        super().__init__(message)
        self.field = field
        self.message = message
        self.exceeds_kv_pool = exceeds_kv_pool


class QueueFullError(RuntimeError):
    """The waiting queue holds max_queued_requests already."""
