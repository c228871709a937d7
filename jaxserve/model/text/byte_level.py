"""Streaming detokenization for byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, SmolLM) by table.

Such a tokenizer's decoder is `ByteLevel` alone: a token's text is a fixed byte string (its
characters mapped back through GPT-2's byte <-> unicode table; an added token's own text), and
decoding a sequence is UTF-8 decoding the concatenated bytes. So a stream needs no tokenizer
call per token: one table lookup and Python's incremental UTF-8 decoder (which holds back an
incomplete character, as `tokenizers.decoders.DecodeStream` does), about a tenth of its cost.
The table is built once per tokenizer and checked against the tokenizer's own decode on a
spread of ids; any other decoder, or a failed check, means None and the caller keeps
DecodeStream. Pure host code: no jax, no requests, no stop strings.
"""

from __future__ import annotations

import codecs
import json

_CHECK_STRIDE = 61  # every 61st vocabulary id (and every added token) is checked at build


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character (the byte-level BPE alphabet)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def _token_bytes(token: str, decoder: dict[str, int]) -> bytes:
    """As tokenizers' ByteLevel decoder: each character's byte, or (a character outside the
    table: an added token's own text) the token's UTF-8."""
    try:
        return bytes(decoder[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


class ByteTable:
    """Each token id's bytes, its text where those bytes are whole characters on their own
    (None: part of a character), and the ids of special tokens (skipped on request)."""

    def __init__(self, token_bytes: list[bytes], special: frozenset[int]):
        self.token_bytes = token_bytes
        self.special = special
        self.token_text = [_whole_text(b) for b in token_bytes]

    @classmethod
    def of(cls, tokenizer) -> "ByteTable | None":
        """The table of a jaxserve Tokenizer (built once, kept on it); None when its decoder is
        not ByteLevel alone or the check fails."""
        cached = getattr(tokenizer, "_byte_table", False)
        if cached is False:
            backend = getattr(tokenizer, "backend", None)
            cached = None if backend is None else cls.build(backend)
            try:
                tokenizer._byte_table = cached
            except AttributeError:  # an object that takes no attributes: build each time
                pass
        return cached

    @classmethod
    def build(cls, backend) -> "ByteTable | None":
        try:
            spec = json.loads(backend.to_str())
        except Exception:  # a backend that cannot serialize itself: no fast path
            return None
        decoder = spec.get("decoder") or {}
        if decoder.get("type") != "ByteLevel":
            return None
        chars = {c: b for b, c in bytes_to_unicode().items()}
        size = backend.get_vocab_size(with_added_tokens=True)
        table = []
        for i in range(size):
            token = backend.id_to_token(i)
            table.append(b"" if token is None else _token_bytes(token, chars))
        added = backend.get_added_tokens_decoder()
        special = frozenset(i for i, t in added.items() if t.special)
        result = cls(table, special)
        checked = sorted(set(range(0, size, _CHECK_STRIDE)) | set(added))
        for i in checked:
            if i < size and (backend.decode([i], skip_special_tokens=False)
                             != table[i].decode("utf-8", "replace")):
                return None
        return result


def _whole_text(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


class ByteStream:
    """One output stream: token ids in, the text each completes out. A token whose bytes are
    whole characters, with nothing held back before it, is one table lookup; the rest goes
    through the incremental UTF-8 decoder."""

    __slots__ = ("_bytes", "_text", "_skip", "_decoder", "_partial")

    def __init__(self, table: ByteTable, context: list[int], skip_special_tokens: bool):
        self._bytes, self._text = table.token_bytes, table.token_text
        self._skip = table.special if skip_special_tokens else frozenset()
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._partial = False  # the decoder holds part of a character
        for token_id in context:  # a prompt ending inside a character completes it here
            self.step(token_id)

    def step(self, token_id: int) -> str:
        if token_id in self._skip or not 0 <= token_id < len(self._bytes):
            return ""
        if not self._partial:
            text = self._text[token_id]
            if text is not None:
                return text
        text = self._decoder.decode(self._bytes[token_id])
        self._partial = bool(self._decoder.getstate()[0])
        return text
