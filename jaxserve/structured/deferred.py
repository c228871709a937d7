"""DeferredMatcher: a grammar that starts after a token sequence (SamplingParams'
structured_outputs_after). Until the output contains the sequence, no token is masked and the
grammar consumes nothing; the tokens after its first occurrence, in the same step or later, go
to the grammar, which masks every step from then on.

It answers the GrammarMatcher calls the scheduler makes (accept, rollback, num_valid,
fill_bitmask, is_terminated, num_words) and `constraining()`, the matcher whose mask applies to
the next token: None while the sequence is not out, so that row carries no bitmask. Rejected
speculative drafts roll back across the sequence too: a rollback to before it makes the grammar
wait again. The sequence is matched on token ids, so a front end gives it as the tokenizer
writes it (a reasoning model's end tag is one added token). Engine thread only; no jax.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxserve.structured.matcher import CompiledGrammar, GrammarMatcher


def request_matcher(compiled: CompiledGrammar,
                    after: Sequence[int] = ()) -> GrammarMatcher | DeferredMatcher:
    """A new request's matcher: the grammar's own, or (after: a token sequence) one that
    starts once that sequence is out."""
    matcher = compiled.new_matcher()
    return DeferredMatcher(matcher, after) if after else matcher


class DeferredMatcher:
    """A GrammarMatcher that constrains the output only after `after` (non-empty) is out."""

    def __init__(self, matcher: GrammarMatcher, after: Sequence[int]):
        if not after:
            raise ValueError("DeferredMatcher needs a non-empty token sequence to start after")
        self.matcher = matcher
        self.after = [int(t) for t in after]
        self.num_words = matcher.num_words
        self._tokens: list[int] = []       # every token accepted (before the start too)
        self._start: int | None = None     # index in _tokens of the grammar's first token

    def constraining(self) -> GrammarMatcher | None:
        """The matcher whose mask applies to the next token; None: no mask yet."""
        return self.matcher if self._start is not None else None

    def _start_in(self, tokens: list[int]) -> int | None:
        """Where in `tokens` (following those accepted) the grammar starts: just past the
        first occurrence of `after` that they complete; None when they complete none."""
        k = len(self.after)
        held = self._tokens[max(0, len(self._tokens) - k + 1):] if k > 1 else []
        seq = held + tokens
        for end in range(max(k, len(held) + 1), len(seq) + 1):
            if seq[end - k:end] == self.after:
                return end - len(held)
        return None

    # ---- tokens --------------------------------------------------------------------------------
    def num_valid(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` would be accepted (no state change): all of those up to
        the end of the sequence, then as many as the grammar takes."""
        tokens = [int(t) for t in tokens]
        if self._start is not None:
            return self.matcher.num_valid(tokens)
        at = self._start_in(tokens)
        if at is None:
            return len(tokens)
        return at + self.matcher.num_valid(tokens[at:])

    def accept(self, tokens: Sequence[int]) -> bool:
        """Advance over all of `tokens` when every one is accepted (the grammar's part by the
        grammar); otherwise change nothing and return False."""
        tokens = [int(t) for t in tokens]
        if self._start is not None:
            if not self.matcher.accept(tokens):
                return False
        else:
            at = self._start_in(tokens)
            if at is not None:
                if not self.matcher.accept(tokens[at:]):
                    return False
                self._start = len(self._tokens) + at
        self._tokens.extend(tokens)
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (rejected speculative drafts)."""
        if num_tokens < 0 or num_tokens > len(self._tokens):
            raise ValueError(f"can't roll back {num_tokens} tokens: {len(self._tokens)} "
                             "accepted")
        keep = len(self._tokens) - num_tokens
        if self._start is not None:
            self.matcher.rollback(len(self._tokens) - max(keep, self._start))
            if keep < self._start:
                self._start = None
        del self._tokens[keep:]

    # ---- state and masks -------------------------------------------------------------------------
    def is_terminated(self) -> bool:
        return self._start is not None and self.matcher.is_terminated()

    def is_accepting(self) -> bool:
        return self._start is not None and self.matcher.is_accepting()

    def is_stopped(self) -> bool:
        return self._start is not None and self.matcher.is_stopped()

    def error(self) -> str | None:
        return self.matcher.error()

    def fill_bitmask(self, out_row: np.ndarray) -> None:
        """The next token's allowed set: the grammar's, or every token before the start."""
        if self._start is not None:
            self.matcher.fill_bitmask(out_row)
        else:
            out_row[:] = -1
