"""The OpenAI HTTP API: one `run_server` process (gRPC + HTTP, tests/http_server_main.py) driven
by the official openai client and raw httpx: greedy output equals the offline LLM token for
token, streams concatenate to the full text, usage is exact, bad input is a 4xx naming the
field, and every KV page is free afterwards (read through /metrics, never the scheduler). The
sampling features (n, top-k logprobs, penalties, logit_bias) are test_http_sampling.py's.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

KEY = "sk-test"
MODEL = "tiny-llama"
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True, "return_token_ids": True})


@pytest.fixture(scope="module")
def http_process():
    from http_server_main import drained_server

    yield from drained_server("--api-key", KEY)


@pytest.fixture(scope="module")
def server(http_process):
    return http_process.url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline():
    from conftest import SMALL_ENGINE
    from http_server_main import tiny_bpe_loaded

    from jaxserve.entrypoints.llm import LLM
    return LLM(loaded=tiny_bpe_loaded(), progress=False, **SMALL_ENGINE)


def offline_ids(offline, prompt_ids, max_tokens):
    from jaxserve import SamplingParams
    out = offline.generate([prompt_ids], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                         ignore_eos=True))[0]
    return out.token_ids


ALL_PAGES = 47  # SMALL_ENGINE's 48, less the reserved page 0


def wait_for(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def free_pages(server) -> float:
    text = httpx.get(server + "/metrics").text
    return float(re.search(r"^jaxserve_kv_cache_free_pages (\S+)$", text, re.M).group(1))


def test_completion_equals_offline_greedy_and_usage_is_exact(client, offline):
    r = client.completions.create(model=MODEL, prompt="the cat sat", max_tokens=12, **GREEDY)
    choice = r.choices[0]
    prompt_ids = choice.model_extra["prompt_token_ids"]
    assert choice.model_extra["token_ids"] == offline_ids(offline, prompt_ids, 12)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt_ids), 12)
    assert choice.finish_reason == "length"


def test_streamed_completion_deltas_concatenate_to_the_full_text(client):
    full = client.completions.create(model=MODEL, prompt="on the mat", max_tokens=10, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt="on the mat", max_tokens=10,
                                            stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    ids = [t for c in chunks for t in c.choices[0].model_extra["token_ids"]]
    assert ids == full.choices[0].model_extra["token_ids"]


def test_prompt_lists_give_one_choice_each_streamed_or_not_and_echo_prepends(client, offline):
    ids = [[5, 6, 7], [8, 9]]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1]
    for choice, prompt in zip(r.choices, ids):
        assert choice.model_extra["token_ids"] == offline_ids(offline, prompt, 4)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (5, 8)
    texts = ["the dog", "a bird flew"]
    full = client.completions.create(model=MODEL, prompt=texts, max_tokens=4, **GREEDY)
    streamed = ["", ""]
    for chunk in client.completions.create(model=MODEL, prompt=texts, max_tokens=4,
                                           stream=True, **GREEDY):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == [c.text for c in full.choices]
    echoed = client.completions.create(model=MODEL, prompt=texts[0], max_tokens=4, echo=True,
                                       **GREEDY)
    assert echoed.choices[0].text == texts[0] + full.choices[0].text


def test_a_stop_string_ends_the_text_before_it_with_finish_reason_stop(client):
    full = client.completions.create(model=MODEL, prompt="stop here", max_tokens=24, **GREEDY)
    text = full.choices[0].text
    stop = next(text[i:i + 2] for i in range(len(text) // 2, len(text) - 1)
                if text[i:i + 2].strip() and text.find(text[i:i + 2]) == i)
    r = client.completions.create(model=MODEL, prompt="stop here", max_tokens=24, stop=[stop],
                                  temperature=0.0)
    assert r.choices[0].finish_reason == "stop", (stop, r.choices[0])
    assert r.choices[0].text == text[:text.index(stop)]


def test_a_seeded_sampled_completion_repeats(client):
    kwargs = dict(model=MODEL, prompt="dice", max_tokens=8, temperature=1.0, top_p=0.9,
                  seed=1234, extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.01})
    assert client.completions.create(**kwargs).choices[0].text == \
        client.completions.create(**kwargs).choices[0].text


def test_chat_streamed_and_not_equal_the_template_prompt_offline(server, client, offline):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, **GREEDY)
    ids = httpx.post(server + "/tokenize", json={"messages": messages},
                     headers={"Authorization": f"Bearer {KEY}"}).json()["tokens"]
    assert r.choices[0].model_extra["token_ids"] == offline_ids(offline, ids, 8)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 8
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                            stream=True, stream_options={"include_usage": True},
                                            **GREEDY)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 8


def offline_logprobs(offline, prompt_ids, max_tokens):
    from jaxserve import SamplingParams
    out = offline.generate([prompt_ids], SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=True))[0]
    return out.token_ids, out.logprobs


def test_completion_logprobs_0_are_the_sampled_tokens_logprobs_streamed_or_not(client, offline):
    r = client.completions.create(model=MODEL, prompt="log me", max_tokens=6, logprobs=0,
                                  **GREEDY)
    choice = r.choices[0]
    ids, want = offline_logprobs(offline, choice.model_extra["prompt_token_ids"], 6)
    assert choice.model_extra["token_ids"] == ids
    assert choice.logprobs.token_logprobs == pytest.approx(want, abs=1e-4)
    assert "".join(choice.logprobs.tokens) == choice.text
    assert choice.logprobs.text_offset == \
        [sum(map(len, choice.logprobs.tokens[:i])) for i in range(6)]
    chunks = list(client.completions.create(model=MODEL, prompt="log me", max_tokens=6,
                                            logprobs=0, stream=True, **GREEDY))
    streamed = [lp for c in chunks if c.choices[0].logprobs
                for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(want, abs=1e-4)
    offsets = [o for c in chunks if c.choices[0].logprobs
               for o in c.choices[0].logprobs.text_offset]
    assert offsets == choice.logprobs.text_offset


def test_streamed_text_offsets_follow_the_tokens_while_a_stop_string_holds_text_back(client,
                                                                                     offline):
    """Each "x" could start the stop string "xy", so its text is sent one chunk late; the
    streamed text_offset still give every token its own place, as the whole response's do."""
    x = offline.tokenizer.token_to_id("x")
    kw = dict(model=MODEL, prompt="log me", max_tokens=5, logprobs=0, stop=["xy"],
              temperature=0.0, extra_body={"allowed_token_ids": [x]})
    whole = client.completions.create(**kw).choices[0]
    assert whole.text == "xxxxx" and whole.logprobs.text_offset == [0, 1, 2, 3, 4]
    chunks = list(client.completions.create(**kw, stream=True))
    offsets = [o for c in chunks if c.choices[0].logprobs
               for o in c.choices[0].logprobs.text_offset]
    assert offsets == whole.logprobs.text_offset
    assert "".join(c.choices[0].text for c in chunks) == whole.text


