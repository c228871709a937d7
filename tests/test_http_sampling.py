"""The OpenAI HTTP API's sampling features against the offline LLM, over a real `run_server`
process (tests/http_server_main.py) and the official openai client: n samples (choice index
prompt * n + sample, each sample's tokens equal to the offline n-request's), streamed n deltas,
top-k logprobs in both shapes, echoed prompt logprobs, penalties and logit_bias, vLLM's extra
parameters, and a 400 naming the field for each invalid value. Every KV page free afterwards.
"""

from __future__ import annotations

import re
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

KEY = "sk-test"
MODEL = "tiny-llama"
EXTRA = {"ignore_eos": True, "return_token_ids": True}
ALL_PAGES = 47  # SMALL_ENGINE's 48, less the reserved page 0


from test_http import (client, http_process, offline,  # noqa: E402,F401  (the same fixtures)
                       server)


def run_offline(offline, prompt_ids, **params):
    from jaxserve import SamplingParams
    return offline.generate([prompt_ids], SamplingParams(ignore_eos=True, **params),
                            use_tqdm=False)[0]


def chat_ids(server, messages) -> list[int]:
    return httpx.post(server + "/tokenize", json={"messages": messages},
                      headers={"Authorization": f"Bearer {KEY}"}).json()["tokens"]


def text_top(offline, top: dict[int, float]) -> dict[str, float]:
    """The offline {id: logprob} as the server shows it: {token text: logprob}."""
    out: dict[str, float] = {}
    for token, lp in sorted(top.items(), key=lambda item: -item[1]):
        out.setdefault(offline.tokenizer.decode([token], skip_special_tokens=False), lp)
    return out


def assert_tops_equal(got: dict[str, float], want: dict[str, float], where: str) -> None:
    assert set(got) == set(want), (where, got, want)
    for key in want:
        assert got[key] == pytest.approx(want[key], abs=1e-4), (where, key, got, want)


def free_pages(server) -> float:
    text = httpx.get(server + "/metrics").text
    return float(re.search(r"^jaxserve_kv_cache_free_pages (\S+)$", text, re.M).group(1))


def test_n_2_seeded_gives_two_choices_equal_to_the_offline_samples(client, offline):
    r = client.completions.create(model=MODEL, prompt="roll the dice", max_tokens=8, n=2,
                                  seed=7, temperature=1.0, extra_body=EXTRA)
    assert [c.index for c in r.choices] == [0, 1]
    want = run_offline(offline, r.choices[0].model_extra["prompt_token_ids"], max_tokens=8,
                       n=2, seed=7, temperature=1.0)
    for choice, sample in zip(r.choices, want.outputs):
        assert choice.model_extra["token_ids"] == sample.token_ids, (choice.index, choice)
        assert choice.text == sample.text and choice.finish_reason == "length"
    assert r.choices[0].model_extra["token_ids"] != r.choices[1].model_extra["token_ids"], \
        "two samples of a sampled request differ (their seeds differ)"
    assert r.usage.completion_tokens == 16, "usage counts every sample's tokens"
    assert r.usage.prompt_tokens == len(r.choices[0].model_extra["prompt_token_ids"])


def test_chat_n_2_seeded_gives_two_choices_equal_to_the_offline_samples(server, client,
                                                                         offline):
    messages = [{"role": "user", "content": "tell me"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, n=2,
                                       seed=11, extra_body=EXTRA)
    want = run_offline(offline, chat_ids(server, messages), max_tokens=6, n=2, seed=11)
    assert [c.index for c in r.choices] == [0, 1]
    for choice, sample in zip(r.choices, want.outputs):
        assert choice.model_extra["token_ids"] == sample.token_ids, choice
    assert r.usage.completion_tokens == 12


def test_streamed_n_deltas_concatenate_per_choice_index_to_the_full_texts(client):
    kwargs = dict(model=MODEL, prompt=["the dog", "a bird"], max_tokens=6, n=2, seed=3,
                  temperature=1.0, extra_body=EXTRA)
    full = client.completions.create(**kwargs)
    assert [c.index for c in full.choices] == [0, 1, 2, 3], "choice = prompt * n + sample"
    texts, ids, reasons = [""] * 4, [[] for _ in range(4)], [None] * 4
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            ids[choice.index] += choice.model_extra["token_ids"]
            reasons[choice.index] = reasons[choice.index] or choice.finish_reason
    assert texts == [c.text for c in full.choices]
    assert ids == [c.model_extra["token_ids"] for c in full.choices]
    assert reasons == ["length"] * 4, "each choice gets its own finish_reason"


def test_streamed_chat_n_deltas_concatenate_per_choice_index(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                  n=3, seed=5, extra_body=EXTRA)
    full = client.chat.completions.create(**kwargs)
    texts, reasons = [""] * 3, [None] * 3
    chunks = list(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs))
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            reasons[choice.index] = reasons[choice.index] or choice.finish_reason
    assert texts == [c.message.content for c in full.choices]
    assert reasons == ["length"] * 3
    assert chunks[-1].usage.completion_tokens == 15 == full.usage.completion_tokens


