"""dead_end: whether a constrained request's own token bans leave its grammar no next token.

A step masks a request's logits twice: by its grammar's bitmask (built on the host by its
matcher) and by its logits processors (applied on the device: core/processor_slots.py). The
processors ban tokens outright: a bad word's token (a single-token word always, a multi-token
word's last token where its earlier tokens end the output), every token outside
allowed_token_ids, the stop tokens while the output is shorter than min_tokens. When those bans
cover every token the grammar allows next, every logit is -inf and no sample can satisfy both:
the request asks for the impossible, which is bad input, not an engine failure. `dead_end` finds
that from the state the next step's bitmask is built from, before the step is planned, and
returns a RequestError naming the fields at fault (bad_words first), so the engine finishes the
request with it. It costs one extra mask per step, only for constrained requests that ban
tokens (`may_dead_end`). Engine thread only (the matcher is not thread-safe); no jax.
"""

from __future__ import annotations

import numpy as np

from jaxserve.core.errors import RequestError
from jaxserve.core.processor_slots import completed_bans
from jaxserve.core.request import Request, SamplingParams


def may_dead_end(sampling: SamplingParams) -> bool:
    """Whether a constrained request with these params bans any token (else no check is due)."""
    return bool(sampling.bad_words or sampling.allowed_token_ids is not None
                or sampling.min_tokens)


def _bans(request: Request, vocab_size: int) -> dict[str, np.ndarray]:
    """Field -> the token ids it bans for the request's next token (ids below vocab_size)."""
    sp, num_out = request.sampling, len(request.output_token_ids)
    bans = {}
    words = [seq[0] for seq in request.bad_words_ids if len(seq) == 1]
    words += completed_bans(request)
    if words:
        bans["bad_words"] = np.asarray(words, np.int64)
    if sp.allowed_token_ids is not None:
        outside = np.ones(vocab_size, bool)
        outside[[t for t in sp.allowed_token_ids if t < vocab_size]] = False
        bans["allowed_token_ids"] = np.flatnonzero(outside)
    if num_out + request.num_pending_tokens < sp.min_tokens:
        stops = tuple(sp.stop_token_ids) + (() if sp.ignore_eos else request.eos_token_ids)
        bans["min_tokens"] = np.asarray(stops, np.int64)
    return {field: ids[ids < vocab_size] for field, ids in bans.items()}


def dead_end(request: Request) -> RequestError | None:
    """The error when the request's bans leave no token its grammar allows next; None when
    some token is left, or no grammar constrains the next token (finished, or a deferred one
    that has not started)."""
    grammar = request.grammar
    active = grammar.constraining() if grammar is not None else None
    if active is None or active.is_terminated():
        return None
    row = np.empty(active.num_words, np.int32)  # [ceil(V / 32)] words, bit t % 32 of t // 32
    active.fill_bitmask(row)
    allowed = np.unpackbits(row.view(np.uint8), bitorder="little").astype(bool)  # [W * 32]
    left = allowed.copy()
    bans = _bans(request, active.vocab_size)
    for ids in bans.values():
        left[ids] = False
    if left.any():
        return None
    fields = [field for field, ids in bans.items() if allowed[ids].any()]
    if not fields:  # the grammar itself allows nothing: not the request's bans
        return None
    named = " and ".join(f"{field}={_shown(request, field)}" for field in fields)
    return RequestError(fields[0], (
        f"{named} ban every token the output constraint (structured_outputs, or over HTTP its "
        f"response_format / guided_* / tool_choice) allows after "
        f"{len(request.output_token_ids)} output tokens, so no output can satisfy both: "
        f"drop those bans or loosen the constraint"))


def _shown(request: Request, field: str):
    sp = request.sampling
    return {"bad_words": list(sp.bad_words), "min_tokens": sp.min_tokens}.get(
        field, f"<{len(sp.allowed_token_ids or ())} ids>")
