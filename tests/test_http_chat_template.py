"""Chat over HTTP with the real default model (SmolLM2-135M-Instruct): the prompt the server builds
from a conversation is, token for token, what transformers' apply_chat_template builds from the
same messages and the same template (read by transformers from the same GGUF); and the served
reply equals the offline LLM's greedy reply to the same chat.

The prompt checks need only the two tokenizers. The reply check runs one engine: the offline
LLM answers first, then the same engine serves the HTTP front end in this process (uvicorn on a
free loopback port, driven by the openai client), so the model is compiled once.
"""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from model_fixtures import default_gguf_path, real_default_model  # noqa: E402

from jaxserve import SamplingParams  # noqa: E402
from jaxserve.entrypoints.openai.chat_prompt import render_chat  # noqa: E402

# transformers' GGUF tokenizer splits whitespace before digits unlike SmolLM2's own (see
# test_tokenizer.SMOLLM_DIGIT_CASES), so these conversations avoid digits after whitespace.
SYSTEM = {"role": "system", "content": "You are terse. Answer in one short sentence."}
CONVERSATIONS = [
    [{"role": "user", "content": "Hello! Who are you?"}],
    [SYSTEM, {"role": "user", "content": "Name a colour of the sky."}],
    [SYSTEM, {"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"},
     {"role": "user", "content": "Now say bye, politely — in French? 😀"}],
    [{"role": "user", "content": "Write a haiku\nabout rain."},
     {"role": "assistant", "content": "Soft rain on the roof"}],
]


@pytest.fixture(scope="module")
def ours():
    return real_default_model().tokenizer


@pytest.fixture(scope="module")
def theirs():
    path = default_gguf_path()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def hf_ids(tokenizer, messages, **kwargs) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_chat_prompt_equals_transformers_apply_chat_template_token_for_token(ours, theirs):
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            _, ids = render_chat(ours, messages, add_generation_prompt)
            want = hf_ids(theirs, messages, add_generation_prompt=add_generation_prompt)
            assert ids == want, (messages, add_generation_prompt)


def test_continue_final_message_equals_transformers_token_for_token(ours, theirs):
    for messages in CONVERSATIONS:
        if messages[-1]["role"] != "assistant":
            continue
        text, ids = render_chat(ours, messages, add_generation_prompt=False,
                                continue_final_message=True)
        want = hf_ids(theirs, messages, add_generation_prompt=False, continue_final_message=True)
        assert ids == want, messages
        assert text.endswith(messages[-1]["content"])


def test_text_parts_and_developer_role_render_as_their_plain_forms(ours):
    parts = [{"role": "developer", "content": [{"type": "text", "text": "Be terse."}]},
             {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                          {"type": "text", "text": "there"}]}]
    plain = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi\nthere"}]
    assert render_chat(ours, parts) == render_chat(ours, plain)


async def served_reply(engine, messages, max_tokens: int):
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.entrypoints.openai.http_server import HttpServer, HttpSettings

    async_engine = AsyncEngine(engine)
    async_engine.start()
    http = await HttpServer.start("127.0.0.1", HttpSettings(port=0))
    http.attach(async_engine)
    try:
        async with openai.AsyncOpenAI(base_url=http.url + "/v1", api_key="none",
                                      max_retries=0) as client:
            return await client.chat.completions.create(
                model=http.state.serving.model_name, messages=messages, max_tokens=max_tokens,
                temperature=0.0, extra_body={"return_token_ids": True})
    finally:
        await http.shutdown(timeout=5)
        async_engine.stop(timeout=10)


def test_served_chat_reply_equals_the_offline_llm_greedy_reply(theirs):
    from jaxserve.entrypoints.llm import LLM

    messages = CONVERSATIONS[1]
    llm = LLM(loaded=real_default_model(), progress=False, max_num_seqs=4,
              max_num_batched_tokens=64, token_buckets=(64,), seq_buckets=(4,),
              layer_loop="scan", max_model_len=512)
    offline = llm.chat(messages, SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)
    r = asyncio.run(served_reply(llm.engine, messages, 24))
    choice = r.choices[0]
    assert r.model == "SmolLM2-135M-Instruct", r.model
    assert choice.model_extra["token_ids"] == offline.token_ids
    assert choice.message.content == offline.text and offline.text
    assert r.usage.prompt_tokens == len(hf_ids(theirs, messages, add_generation_prompt=True))
    assert choice.finish_reason == ("stop" if offline.finish_reason == "stop" else "length")
