"""Structured output and prompt logprobs over the OpenAI HTTP API: a real `run_server` process
(tests/http_server_main.py --model fixtures: model_fixtures' random Llama over a byte-level BPE
vocabulary the grammar compiler accepts) and the official openai client.

response_format json_schema gives every choice JSON that validates (n=2, streamed and not);
json_object gives a JSON object; vLLM's guided_regex / guided_choice / structured_outputs match;
two constraints at once, or an invalid schema / regex, are a 400 naming the field, and so are
bad_words that ban every token the grammar allows (the server then serves the next); vLLM's
prompt_logprobs equal the offline LLM's. Every KV page is free afterwards.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

KEY = "sk-test"
MODEL = "tiny"  # model_fixtures.random_model's name
ALL_PAGES = 47  # SMALL_ENGINE's 48, less the reserved page 0
SCHEMA = {"type": "object", "properties": {"b": {"enum": ["x", "yy"]},
                                           "n": {"type": "integer", "minimum": 0,
                                                 "maximum": 99}},
          "required": ["b", "n"], "additionalProperties": False}
REGEX = r"(cat|dog)-[0-9]{2}"
CHOICES = ["alpha", "beta", "gamma"]
HELLO = [{"role": "user", "content": "answer in JSON"}]
JSON_TOKENS = 300  # a random model writes whitespace wherever JSON allows it


@pytest.fixture(scope="module")
def server():
    from http_server_main import drained_server_url

    yield from drained_server_url("--api-key", KEY, "--model", "fixtures")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline():
    from conftest import SMALL_ENGINE
    from http_server_main import fixtures_loaded

    from jaxserve.entrypoints.llm import LLM
    return LLM(loaded=fixtures_loaded(), progress=False, **SMALL_ENGINE)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server + path, json={"model": MODEL, **body}, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"})


def streamed_choices(chunks) -> dict[int, tuple[str, str | None]]:
    """Chat chunks -> choice index -> (its whole content, its finish reason)."""
    text, reasons = {}, {}
    for chunk in chunks:
        for choice in chunk.choices:
            text[choice.index] = text.get(choice.index, "") + (choice.delta.content or "")
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    return {i: (text[i], reasons[i]) for i in text}


def assert_valid(text: str, reason: str | None, where: str) -> None:
    assert reason == "stop", f"{where}: finished by {reason!r}, not the grammar: {text!r}"
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError) as exc:
        pytest.fail(f"{where}: {text!r} does not fit the schema: {exc}")


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_response_format_gives_every_choice_valid_json(client, stream):
    response_format = {"type": "json_schema",
                       "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model=MODEL, messages=HELLO, n=2, temperature=1.0,
                                       seed=11, max_tokens=JSON_TOKENS,
                                       response_format=response_format, stream=stream)
    if stream:
        choices = streamed_choices(r)
    else:
        choices = {c.index: (c.message.content, c.finish_reason) for c in r.choices}
    assert sorted(choices) == [0, 1], choices
    for index, (text, reason) in choices.items():
        assert_valid(text, reason, f"choice {index} (stream={stream})")


def test_json_object_response_format_gives_a_json_object(client):
    r = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0.0,
                                       max_tokens=JSON_TOKENS,
                                       response_format={"type": "json_object"})
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(json.loads(choice.message.content), dict), choice.message.content


def test_guided_regex_on_completions_matches(client):
    r = client.completions.create(model=MODEL, prompt="pet:", max_tokens=20, n=2,
                                  temperature=1.0, seed=5, extra_body={"guided_regex": REGEX})
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice
        assert re.fullmatch(REGEX, choice.text), choice.text


def test_guided_choice_and_structured_outputs_choice_give_one_of_the_choices(client):
    for extra in ({"guided_choice": CHOICES}, {"structured_outputs": {"choice": CHOICES}}):
        r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=10,
                                           temperature=1.0, seed=3, n=2, extra_body=extra)
        for choice in r.choices:
            assert choice.finish_reason == "stop", (extra, choice)
            assert choice.message.content in CHOICES, (extra, choice.message.content)


def test_structured_outputs_json_on_completions_validates(client):
    r = client.completions.create(model=MODEL, prompt="{", max_tokens=JSON_TOKENS,
                                  temperature=0.0, extra_body={"structured_outputs":
                                                               {"json": SCHEMA}})
    assert_valid(r.choices[0].text, r.choices[0].finish_reason, "structured_outputs.json")


TWO = [
    ({"guided_regex": REGEX, "guided_choice": CHOICES}, ("guided_regex", "guided_choice")),
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA},
     ("response_format", "guided_json")),
    ({"structured_outputs": {"regex": REGEX}, "guided_grammar": "start: \"a\""},
     ("structured_outputs", "guided_grammar")),
]


@pytest.mark.parametrize("body,names", TWO, ids=lambda v: "+".join(v) if isinstance(v, tuple)
                         else None)
def test_two_constraints_at_once_are_a_400_naming_both(server, body, names):
    r = post(server, "/v1/chat/completions", {"messages": HELLO, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert all(name in error["message"] for name in names), error
    assert error["param"] in names, error


INVALID = [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": {"type": "integer", "minimum": 5, "maximum": 1}}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": REGEX, "ignore_eos": True}, "ignore_eos"),
]


@pytest.mark.parametrize("body,field", INVALID, ids=[f for _, f in INVALID])
def test_an_invalid_constraint_is_a_400_naming_its_field(server, body, field):
    for path, prompt in (("/v1/chat/completions", {"messages": HELLO}),
                         ("/v1/completions", {"prompt": "x"})):
        r = post(server, path, {**prompt, "max_tokens": 5, **body})
        assert r.status_code == 400, (path, body, r.text)
        error = r.json()["error"]
        assert error["param"] == field and field in error["message"], (path, body, error)


def wait_all_pages_free(server) -> float:
    """The free KV page count once it reaches ALL_PAGES (the engine thread frees the last
    request's pages after its response), or the last count read."""
    metric = re.compile(r"^jaxserve_kv_cache_free_pages (\S+)$", re.M)
    for _ in range(200):
        free = float(metric.search(httpx.get(server + "/metrics").text).group(1))
        if free == ALL_PAGES:
            break
        time.sleep(0.05)
    return free


@pytest.mark.parametrize("path,prompt,constraint", [
    ("/v1/completions", {"prompt": "x"}, {"guided_choice": ["x"]}),
    ("/v1/chat/completions", {"messages": HELLO},
     {"response_format": {"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"enum": ["x"]}}}})], ids=["guided_choice", "response_format"])
def test_bad_words_banning_every_token_the_grammar_allows_are_a_400_naming_both(
        server, path, prompt, constraint):
    banned = "x" if "guided_choice" in constraint else '"'
    r = post(server, path, {**prompt, "max_tokens": 8, "bad_words": [banned], **constraint})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "bad_words", error
    assert "bad_words" in error["message"] and "response_format" in error["message"], error
    again = post(server, path, {**prompt, "max_tokens": 8, "temperature": 0.0, **constraint})
    assert again.status_code == 200, f"the next request failed: {again.text}"
    assert wait_all_pages_free(server) == ALL_PAGES, "a KV page leaked"


def test_a_streamed_dead_end_ends_the_stream_with_a_400_error_event(server):
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 8, "stream": True,
                                         "bad_words": ["x"], "guided_choice": ["x"]})
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    errors = [e["error"] for e in events if "error" in e]
    assert errors and errors[-1]["code"] == 400 and errors[-1]["param"] == "bad_words", r.text


def test_a_model_without_a_grammar_tokenizer_refuses_constraints_naming_the_field():
    from jaxserve.entrypoints.openai.errors import error_for_exception

    exc = ValueError("structured_outputs needs a Hugging Face `tokenizers` tokenizer; this "
                     "model's tokenizer is not one")  # what make_request raises (CharTokenizer)
    error = error_for_exception(exc, "messages", "response_format")
    assert (error.status, error.param) == (400, "response_format"), error.body()
    assert "Hugging Face" in error.message, error.message


def offline_prompt_logprobs(offline, prompt_ids: list[int], k: int):
    from jaxserve import SamplingParams
    return offline.generate([prompt_ids], SamplingParams(max_tokens=1, temperature=0.0,
                                                         prompt_logprobs=k),
                            use_tqdm=False)[0].prompt_logprobs


def assert_prompt_logprobs_equal(offline, got, prompt_ids: list[int], k: int) -> None:
    """got: the response's prompt_logprobs; compared with the offline LLM's, key for key."""
    want = offline_prompt_logprobs(offline, prompt_ids, k)
    assert len(got) == len(prompt_ids) == len(want) and got[0] is None and want[0] is None
    for p in range(1, len(prompt_ids)):
        entry, wanted = got[p], want[p]
        assert list(entry) == [str(t) for t in wanted], (p, entry, wanted)
        assert next(iter(entry)) == str(prompt_ids[p]), "the prompt token's own entry first"
        for token, lp in wanted.items():
            item = entry[str(token)]
            assert item["logprob"] == pytest.approx(lp, abs=1e-4), (p, token, item, lp)
            assert item["decoded_token"] == offline.tokenizer.decode(
                [token], skip_special_tokens=False), (p, token, item)
        ranked = sorted((t for t in entry if entry[t]["rank"] is not None),
                        key=lambda t: entry[t]["rank"])
        assert [entry[t]["rank"] for t in ranked] == list(range(1, k + 1)), (p, entry)
        assert [entry[t]["logprob"] for t in ranked] == sorted(
            (entry[t]["logprob"] for t in ranked), reverse=True), (p, entry)


def test_completions_prompt_logprobs_equal_the_offline_llms(client, offline):
    r = client.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=2,
                                  n=2, temperature=0.0,
                                  extra_body={"prompt_logprobs": 3, "return_token_ids": True})
    for choice in r.choices:
        prompt_ids = choice.model_extra["prompt_token_ids"]
        assert_prompt_logprobs_equal(offline, choice.model_extra["prompt_logprobs"],
                                     prompt_ids, 3)


def test_chat_prompt_logprobs_equal_the_offline_llms(client, offline):
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2,
                                       temperature=0.0,
                                       extra_body={"prompt_logprobs": 2,
                                                   "return_token_ids": True})
    assert_prompt_logprobs_equal(offline, r.model_extra["prompt_logprobs"],
                                 r.model_extra["prompt_token_ids"], 2)
    assert r.choices[0].finish_reason is not None


def test_prompt_logprobs_zero_ranks_only_what_it_knows(client, offline):
    r = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=1,
                                  temperature=0.0, extra_body={"prompt_logprobs": 0})
    got = r.choices[0].model_extra["prompt_logprobs"]
    want = offline_prompt_logprobs(offline, [5, 6, 7, 8], 0)
    for p, token in enumerate([6, 7, 8], 1):
        assert list(got[p]) == [str(token)], got[p]
        assert got[p][str(token)]["rank"] is None, "no alternatives: its rank is unknown"
        assert got[p][str(token)]["logprob"] == pytest.approx(want[p][token], abs=1e-4)


def test_prompt_logprobs_are_not_streamed_and_are_bounded(server):
    for path, prompt in (("/v1/chat/completions", {"messages": HELLO}),
                         ("/v1/completions", {"prompt": "x"})):
        for body in ({"prompt_logprobs": 2, "stream": True}, {"prompt_logprobs": 21},
                     {"prompt_logprobs": -1}):
            r = post(server, path, {**prompt, "max_tokens": 2, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", \
                (path, body, r.text)


def test_every_kv_page_is_free_afterwards(server, client):
    r = client.completions.create(model=MODEL, prompt="still here", max_tokens=3,
                                  temperature=0.0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
    free = wait_all_pages_free(server)
    assert free == ALL_PAGES, f"{free} of {ALL_PAGES} KV pages free"
