"""Incremental detokenization and stop-string matching for one request's output stream.

Text deltas are UTF-8 safe across token boundaries: a token that ends inside a multi-byte
character is held back until the character completes. Text that could still be the start of
a stop string is held back too, so a stop string is never emitted (unless
include_stop_str_in_output). Pure host code; no jax.
"""

from __future__ import annotations

from typing import Callable

from jaxserve.model.text.byte_level import ByteStream, ByteTable

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 6  # tokens decoded before the new ones, so merges and spaces come out right


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...] = (), *,
                 include_stop_str: bool = False, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop_str = include_stop_str
        self.skip_special_tokens = skip_special_tokens
        context = [int(t) for t in prompt_token_ids[-_CONTEXT_TOKENS:]]
        # A Hugging Face `tokenizers` backend decodes one step per token with its own stream
        # decoder (it holds back incomplete characters itself); other tokenizers re-decode a
        # few tokens of context per token.
        # A byte-level BPE tokenizer streams by table (byte_level.py), cheaper still.
        backend = getattr(tokenizer, "backend", None)
        table = ByteTable.of(tokenizer)
        self._bytes = None if table is None else ByteStream(table, context,
                                                            skip_special_tokens)
        self._stream = None if self._bytes or DecodeStream is None or backend is None else (
            backend, DecodeStream(context, skip_special_tokens))
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # Text decoded and not handed out yet. A stop string never starts in text already
        # handed out (take_delta holds back any tail that could begin one), so only this is
        # searched, and the history is never re-copied per token.
        self._pending = ""
        self.stopped = False

    def add_tokens(self, token_ids) -> int:
        """Decode token_ids; returns how many were taken: all, or up to the one that completed
        a stop string (the rest are not part of the output)."""
        step = self._bytes.step if self._bytes is not None else self._step
        for num_taken, token_id in enumerate(token_ids):
            if self.stopped:
                return num_taken
            piece = step(int(token_id))
            if piece:
                self._pending += piece
                if self.stop:
                    self._check_stop()
        return len(token_ids)

    def feed(self, token_ids, final: bool) -> tuple[int, str]:
        """add_tokens then take_delta(final), in one call: (tokens taken, the text to hand out).
        The usual decode (one token, a byte table, no stop strings) is one table lookup."""
        if len(token_ids) == 1 and self._bytes is not None and not self.stop:
            piece = self._bytes.step(int(token_ids[0]))
            if self._pending:  # (only a stop string ever holds text back)
                piece, self._pending = self._pending + piece, ""
            return 1, piece
        return self.add_tokens(token_ids), self.take_delta(final)

    @property
    def one_token_step(self) -> Callable[[int], str] | None:
        """feed() of one token that ends nothing, as one call (the text it completes): a byte
        table's step when there are no stop strings (nothing is ever held back); else None."""
        return self._bytes.step if self._bytes is not None and not self.stop else None

    def _step(self, token_id: int) -> str | None:
        """The text token_id completes (None or "": nothing yet), without a byte table."""
        if self._stream is not None:
            backend, stream = self._stream
            return stream.step(backend, token_id)
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if full.endswith(_REPLACEMENT) or len(full) <= len(prefix):
            return None  # an incomplete character: wait for the next token
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix):]

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _check_stop(self) -> None:
        pending = self._pending
        hits = [(i, s) for i, s in ((pending.find(s), s) for s in self.stop) if i >= 0]
        if hits:
            start, stop = min(hits)
            self._pending = pending[:start + len(stop) if self.include_stop_str else start]
            self.stopped = True

    def take_delta(self, final: bool = False) -> str:
        """New text since the last call; holds back a possible stop-string prefix unless final."""
        delta = self._pending
        if self.stop and not final and not self.stopped:
            held = self._held_back(delta)
            if held:
                self._pending = delta[len(delta) - held:]
                return delta[:len(delta) - held]
        self._pending = ""
        return delta

    def _held_back(self, text: str) -> int:
        """Length of the longest tail of text that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