def test_chat_logprobs_true_gives_each_sampled_token_with_its_bytes(server, client, offline):
    messages = [{"role": "user", "content": "log me"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                       logprobs=True, **GREEDY)
    ids = httpx.post(server + "/tokenize", json={"messages": messages},
                     headers={"Authorization": f"Bearer {KEY}"}).json()["tokens"]
    _, want = offline_logprobs(offline, ids, 5)
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(want, abs=1e-4)
    assert all(bytes(c.bytes) == c.token.encode() and c.top_logprobs == [] for c in content)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                                 logprobs=True, stream=True, **GREEDY))
    streamed = [c.logprob for k in chunks if k.choices[0].logprobs
                for c in k.choices[0].logprobs.content]
    assert streamed == pytest.approx(want, abs=1e-4)


CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
M = [{"role": "user", "content": "hi"}]
C = {"model": MODEL, "prompt": "x"}
H = {"model": MODEL, "messages": M}
NO_TYPE = {"Content-Type": None}


def ascii_json(body) -> bytes:
    return json.dumps(body).encode()  # escapes what UTF-8 cannot hold


BAD = [  # (path, json body / raw bytes / chunks, header overrides, status, field named)
    (COMP, {"model": MODEL, "prompt": 5}, None, 400, "prompt"),
    (COMP, {"model": MODEL}, None, 400, "prompt"),
    (COMP, {"model": MODEL, "prompt": ""}, None, 400, "prompt"),
    (COMP, {"model": MODEL, "prompt": []}, None, 400, "prompt"),
    (COMP, {"model": MODEL, "prompt": [[1, 2], []]}, None, 400, "prompt"),
    (COMP, {"model": MODEL, "prompt": [10**9]}, None, 400, "prompt"),
    (COMP, {"model": MODEL, "prompt": [-1]}, None, 400, "prompt"),
    (COMP, {"model": MODEL, "prompt": "x" * 3000}, None, 400, "prompt"),  # > max_model_len
    (COMP, {"model": MODEL, "prompt": [5] * 600}, None, 400, "prompt"),
    (COMP, {**C, "max_tokens": 0}, None, 400, "max_tokens"),
    (COMP, {**C, "max_tokens": 600}, None, 400, "max_tokens"),
    (COMP, {**C, "max_tokens": "ten"}, None, 400, "max_tokens"),
    (COMP, {**C, "max_tokens": 1.5}, None, 400, "max_tokens"),
    (COMP, {**C, "temperature": -1}, None, 400, "temperature"),
    (COMP, {**C, "temperature": "hot"}, None, 400, "temperature"),
    (COMP, {**C, "top_p": 0}, None, 400, "top_p"),
    (COMP, {**C, "top_p": 1.5}, None, 400, "top_p"),
    (COMP, {**C, "top_k": -5}, None, 400, "top_k"),
    (COMP, {**C, "min_p": 2}, None, 400, "min_p"),
    (COMP, {**C, "seed": -1}, None, 400, "seed"),
    (COMP, {**C, "seed": 2**40}, None, 400, "seed"),
    (COMP, {**C, "stop": [""]}, None, 400, "stop"),
    (COMP, {**C, "stop": [1, 2]}, None, 400, "stop"),
    (COMP, {**C, "stop_token_ids": [-3]}, None, 400, "stop_token_ids"),
    (COMP, {**C, "stream": "maybe"}, None, 400, "stream"),
    (COMP, {**C, "stream": True, "stream_options": {"include_usage": 3}}, None, 400,
     "stream_options.include_usage"),
    (COMP, {**C, "n": 0}, None, 400, "n"),
    (COMP, {**C, "suffix": "y"}, None, 400, "suffix"),
    (COMP, {**C, "best_of": 2}, None, 400, "best_of"),
    (COMP, {**C, "logprobs": 21}, None, 400, "logprobs"),
    (COMP, {**C, "n": 65}, None, 400, "n"),
    (COMP, {**C, "min_tokens": 20, "max_tokens": 4}, None, 400, "min_tokens"),
    (COMP, {**C, "presence_penalty": 3}, None, 400, "presence_penalty"),
    (COMP, {**C, "frequency_penalty": -2.5}, None, 400, "frequency_penalty"),
    (COMP, {**C, "repetition_penalty": 0}, None, 400, "repetition_penalty"),
    (COMP, {**C, "logit_bias": {"x": 3}}, None, 400, "logit_bias"),
    (COMP, {**C, "logit_bias": {"5": 500}}, None, 400, "logit_bias"),
    (CHAT, {**H, "response_format": {"type": "text", "bogus": 1}}, None, 400,
     "response_format.bogus"),  # unknown keys elsewhere are ignored: test_http_fields.py
    (COMP, {"model": "gpt-4", "prompt": "x"}, None, 404, "model"),
    (COMP, {"model": 5, "prompt": "x"}, None, 400, "model"),
    (CHAT, {"model": MODEL, "messages": []}, None, 400, "messages"),
    (CHAT, {"model": MODEL, "messages": "hi"}, None, 400, "messages"),
    (CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, None, 400,
     "messages[0].role"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user"}]}, None, 400, "messages[0].content"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": None}]}, None, 400,
     "messages[0].content"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, None, 400, "messages[0].content"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x" * 3000}]}, None, 400,
     "messages"),  # over max_model_len
    (CHAT, {**H, "logprobs": True, "top_logprobs": 21}, None, 400, "top_logprobs"),
    (CHAT, {**H, "top_logprobs": 3}, None, 400, "top_logprobs"),  # logprobs not true
    (CHAT, {**H, "top_logprobs": 0, "logprobs": "sure"}, None, 400, "logprobs"),
    (CHAT, {**H, "n": 0}, None, 400, "n"),
    (CHAT, {**H, "response_format": {"type": "json_schema"}}, None, 400, "response_format"),
    (CHAT, {**H, "response_format": {"type": "xml"}}, None, 400, "response_format.type"),
    (COMP, {**C, "guided_regex": "("}, None, 400, "guided_regex"),
    (CHAT, {**H, "max_completion_tokens": 9999}, None, 400, "max_completion_tokens"),
    (CHAT, {**H, "continue_final_message": True}, None, 400, "continue_final_message"),
    (CHAT, {"model": "gpt-4", "messages": M}, None, 404, "model"),
    # A lone surrogate: JSON can carry it ("\ud800"), no tokenizer can encode it.
    (CHAT, ascii_json({"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}]}),
     None, 400, "messages[0].content"),
    (CHAT, ascii_json({"model": MODEL, "messages": [{"role": "user", "content": "x",
                                                      "name": "\udfff"}]}),
     None, 400, "messages[0].name"),
    (COMP, ascii_json({**C, "stop": ["\ud800"]}), None, 400, "stop"),
    ("/tokenize", ascii_json({"prompt": "a\ud800"}), None, 400, "prompt"),
    (CHAT, b"{not json", None, 400, "body"),
    (CHAT, b'{"model": "\xff\xfe"}', None, 400, "body"),  # not UTF-8
    (COMP, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, 400, "body"),
    (CHAT, b"[1, 2]", None, 400, "body"),
    (CHAT, b"x" * (2 << 20), None, 413, "body"),
    (CHAT, [b"{" + b" " * (1 << 16)] * 20, None, 413, "body"),  # chunked: no Content-Length
    (CHAT, json.dumps(H).encode(), NO_TYPE, 415, "content-type"),
    (CHAT, json.dumps(H).encode(), {"Content-Type": "text/plain"}, 415, "content-type"),
    (CHAT, H, {"Authorization": "Bearer wrong"}, 401, "authorization"),
    (CHAT, H, {"Authorization": ""}, 401, "authorization"),
    (CHAT, H, {"Authorization": None}, 401, "authorization"),
    ("/tokenize", {"prompt": 5}, None, 400, "prompt"),
    ("/detokenize", {"tokens": [10**9]}, None, 400, "tokens"),
    ("/no/such/path", {}, None, 404, None),
    ("GET " + COMP, None, None, 405, None),
]


def test_bad_input_table_is_4xx_naming_the_field_and_the_server_keeps_serving(server, client):
    assert len(BAD) >= 30
    base = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    with httpx.Client(base_url=server, timeout=60) as http:
        for path, body, extra, status, field in BAD:
            headers = {k: v for k, v in {**base, **(extra or {})}.items() if v is not None}
            method, _, path = path.rpartition(" ")
            if isinstance(body, (bytes, list)) and not isinstance(body, list) or \
                    isinstance(body, list) and isinstance(body[0], bytes):
                kwargs = {"content": body if isinstance(body, bytes) else iter(body)}
            else:
                kwargs = {"json": body} if body is not None else {}
            r = http.request(method or "POST", path, headers=headers, **kwargs)
            shown = str(body)[:200]
            assert r.status_code == status, (path, shown, r.text)
            error = r.json()["error"]
            assert error["code"] == status and error["message"] and error["type"], error
            if field is None:
                assert error["param"] is None, (shown, error)
            else:  # the field, or an element of it ("stop_token_ids[0]")
                assert re.fullmatch(re.escape(field) + r"(\[\d+\].*)?", error["param"] or ""), \
                    (shown, error)
            assert "internal" not in error["type"], (shown, error)
    r = client.completions.create(model=MODEL, prompt="still here", max_tokens=3, **GREEDY)
    assert r.usage.completion_tokens == 3
    assert wait_for(lambda: free_pages(server) == ALL_PAGES), \
        "every KV page (48 minus reserved page 0) is free"


def _metric(server, name: str) -> float:
    text = httpx.get(server + "/metrics").text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def test_clients_closing_streams_midway_abort_their_requests_and_free_pages(server):
    import asyncio

    aborted = 'jaxserve_requests_finished_total{finish_reason="abort"}'
    before = _metric(server, aborted)
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 200, "temperature": 0.0,
            "ignore_eos": True, "stream": True}

    async def one(http, close_early: bool):
        num_chunks, finished = 0, None
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    num_chunks += 1
                    finished = finished or json.loads(line[6:])["choices"][0]["finish_reason"]
                    if close_early and num_chunks == 3:
                        return num_chunks  # leaving the block closes the connection
        return finished

    async def burst():
        async with httpx.AsyncClient(base_url=server, timeout=120,
                                     headers={"Authorization": f"Bearer {KEY}"}) as http:
            return await asyncio.gather(*(one(http, i % 2 == 0) for i in range(20)))

    counts = asyncio.run(burst())
    assert counts[0::2] == [3] * 10
    assert counts[1::2] == ["length"] * 10, counts  # the other 10 ran to max_tokens
    deadline = time.monotonic() + 30
    while (_metric(server, aborted) - before < 10 or free_pages(server) != 47) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(server, aborted) - before == 10, "each closed stream is one aborted request"
    assert free_pages(server) == 47
