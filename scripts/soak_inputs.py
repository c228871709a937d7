"""Invalid requests for the soak (scripts/soak.py), drawn by hypothesis: each one is certain to be
refused, by construction, so the server must answer INVALID_ARGUMENT (or RESOURCE_EXHAUSTED for
a size the KV pool can never hold) and never INTERNAL or UNKNOWN.

Three families: a sampling field outside its documented range (protos/jaxserve.proto) on a good
prompt; a bad prompt (empty, unset, ids outside the vocabulary, longer than max_model_len, an
empty chat); and bytes that are not a GenerateRequest at all (a string field holding invalid
UTF-8, a length-delimited field running past the end). `draw(seed, count, ...)` returns
(label, payload) pairs; a payload is a GenerateRequest, or bytes for the wire family. No server
calls here.
"""

from __future__ import annotations

import math

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from jaxserve.entrypoints.grpc.pb import jaxserve_pb2 as pb

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def _outside(low: float, high: float, low_open: bool = False):
    """Floats (NaN and infinities included) outside [low, high] ((low, high] if low_open)."""
    def valid(v: float) -> bool:
        return math.isfinite(v) and (low < v if low_open else low <= v) and v <= high
    return st.floats(width=64).filter(lambda v: not valid(v))


def _bad_sampling(max_model_len: int):
    ints = st.integers
    fields = {
        "temperature": st.floats(max_value=-1e-9) | st.just(math.nan) | st.just(math.inf),
        "top_k": ints(INT32_MIN, -1),
        "top_p": _outside(0.0, 1.0, low_open=True),
        "min_p": _outside(0.0, 1.0),
        "max_tokens": ints(INT32_MIN, 0) | ints(max_model_len + 1, INT32_MAX),
        "seed": ints(-(2**63), -1) | ints(2**32, 2**63 - 1),
        "top_logprobs": ints(21, INT32_MAX),
        "presence_penalty": _outside(-2.0, 2.0),
        "frequency_penalty": _outside(-2.0, 2.0),
        "repetition_penalty": _outside(0.0, 10.0, low_open=True),
        "n": ints(INT32_MIN, 0) | ints(65, INT32_MAX),
        "prompt_logprobs": ints(21, INT32_MAX) | ints(INT32_MIN, -1),
        "stop": st.lists(st.text(min_size=1, max_size=4), max_size=2).map(lambda s: s + [""]),
    }
    return st.sampled_from(sorted(fields)).flatmap(
        lambda name: fields[name].map(lambda v: (name, v)))


def _sampling(name: str, value) -> pb.SamplingParams:
    msg = pb.SamplingParams(max_tokens=4, temperature=0.0)
    if name == "stop":
        msg.stop.extend(value)
    else:
        setattr(msg, name, value)
    return msg


def _bad_prompt(vocab_size: int, max_model_len: int):
    good = st.lists(st.integers(3, vocab_size - 1), min_size=1, max_size=6)
    outside = st.integers(INT32_MIN, -1) | st.integers(vocab_size, INT32_MAX)
    with_bad_id = st.tuples(good, outside, st.integers(0, 6)).map(
        lambda t: t[0][:t[2]] + [t[1]] + t[0][t[2]:])
    return st.one_of(
        st.just(("empty text", "text", "")),
        st.just(("empty token ids", "token_ids", [])),
        st.just(("no prompt", None, None)),
        st.just(("empty chat", "chat", [])),
        with_bad_id.map(lambda ids: ("token id outside the vocabulary", "token_ids", ids)),
        st.integers(max_model_len + 1, 2 * max_model_len).map(
            lambda n: ("prompt over max_model_len", "token_ids", [5] * n)),
    )


def _request(prompt_kind: str | None, value, sampling: pb.SamplingParams) -> pb.GenerateRequest:
    request = pb.GenerateRequest(sampling=sampling)
    if prompt_kind == "text":
        request.text = value
    elif prompt_kind == "token_ids":
        request.token_ids.SetInParent()
        request.token_ids.ids.extend(value)
    elif prompt_kind == "chat":
        request.chat.SetInParent()
    return request


def _wire():
    """Bytes that no GenerateRequest decodes from."""
    text = st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=12)
    bad_utf8 = st.tuples(text, st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80"])).map(
        lambda t: ("invalid UTF-8 in text",
                   _text_field(t[0].encode()[:1] + t[1] + t[0].encode()[1:])))
    overrun = st.tuples(text, st.integers(1, 100)).map(
        lambda t: ("truncated message", _text_field(t[0].encode())[:-1]
                   if t[1] % 2 else _text_field(t[0].encode()) + b"\x12" + bytes([t[1] + 1])))
    return bad_utf8 | overrun


def _text_field(data: bytes) -> bytes:
    """GenerateRequest.text (field 2, length-delimited) holding these bytes (under 128)."""
    return b"\x12" + bytes([len(data)]) + data


def invalid_case(vocab_size: int, max_model_len: int):
    """One (label, payload): a GenerateRequest or bytes, certain to be refused."""
    good_prompt = st.lists(st.integers(3, vocab_size - 1), min_size=1, max_size=6)
    sampling_case = st.tuples(good_prompt, _bad_sampling(max_model_len)).map(
        lambda t: (f"sampling.{t[1][0]} out of range",
                   _request("token_ids", t[0], _sampling(*t[1]))))
    prompt_case = _bad_prompt(vocab_size, max_model_len).map(
        lambda t: (t[0], _request(t[1], t[2], pb.SamplingParams(max_tokens=4))))
    return st.one_of(sampling_case, prompt_case, _wire())


def draw(seed: int, count: int, vocab_size: int, max_model_len: int) -> list[tuple[str, object]]:
    """count invalid cases, reproducible for a seed (hypothesis' generate phase only)."""
    cases: list = []

    @hypothesis_seed(seed)
    @settings(max_examples=count, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(invalid_case(vocab_size, max_model_len))
    def collect(case):
        cases.append(case)

    while len(cases) < count:
        before = len(cases)
        collect()
        if len(cases) == before:
            break
    return cases[:count]
