"""A constrained request whose own token bans (bad_words, min_tokens, allowed_token_ids) leave
its grammar no next token asks for the impossible: it ends with finish reason "error" and an
error naming the field at fault (RequestOutput.error_field) and the output constraint; the
front ends answer it as bad input (gRPC INVALID_ARGUMENT here, HTTP 400 in
test_http_structured.py). The engine goes on: the request's neighbours finish as they would,
no KV page leaks, the next request is served; bans that leave a token end nothing.

The Python API runs LLM over the tiny random Llama with a byte-level BPE vocabulary
(tests/model_fixtures.py); gRPC an in-process server around an engine over the same model.
"""

from __future__ import annotations

import grpc
import pytest

from jaxserve import SamplingParams
from test_engine import assert_idle_and_no_leak
from test_structured_engine import tiny_llm

X_ONLY = {"choice": ["x"]}  # the grammar allows the token "x", then only EOS


@pytest.fixture(scope="module")
def llm():
    return tiny_llm()


def generate(llm, params: list[SamplingParams]):
    return llm.generate([[5, 6, 7]] * len(params), params, use_tqdm=False)


def assert_bad_input(out, field: str) -> None:
    assert out.finish_reason == "error", f"finished by {out.finish_reason!r}: {out.text!r}"
    assert out.error_field == field, f"error_field {out.error_field!r}, not {field!r}"
    assert field in out.error and "structured_outputs" in out.error, (
        f"the error names neither {field} nor the constraint: {out.error!r}")


def test_bad_words_banning_every_token_the_grammar_allows_end_the_request_as_bad_input(llm):
    banned, constrained, plain = generate(llm, [
        SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=X_ONLY,
                       bad_words=["x"]),
        SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=X_ONLY),
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)])
    assert_bad_input(banned, "bad_words")
    assert banned.token_ids == [], "no token may be sampled from an all-banned row"
    assert (constrained.finish_reason, constrained.text) == ("stop", "x"), constrained
    assert (plain.finish_reason, len(plain.token_ids)) == ("length", 8), plain
    assert_idle_and_no_leak(llm)


def test_the_engine_serves_the_next_request_after_a_dead_end(llm):
    generate(llm, [SamplingParams(max_tokens=8, structured_outputs=X_ONLY, bad_words=["x"])])
    out = generate(llm, [SamplingParams(max_tokens=8, temperature=0.0,
                                        structured_outputs=X_ONLY)])[0]
    assert (out.finish_reason, out.text, out.error) == ("stop", "x", None), out
    assert_idle_and_no_leak(llm)


def test_min_tokens_past_the_grammars_end_is_bad_input_naming_min_tokens(llm):
    out = generate(llm, [SamplingParams(max_tokens=8, temperature=0.0, min_tokens=3,
                                        structured_outputs=X_ONLY)])[0]
    assert_bad_input(out, "min_tokens")
    assert out.text == "x", f"the tokens before the dead end are kept: {out.text!r}"
    assert_idle_and_no_leak(llm)


def test_allowed_token_ids_outside_the_grammar_are_bad_input_naming_them(llm):
    eos = llm.tokenizer.eos_token_ids[0]
    out = generate(llm, [SamplingParams(max_tokens=8, temperature=0.0, allowed_token_ids=[eos],
                                        structured_outputs=X_ONLY)])[0]
    assert_bad_input(out, "allowed_token_ids")


def test_bans_that_leave_the_grammar_a_token_end_nothing(llm):
    out = generate(llm, [SamplingParams(max_tokens=8, temperature=0.0, bad_words=["x"],
                                        structured_outputs={"choice": ["x", "yy"]})])[0]
    assert (out.finish_reason, out.text, out.error) == ("stop", "yy", None), out


@pytest.fixture(scope="module")
def grpc_served():
    from grpc_fixtures import serve
    from http_server_main import fixtures_loaded

    yield from serve(fixtures_loaded())


def test_grpc_answers_a_dead_end_invalid_argument_and_serves_the_next(grpc_served):
    from grpc_fixtures import wait_until_idle

    from jaxserve.entrypoints.grpc.client import JaxServeError

    engine, client = grpc_served.engine, grpc_served.client
    with pytest.raises(JaxServeError) as error:
        client.generate_text([5, 6, 7], SamplingParams(max_tokens=8, structured_outputs=X_ONLY,
                                                       bad_words=["x"]))
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT, error.value
    assert "bad_words" in error.value.details and "structured_outputs" in error.value.details, (
        error.value.details)
    result = client.generate_text([5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0,
                                                            structured_outputs=X_ONLY))
    assert result.text == "x", result
    wait_until_idle(engine)
