"""OpenAI's error shape, the HTTP front end's refusals, and engine exceptions mapped to them.

A RequestError (core/intake.py: every check on a request) is a 400 whose param is its field.
Engine failures: a stopped engine is 503, one that failed under the request 500, a passed
`timeout` 408; a load refusal (the waiting queue, or the client's bound) is 429 with
Retry-After. An OpenAIError carries the HTTP status, a message naming the field and its limit,
the field itself and OpenAI's error type; `body()` is {"error": {message, type, param, code}}.
UNSUPPORTED lists the parameters the engine cannot honour yet: each is refused with a 400
naming it, never accepted and ignored; `check_supported` also refuses what OpenAI refuses
(stream_options without stream: true) and store=true (nothing is stored). Plain data and pure
functions: no engine calls, no routing.
"""

from __future__ import annotations

import re
from typing import Callable

from jaxserve.core.intake import RequestError
from jaxserve.engine.async_engine import DeadlineExceededError, EngineDeadError, EngineFailedError
from jaxserve.core.errors import QueueFullError
from jaxserve.engine.client_limits import RETRY_AFTER_S

# Parameters the engine cannot honour, each with a test for the values it does honour: best_of
# > 1 (the best of several samples by cumulative logprob) and suffix (insertion) are not planned.
UNSUPPORTED: dict[str, Callable[[object], bool]] = {
    "best_of": lambda v: v in (None, 1),
    "suffix": lambda v: v is None,
}
_FIELD_IN_MESSAGE = re.compile(r"^(\w+)[=\s]")
_ENGINE_FIELD_NAMES = {"prompt_token_ids": "prompt"}


class OpenAIError(Exception):
    """A refusal with OpenAI's error shape: status, message, the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind, self.headers = kind, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.status}}


def bad_request(message: str, param: str | None) -> OpenAIError:
    return OpenAIError(400, message, param)


def error_for_exception(exc: BaseException, prompt_field: str = "prompt",
                        constraint_field: str | None = None) -> OpenAIError:
    """Map what AsyncEngine.generate / make_request / SamplingParams raise to an HTTP error.
    constraint_field: the request's output-constraint field, which a grammar that does not
    compile (or this model's tokenizer refusing constraints) is a 400 naming."""
    if isinstance(exc, OpenAIError):
        return exc
    if constraint_field is not None and _is_constraint_error(exc):
        return bad_request(f"{constraint_field}: {exc}", constraint_field)
    if isinstance(exc, RequestError):  # refused at intake: param is the field it names
        field = prompt_field if exc.field in ("prompt", "prompt_token_ids") else exc.field
        return bad_request(str(exc), field)
    if isinstance(exc, QueueFullError):
        return OpenAIError(429, str(exc), None, "rate_limit_error",
                           {"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, str(exc), None, "service_unavailable")
    if isinstance(exc, EngineFailedError):
        return OpenAIError(500, str(exc), None, "internal_error")
    if isinstance(exc, DeadlineExceededError):
        return OpenAIError(408, f"{exc} (timeout)", "timeout", "timeout_error")
    if isinstance(exc, ValueError):
        match = _FIELD_IN_MESSAGE.match(str(exc))
        param = match.group(1) if match else None
        param = prompt_field if param in ("prompt", "prompt_token_ids") else param
        return bad_request(str(exc), _ENGINE_FIELD_NAMES.get(param, param))
    raise exc


def _is_constraint_error(exc: BaseException) -> bool:
    from jaxserve.structured.compiler import GrammarTimeoutError, InvalidGrammarError
    from jaxserve.structured.params import StructuredOutputsError
    return (isinstance(exc, (InvalidGrammarError, GrammarTimeoutError, StructuredOutputsError))
            or isinstance(exc, ValueError) and str(exc).startswith("structured_outputs"))


def check_supported(request) -> None:
    for name, honoured in UNSUPPORTED.items():
        if name in type(request).model_fields and not honoured(getattr(request, name)):
            value = getattr(request, name)
            shown = value.model_dump() if hasattr(value, "model_dump") else value
            raise bad_request(f"{name}={shown!r} is not supported by this server yet "
                              f"(only the default is)", name)
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is set but stream is not true: stream_options is "
                          "only allowed with stream: true (as in OpenAI)", "stream_options")
    if getattr(request, "store", None):
        raise bad_request("store=true asks the server to store the completion, and this "
                          "server stores nothing: omit store or set it to false", "store")
    if getattr(request, "top_logprobs", None) and not request.logprobs:
        raise bad_request("top_logprobs is set, so logprobs must be true", "top_logprobs")
    if request.prompt_logprobs is not None and request.stream:
        raise bad_request("prompt_logprobs is not available with stream=true (as in vLLM): "
                          "request it without streaming", "prompt_logprobs")


def logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as JSON object keys, so strings) -> token id -> bias."""
    out = {}
    for key, value in (bias or {}).items():
        try:
            out[int(key)] = value
        except ValueError:
            raise bad_request(f"logit_bias key {key!r} is not a token id: keys must be "
                              f"integer token ids (as strings, e.g. \"50256\")",
                              "logit_bias") from None
    return out
