"""Request intake: every check on a request before it is queued, and the one error it raises.

A request is refused here, with a RequestError naming the field, the value and the limit, when
its prompt is empty, longer than max_model_len allows or holds a token id outside the
vocabulary; when a token id in logit_bias, allowed_token_ids, stop_token_ids or
structured_outputs_after is outside the vocabulary; when a sampling setting is out of range
(SamplingParams.validate, which raises RequestError too); when its structured_outputs is not a
StructuredOutputs (whose constructor checks its shape, raising a RequestError subclass); or
when its prompt plus max_tokens needs more KV pages than the whole pool (page 0 excluded): such
a request could never run; when it names a LoRA adapter and none is served.
Engine.make_request runs `check_request` on every request, so the offline LLM, the gRPC server
and the HTTP server (through AsyncEngine) refuse the same requests with the same words; the
front ends map RequestError to INVALID_ARGUMENT (the KV pool case too: no retry could pass)
and HTTP 400 with `param` = the field. `check_admission` is the other half, shared by every
queue in front of an engine (Engine, AsyncEngine, the data-parallel client): a request id
already in use, or a full waiting queue (QueueFullError: load, which a retry may pass).

Size limits that must hold before any tokenizer work (characters, encoded bytes) are
engine/prompt_intake.PromptLimits'; turning wire fields into SamplingParams is each front
end's. This module must not import jax, a tokenizer or the engine, must not tokenize, and must
not change a request: it only reads and refuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from jaxserve.core.errors import QueueFullError, RequestError  # noqa: F401 (re-exports)
from jaxserve.core.request import SamplingParams
from jaxserve.structured.params import StructuredOutputs


@dataclass(frozen=True)
class RequestLimits:
    """What intake checks a request against. An EngineInfo has the same four fields and may be
    passed wherever a RequestLimits is asked for."""

    max_model_len: int
    vocab_size: int
    page_size: int
    num_pages: int          # the KV pool, reserved page 0 included


def pool_tokens(limits: RequestLimits) -> int:
    """Tokens the whole KV page pool holds (page 0 is reserved scratch)."""
    return (limits.num_pages - 1) * limits.page_size


def max_request_tokens(limits: RequestLimits) -> int:
    """The most tokens, prompt and output together, one request may hold."""
    return min(limits.max_model_len, pool_tokens(limits))


def _limit_words(limits: RequestLimits) -> tuple[str, bool]:
    """How to name the binding limit on a request's tokens, and whether it is the KV pool."""
    if limits.max_model_len <= pool_tokens(limits):
        return f"{limits.max_model_len} (max_model_len)", False
    return (f"{pool_tokens(limits)}: the KV page pool holds {limits.num_pages - 1} pages of "
            f"{limits.page_size} tokens (max_model_len {limits.max_model_len})"), True


def output_room(limits: RequestLimits, prompt_len: int, prompt_field: str = "prompt") -> int:
    """The most output tokens a prompt of prompt_len tokens leaves room for (at least 1);
    raises RequestError naming prompt_field when it leaves none."""
    limit = max_request_tokens(limits)
    if prompt_len >= limit:
        words, pool = _limit_words(limits)
        raise RequestError(prompt_field, f"{prompt_field} has {prompt_len} tokens, but a request "
                           f"may hold at most {words}, output included", exceeds_kv_pool=pool)
    return limit - prompt_len


def check_length(limits: RequestLimits, prompt_len: int, max_tokens: int, *,
                 prompt_field: str = "prompt", max_tokens_field: str = "max_tokens") -> None:
    """prompt + max_tokens within max_model_len and within the KV page pool."""
    room = output_room(limits, prompt_len, prompt_field)
    if max_tokens > room:
        words, pool = _limit_words(limits)
        raise RequestError(max_tokens_field, f"{max_tokens_field}={max_tokens} is too large: "
                           f"the prompt has {prompt_len} tokens and a request may hold at most "
                           f"{words}, so {max_tokens_field} must be at most {room}",
                           exceeds_kv_pool=pool)


def check_token_ids(limits: RequestLimits, token_ids: Iterable[int], field: str) -> None:
    """Every id in [0, vocab_size)."""
    vocab = limits.vocab_size
    bad = next((t for t in token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(field, f"{field} contains token id {bad}, outside the vocabulary "
                                  f"[0, {vocab})")


def check_prompt(limits: RequestLimits, prompt_token_ids: list[int],
                 field: str = "prompt_token_ids") -> None:
    """Non-empty, every id in the vocabulary (its length: check_length)."""
    if not prompt_token_ids:
        raise RequestError(field, f"{field} is empty: a prompt needs at least one token")
    check_token_ids(limits, prompt_token_ids, field)


def check_sampling(limits: RequestLimits, params: SamplingParams) -> None:
    """Ranges (SamplingParams.validate), and the token ids the params name within the
    vocabulary: stop_token_ids index the min_tokens mask, the others the logits."""
    params.validate()
    check_token_ids(limits, (t for t, _ in params.logit_bias), "logit_bias")
    check_token_ids(limits, params.allowed_token_ids or (), "allowed_token_ids")
    check_token_ids(limits, params.stop_token_ids, "stop_token_ids")
    check_token_ids(limits, params.structured_outputs_after, "structured_outputs_after")


def check_structured_outputs(params: SamplingParams) -> None:
    """None, or a StructuredOutputs (whose constructor checked its shape: exactly one
    constraint, JSON that parses); whether the grammar compiles is the compiler's to say."""
    so = params.structured_outputs
    if so is not None and not isinstance(so, StructuredOutputs):
        raise RequestError("structured_outputs", f"structured_outputs={so!r} is invalid: must "
                           f"be a StructuredOutputs or a dict of its fields, not "
                           f"{type(so).__name__}")


def check_request(limits: RequestLimits, prompt_token_ids: list[int], params: SamplingParams,
                  *, prompt_field: str = "prompt_token_ids") -> None:
    """Every intake check on one tokenized request; raises the first RequestError."""
    check_prompt(limits, prompt_token_ids, prompt_field)
    check_sampling(limits, params)
    check_structured_outputs(params)
    check_length(limits, len(prompt_token_ids), params.max_tokens, prompt_field=prompt_field)


def check_adapter_served(lora_request, served: bool, how: str = "start it with enable_lora"
                         ) -> None:
    """A request that names a LoRA adapter where none is served is refused naming
    lora_request (`how`: what would serve one)."""
    if lora_request is not None and not served:
        raise RequestError("lora_request", f"lora_request is given, but this engine serves no "
                                           f"LoRA adapters ({how})")


def check_admission(request_id: str, in_use, queued: int, incoming: int,
                    max_queued_requests: int | None) -> None:
    """Refuse a request whose id is in use (`in_use`: a container of the live ids) or that
    would take the waiting queue past max_queued_requests (`queued` waiting now, `incoming`
    more with this one)."""
    if max_queued_requests is not None and queued + incoming > max_queued_requests:
        raise QueueFullError(f"waiting queue is full (max_queued_requests="
                             f"{max_queued_requests})")
    if request_id in in_use:
        raise ValueError(f"request_id {request_id!r} is already in use")
