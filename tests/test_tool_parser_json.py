"""The incremental JSON reader behind every JSON tool-call format: whatever the layout the model
writes (spaces, newlines, ASCII escapes) and however the text is cut, it writes the canonical
serialization, json.dumps(value, ensure_ascii=False); it rejects what json.loads rejects, and
stops exactly at the end of the value."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.entrypoints.openai.tool_parsers.envelope import EnvelopeReader
from jaxserve.entrypoints.openai.tool_parsers.json_stream import (JsonValueReader, dump_json,
                                                                  escape_json_char)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**30, 10**30)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4),
    max_leaves=12)


def read(pieces: list[str]) -> tuple[str, JsonValueReader]:
    reader, out = JsonValueReader(), []
    for piece in pieces:
        consumed = reader.feed(piece)
        out.append(reader.take())
        assert reader.error is None, reader.error
        assert consumed == len(piece) or reader.done
    reader.finish()
    return "".join(out) + reader.take(), reader


@settings(max_examples=300, deadline=None)
@given(value=json_values, ensure_ascii=st.booleans(), indent=st.sampled_from([None, 2]),
       compact=st.booleans(), seed=st.integers(0, 2**16))
def test_any_layout_cut_anywhere_reads_as_the_canonical_text(value, ensure_ascii, indent,
                                                             compact, seed):
    text = json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=(",", ":") if compact else None)
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    out, reader = read(pieces)
    assert reader.done, f"{text!r} did not complete"
    assert out == dump_json(value)


def test_canonical_text_is_json_dumps_of_the_parsed_value():
    text = '{ "b" : [1.50, 1E2, -0, 10000000000000000000000, "\\u00e9\\/"],\n"a":{}}'
    out, _ = read([text])
    assert out == json.dumps(json.loads(text), ensure_ascii=False)


def test_each_character_escapes_as_json_dumps_does():
    for code in range(0x10000):
        ch = chr(code)
        if not 0xD800 <= code < 0xE000:
            assert escape_json_char(ch) == json.dumps(ch, ensure_ascii=False)[1:-1], hex(code)


def test_lone_surrogates_come_out_escaped_so_the_text_encodes_to_utf8():
    out, _ = read(['"\\ud83d x \\ude00 \\ud83d\\ude00"'])
    assert out == '"\\ud83d x \\ude00 😀"'
    out.encode("utf-8")


def test_raw_control_characters_in_strings_are_accepted_and_escaped():
    out, _ = read(['{"code": "a\n\tb"}'])
    assert out == '{"code": "a\\n\\tb"}'


@pytest.mark.parametrize("text", ['{"a" 1}', '{"a":}', "[1,]", "{,}", '{"a":1,}', "tru ", "nul]",
                                  "01", "1.", "-", "1e", '"\\x"', '"\\u12G4"', "[1 2]", "{1: 2}",
                                  "[}", "{]", "'a'", "+1"])
def test_what_json_rejects_is_an_error(text):
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    reader = JsonValueReader()
    reader.feed(text + " ")
    reader.finish()
    assert reader.error is not None and not reader.done, f"{text!r} was accepted"


def test_the_reader_stops_right_after_the_value():
    for text, end in (('{"a": [1]} tail', 10), ('"x"y', 3), ("true,", 4), ("12 ", 2),
                      ("[]]", 2)):
        reader = JsonValueReader()
        assert reader.feed(text) == end and reader.done, text
    reader = JsonValueReader()
    assert reader.feed("12") == 2 and not reader.done, "a number ends only at what follows it"
    reader.finish()
    assert reader.done and reader.take() == "12"


def test_a_value_cut_short_is_a_prefix_and_never_closed():
    reader = JsonValueReader()
    reader.feed('{"a": [1, 2.5, "x\\u00')
    reader.finish()
    assert not reader.done and reader.error is None
    assert reader.take() == '{"a": [1, 2.5, "x'


def test_envelope_reads_name_and_arguments_and_skips_other_keys():
    envelope = EnvelopeReader()
    text = '{"id": {"deep": [1]}, "arguments": {"x": "{"}, "name": "f"} tail'
    assert envelope.feed(text) == len(text) - len(" tail")
    assert envelope.done and envelope.name == "f" and envelope.arguments_done
    assert envelope.take_arguments() == '{"x": "{"}'


@pytest.mark.parametrize("text,why", [('{"name": 3}', "not a string"),
                                      ('{"name": ""}', "empty"),
                                      ('{"name": "a", "name": "b"}', "repeated"),
                                      ('{"parameters": {}, "arguments": {}}', "repeated"),
                                      ('{"nam": "a"}', "unexpected key")])
def test_envelope_errors(text, why):
    envelope = EnvelopeReader(arguments_keys=("parameters", "arguments"), other_keys=False)
    envelope.feed(text)
    assert envelope.error is not None and why in envelope.error, envelope.error
