"""Streaming detokenization by byte table (jaxserve/model/text/byte_level.py) against `tokenizers`
itself:
the same text, delta by delta, as its DecodeStream for byte-level BPE tokenizers; no table
(DecodeStream kept) for any other decoder."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models
from tokenizers.decoders import DecodeStream

from jaxserve.model.text.byte_level import ByteStream, ByteTable
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from model_fixtures import real_default_model, tiny_tokenizer

TEXTS = ["plain ascii words", "café naïve façade", "漢字とかな", "emoji 🙂👍🏽 mixed", "a\n\tb  c",
         "ß∑∂ƒ©˙∆˚¬…æ", "<|im_end|> inside text"]


@pytest.fixture(scope="module", params=["default", "tiny"])
def tokenizer(request):
    return real_default_model().tokenizer if request.param == "default" else tiny_tokenizer()


def _streams(backend, table, ids, skip):
    ours, theirs = ByteStream(table, [], skip), DecodeStream([], skip)
    return [ours.step(i) for i in ids], [theirs.step(backend, i) or "" for i in ids]


@pytest.mark.parametrize("skip", [True, False])
def test_deltas_match_decode_stream(tokenizer, skip):
    backend, table = tokenizer.backend, ByteTable.of(tokenizer)
    assert table is not None, "a ByteLevel decoder gets a table"
    for text in TEXTS:
        ids = backend.encode(text, add_special_tokens=False).ids
        ours, theirs = _streams(backend, table, ids, skip)
        assert "".join(ours) == "".join(theirs) == backend.decode(ids, skip_special_tokens=skip)
        # Delta by delta: each completed character comes out at the token that completes it.
        assert [len("".join(ours[:k])) for k in range(len(ids))] == \
            [len("".join(theirs[:k])) for k in range(len(ids))]


def test_random_ids_match_full_decode(tokenizer):
    """Random ids (invalid UTF-8 among them): the stream is the full decode, less at most an
    incomplete character still held back at the end."""
    backend, table = tokenizer.backend, ByteTable.of(tokenizer)
    rng, size = random.Random(0), backend.get_vocab_size(with_added_tokens=True)
    for _ in range(300):
        ids = [rng.randrange(size) for _ in range(rng.randrange(1, 10))]
        ours, theirs = _streams(backend, table, ids, True)
        full = backend.decode(ids, skip_special_tokens=True)
        assert full.startswith("".join(ours)) and set(full[len("".join(ours)):]) <= {"\ufffd"}
        assert "".join(ours).startswith("".join(theirs).rstrip("\ufffd"))


def test_special_tokens_skipped_on_request(tokenizer):
    backend, table = tokenizer.backend, ByteTable.of(tokenizer)
    special = min(table.special)
    ids = backend.encode("hi", add_special_tokens=False).ids + [special]
    assert "".join(ByteStream(table, [], True).step(i) for i in ids) == "hi"
    assert "".join(ByteStream(table, [], False).step(i) for i in ids) == \
        "hi" + backend.id_to_token(special)
    past_vocabulary = len(table.token_bytes)
    assert ByteStream(table, [], True).step(past_vocabulary) == ""


def test_other_decoders_keep_decode_stream():
    vocab = {"▁hello": 0, "▁world": 1, "[UNK]": 2}
    backend = Backend(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.decoder = decoders.Metaspace()

    class Wrapped:
        pass

    tok = Wrapped()
    tok.backend = backend
    assert ByteTable.of(tok) is None
    detok = IncrementalDetokenizer(tok, [0], ())
    assert detok._bytes is None and detok._stream is not None
    detok.add_tokens([1])
    assert detok.take_delta(final=True) == " world"


def test_detokenizer_uses_the_table_and_holds_stop_prefixes():
    tok = real_default_model().tokenizer
    ids = tok.backend.encode(" the sun in the sky", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tok, [], ("in the s",))
    assert detok._bytes is not None and detok._stream is None
    deltas = []
    for i in ids:
        detok.add_tokens([i])
        deltas.append(detok.take_delta())
    assert detok.stopped and "".join(deltas) == " the sun "


def test_output_processor_one_token_path_hands_out_what_the_general_path_does(tokenizer):
    """The usual decode event (one token, no finish, plain sampling) skips _apply's checks
    (OutputProcessor, _Sample.step): every output field, step by step, equals the general
    path's for the same events, through multi-byte characters and special tokens."""
    from jaxserve.engine.output_processor import OutputProcessor
    from jaxserve.core.request import FinishReason, Request, SamplingParams, TokenEvent

    ids = [i for text in TEXTS for i in tokenizer.backend.encode(
        text, add_special_tokens=False).ids]
    params = SamplingParams(max_tokens=len(ids), temperature=0.0)
    processor = OutputProcessor(tokenizer)
    for name in ("fast", "general"):
        processor.add([Request(name, [5, 6], params, 0)])
    processor._samples["general"].plain = None
    fast_sample = processor._samples["fast"]
    assert fast_sample.plain is not None and fast_sample.step is None  # (before its first token)
    for n, token in enumerate(ids):
        reason = FinishReason.LENGTH if n == len(ids) - 1 else None
        fast, general = processor.process(
            [TokenEvent(name, (token,), (-0.25 * n,), reason) for name in ("fast", "general")],
            None)
        assert fast_sample.step is not None  # the short path from the second token on
        a, b = fast.outputs[0], general.outputs[0]
        for field in ("new_token_ids", "new_text", "new_logprobs", "new_top_logprobs",
                      "token_ids", "text", "logprobs", "cumulative_logprob", "finish_reason"):
            assert getattr(a, field) == getattr(b, field), (n, field)
        assert (fast.finished, fast.time_to_first_token is None) == (
            general.finished, general.time_to_first_token is None)
    assert fast.finished and fast.outputs[0].text == tokenizer.backend.decode(ids)
