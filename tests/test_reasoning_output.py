"""The pieces of --reasoning-parser below the servers: the flag (an unknown parser refused before
the model loads, listing the choices), where a request's constraint starts (after </think>;
from the first token when the request turns thinking off or the prompt closed the section),
the whole-reply and per-step splits (tokens of steps that decided nothing held for the next
delta) and SamplingParams.structured_outputs_after's checks. The servers themselves:
test_http_reasoning.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from reasoning_fixtures import think_ids, think_tokenizer

from jaxserve.config.reasoning import REASONING_PARSER_NAMES
from jaxserve.core import intake
from jaxserve.core.errors import RequestError
from jaxserve.core.request import SamplingParams
from jaxserve.entrypoints.openai.reasoning import ReasoningFormat, StepSplitter
from jaxserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from jaxserve.structured.params import StructuredOutputs

JSON = StructuredOutputs(json_object=True)


@pytest.fixture(scope="module")
def tokenizer():
    return think_tokenizer()


@pytest.fixture(scope="module")
def tags(tokenizer):
    return think_ids(tokenizer)


def prompt(tokenizer, generation_prompt: str) -> list[int]:
    return tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
                            + generation_prompt, add_special_tokens=False)


def sample(text: str, ids: list[int], index: int = 0):
    return SimpleNamespace(index=index, new_text=text, new_token_ids=ids,
                           new_logprobs=[-1.0] * len(ids), new_top_logprobs=[])


def test_the_flag_refuses_an_unknown_parser_listing_the_choices(capsys):
    from jaxserve.entrypoints.cli import main

    assert main(["serve", "--reasoning-parser", "deepseek", "--http-port", "0"]) == 2
    err = capsys.readouterr().err
    assert "--reasoning-parser 'deepseek' is unknown" in err and "deepseek_r1, qwen3" in err, err


def test_the_flag_help_names_every_registered_parser():
    assert set(REASONING_PARSER_NAMES) == set(REASONING_PARSERS)


def test_a_server_without_a_parser_has_no_format_and_an_unknown_one_is_refused(tokenizer):
    assert ReasoningFormat.load(None, tokenizer) is None
    with pytest.raises(ValueError, match="choose one of deepseek_r1, qwen3"):
        ReasoningFormat.load("r1", tokenizer)


def test_the_constraint_starts_after_the_end_tag_while_the_prompt_leaves_reasoning_open(
        tokenizer, tags):
    fmt = ReasoningFormat.load("deepseek_r1", tokenizer)
    assert (fmt.start_ids, fmt.end_ids) == ((tags[0],), (tags[1],))
    request = fmt.for_request(prompt(tokenizer, "<think>\n"), None)
    assert not request.starts_in_content
    assert request.constrain(SamplingParams(structured_outputs=JSON)).structured_outputs_after \
        == (tags[1],)
    unconstrained = SamplingParams()
    assert request.constrain(unconstrained) is unconstrained
    # a template that opens nothing: the reply may still open <think> and close it
    assert not fmt.for_request(prompt(tokenizer, ""), None).starts_in_content
    # an earlier turn's closed section does not close the one the prompt opens now
    history = tokenizer.encode("<think>a</think>b", add_special_tokens=False)
    assert not fmt.for_request(history + prompt(tokenizer, "<think>\n"), None).starts_in_content


@pytest.mark.parametrize("name,generation_prompt,kwargs", [
    ("deepseek_r1", "<think>\n\n</think>\n\n", None),  # the template closed the section
    ("qwen3", "<think>\n\n</think>\n\n", {"enable_thinking": False}),
    ("qwen3", "", {"enable_thinking": False}),  # thinking off, whatever the template wrote
])
def test_the_reply_is_content_from_its_start_when_thinking_is_off_or_closed(
        tokenizer, name, generation_prompt, kwargs):
    request = ReasoningFormat.load(name, tokenizer).for_request(
        prompt(tokenizer, generation_prompt), kwargs)
    assert request.starts_in_content
    params = SamplingParams(structured_outputs=JSON)
    assert request.constrain(params).structured_outputs_after == ()
    assert request.message("a</think>b") == {"content": "a</think>b", "reasoning_content": None}


def test_a_whole_reply_splits_and_include_reasoning_false_drops_the_reasoning(tokenizer):
    fmt = ReasoningFormat.load("deepseek_r1", tokenizer)
    ids = prompt(tokenizer, "<think>\n")
    assert fmt.for_request(ids, None).message("why\n</think>\n\nso") == {
        "content": "so", "reasoning_content": "why"}
    assert fmt.for_request(ids, None, include_reasoning=False).message("why</think>so") == {
        "content": "so", "reasoning_content": None}
    assert fmt.for_request(ids, None).message("") == {"content": None,
                                                      "reasoning_content": None}


def test_step_splitter_splits_each_steps_text(tokenizer):
    request = ReasoningFormat.load("qwen3", tokenizer).for_request(prompt(tokenizer, ""), None)
    splitter = StepSplitter(request, n=1)
    pieces = ["<thi", "nk>a", "b</think>", "\n\nc", ""]
    got = [splitter.split(0, p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
    assert got == [("", ""), ("a", ""), ("b", ""), ("", "c"), ("", "")], got


def test_structured_outputs_after_needs_a_constraint_and_ids_in_the_vocabulary():
    with pytest.raises(RequestError, match="structured_outputs_after") as info:
        SamplingParams(structured_outputs_after=(5,))
    assert info.value.field == "structured_outputs_after"
    with pytest.raises(RequestError, match="structured_outputs_after"):
        SamplingParams(structured_outputs=JSON, structured_outputs_after=(-1,))
    limits = intake.RequestLimits(max_model_len=64, vocab_size=100, page_size=16, num_pages=8)
    with pytest.raises(RequestError, match=r"structured_outputs_after contains token id 100"):
        intake.check_sampling(limits, SamplingParams(structured_outputs=JSON,
                                                     structured_outputs_after=[100]))
    intake.check_sampling(limits, SamplingParams(structured_outputs=JSON,
                                                 structured_outputs_after=[99]))


def test_a_start_the_caller_gave_is_kept(tokenizer, tags):
    request = ReasoningFormat.load("deepseek_r1", tokenizer).for_request(
        prompt(tokenizer, "<think>\n"), None)
    own = SamplingParams(structured_outputs=JSON, structured_outputs_after=(5, 6))
    assert request.constrain(own) is own


def test_structured_outputs_after_crosses_the_grpc_wire():
    from jaxserve.entrypoints.grpc import convert

    deferred = SamplingParams(structured_outputs=JSON, structured_outputs_after=(7, 8))
    assert convert.sampling_from_proto(convert.sampling_to_proto(deferred)) == deferred