def test_completion_logprobs_3_alternatives_equal_the_offline_top_logprobs(client, offline):
    r = client.completions.create(model=MODEL, prompt="log me", max_tokens=5, logprobs=3,
                                  temperature=0.0, extra_body=EXTRA)
    choice = r.choices[0]
    want = run_offline(offline, choice.model_extra["prompt_token_ids"], max_tokens=5,
                       temperature=0.0, logprobs=3)
    assert choice.model_extra["token_ids"] == want.token_ids
    assert choice.logprobs.token_logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert len(choice.logprobs.top_logprobs) == 5
    for i, (got, top) in enumerate(zip(choice.logprobs.top_logprobs, want.top_logprobs)):
        assert_tops_equal(got, text_top(offline, top), f"token {i}")
    streamed = [top for chunk in client.completions.create(
        model=MODEL, prompt="log me", max_tokens=5, logprobs=3, temperature=0.0,
        stream=True, extra_body=EXTRA) if chunk.choices[0].logprobs
        for top in chunk.choices[0].logprobs.top_logprobs]
    for i, (got, top) in enumerate(zip(streamed, want.top_logprobs, strict=True)):
        assert_tops_equal(got, text_top(offline, top), f"streamed token {i}")


def test_chat_top_logprobs_3_alternatives_equal_the_offline_top_logprobs(server, client,
                                                                        offline):
    messages = [{"role": "user", "content": "log me"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                       logprobs=True, top_logprobs=3, temperature=0.0,
                                       extra_body=EXTRA)
    want = run_offline(offline, chat_ids(server, messages), max_tokens=4, temperature=0.0,
                       logprobs=3)
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(want.logprobs, abs=1e-4)
    for i, (entry, top) in enumerate(zip(content, want.top_logprobs, strict=True)):
        assert len(entry.top_logprobs) == 3, entry
        ranked = sorted(top.items(), key=lambda item: -item[1])
        for alt, (token, lp) in zip(entry.top_logprobs, ranked):
            text = offline.tokenizer.decode([token], skip_special_tokens=False)
            assert alt.token == text and bytes(alt.bytes) == text.encode(), (i, alt, token)
            assert alt.logprob == pytest.approx(lp, abs=1e-4), (i, alt, lp)


def test_echo_with_logprobs_gives_the_prompt_tokens_their_offline_logprobs(client, offline):
    r = client.completions.create(model=MODEL, prompt="echo this", max_tokens=3, logprobs=2,
                                  echo=True, temperature=0.0, extra_body=EXTRA)
    choice = r.choices[0]
    prompt_ids = choice.model_extra["prompt_token_ids"]
    want = run_offline(offline, prompt_ids, max_tokens=3, temperature=0.0, logprobs=2,
                       prompt_logprobs=2)
    lps = choice.logprobs
    assert choice.text.startswith("echo this") and len(lps.tokens) == len(prompt_ids) + 3
    assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None, \
        "the first prompt token has no logprob"
    prompt_lps = [want.prompt_logprobs[i][t] for i, t in enumerate(prompt_ids) if i]
    assert lps.token_logprobs[1:len(prompt_ids)] == pytest.approx(prompt_lps, abs=1e-4)
    for i in range(1, len(prompt_ids)):
        assert_tops_equal(lps.top_logprobs[i], text_top(offline, want.prompt_logprobs[i]),
                          f"prompt token {i}")
    assert lps.token_logprobs[len(prompt_ids):] == pytest.approx(want.logprobs, abs=1e-4)
    chunks = list(client.completions.create(model=MODEL, prompt="echo this", max_tokens=3,
                                            logprobs=2, echo=True, temperature=0.0,
                                            stream=True, extra_body=EXTRA))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    streamed = [lp for c in chunks if c.choices[0].logprobs
                for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lps.token_logprobs[1:],
                                                                 abs=1e-4)
    offsets = [o for c in chunks if c.choices[0].logprobs
               for o in c.choices[0].logprobs.text_offset]
    assert offsets == lps.text_offset


PROCESSORS = [
    {"presence_penalty": 1.5},
    {"frequency_penalty": 2.0},
    {"repetition_penalty": 3.0},
    {"logit_bias": {"7": 100}},
    {"min_tokens": 4, "allowed_token_ids": [5, 6, 7, 8, 9]},
]


@pytest.mark.parametrize("body", PROCESSORS, ids=lambda b: ",".join(b))
def test_penalties_and_logit_bias_change_greedy_output_exactly_as_offline(client, offline,
                                                                          body):
    r = client.completions.create(model=MODEL, prompt="the cat sat on", max_tokens=12,
                                  temperature=0.0, extra_body={**EXTRA, **body})
    choice = r.choices[0]
    params = {**body}
    if "logit_bias" in params:
        params["logit_bias"] = {int(k): v for k, v in params["logit_bias"].items()}
    want = run_offline(offline, choice.model_extra["prompt_token_ids"], max_tokens=12,
                       temperature=0.0, **params)
    assert choice.model_extra["token_ids"] == want.token_ids, body
    plain = run_offline(offline, choice.model_extra["prompt_token_ids"], max_tokens=12,
                        temperature=0.0)
    assert want.token_ids != plain.token_ids, f"{body} changes the greedy output"


def test_vllm_stop_and_text_parameters_give_the_offline_text(client, offline):
    plain = client.completions.create(model=MODEL, prompt="stop here", max_tokens=16,
                                      temperature=0.0, extra_body=EXTRA).choices[0]
    text, prompt_ids = plain.text, plain.model_extra["prompt_token_ids"]
    stop = next(text[i:i + 2] for i in range(len(text) // 2, len(text) - 1)
                if text[i:i + 2].strip() and text.find(text[i:i + 2]) == i)
    word = offline.tokenizer.decode(plain.model_extra["token_ids"][2:3]).strip() or "a"
    for body in ({"stop": [stop], "include_stop_str_in_output": True},
                 {"bad_words": [word]}, {"skip_special_tokens": False}):
        r = client.completions.create(model=MODEL, prompt="stop here", max_tokens=16,
                                      temperature=0.0, extra_body={**EXTRA, **body})
        want = run_offline(offline, prompt_ids, max_tokens=16, temperature=0.0, **body)
        assert r.choices[0].text == want.text, body
        assert r.choices[0].model_extra["token_ids"] == want.token_ids, body
    r = client.completions.create(model=MODEL, prompt="stop here", max_tokens=16, stop=[stop],
                                  temperature=0.0, extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == text[:text.index(stop) + len(stop)], (stop, text)


INVALID = [  # (path, body additions, field named)
    ("/v1/completions", {"presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": -2.5}, "frequency_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 500}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"-1": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"1000000": 1}}, "logit_bias"),  # outside the vocab
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"n": 65}, "n"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ("/v1/completions", {"allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/completions", {"allowed_token_ids": [10**6]}, "allowed_token_ids"),
    ("/v1/completions", {"bad_words": [""]}, "bad_words"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ("/v1/chat/completions", {"n": 65}, "n"),
    ("/v1/chat/completions", {"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
]


def test_invalid_sampling_values_are_400_naming_the_field(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server, timeout=60, headers=headers) as http:
        for path, extra, field in INVALID:
            base = {"model": MODEL, "max_tokens": 4}
            base.update({"prompt": "x"} if "chat" not in path else
                        {"messages": [{"role": "user", "content": "x"}]})
            r = http.post(path, json={**base, **extra})
            assert r.status_code == 400, (path, extra, r.text)
            error = r.json()["error"]
            assert re.fullmatch(re.escape(field) + r"(\[\d+\])?", error["param"] or ""), \
                (extra, error)
            assert field in error["message"], (extra, error)


def test_every_page_is_free_after_the_sampling_requests(server, client):
    r = client.completions.create(model=MODEL, prompt="still here", max_tokens=3, n=4,
                                  extra_body=EXTRA)
    assert r.usage.completion_tokens == 12
    deadline = time.monotonic() + 30
    while free_pages(server) != ALL_PAGES and time.monotonic() < deadline:
        time.sleep(0.05)
    assert free_pages(server) == ALL_PAGES, "every KV page (48 less reserved page 0) is free"
