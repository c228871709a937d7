"""The gRPC server end to end: a real server on 127.0.0.1 with the tiny model, a real client.

One in-process server (ServerThread around an AsyncEngine) serves every test here; the offline
reference is the session's `small_llm`. Start-up and SIGTERM, which need a server process, are in
test_grpc_process.py.
"""

from __future__ import annotations

import concurrent.futures
import time
from types import SimpleNamespace

import grpc
import numpy as np
import pytest

from grpc_fixtures import GREEDY, mixed_prompts, served, wait_for, wait_until_idle  # noqa: F401
from jaxserve import SamplingParams
from jaxserve.entrypoints.grpc.client import JaxServeClient, JaxServeError
from jaxserve.entrypoints.grpc.pb import jaxserve_pb2 as pb

# ---- streaming ------------------------------------------------------------------------------
def test_32_concurrent_streams_match_the_offline_path_token_for_token(served, small_llm):
    prompts, params = mixed_prompts(32)
    offline = small_llm.generate(prompts, params, use_tqdm=False)
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(served.client.generate_text, prompts, params))
    for i, (got, want, sp) in enumerate(zip(results, offline, params)):
        assert got.token_ids == want.token_ids, f"request {i}: streamed tokens differ"
        assert got.text == want.text, f"request {i}: text differs"
        assert "".join(got.text_deltas) == got.text
        assert got.finish_reason == "length"
        assert got.usage.completion_tokens == sp.max_tokens
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        assert got.usage.HasField("time_to_first_token_s")
    wait_until_idle(served.engine)


def test_chat_request_equals_its_rendered_template_as_token_ids(served):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    params = SamplingParams(max_tokens=12, **GREEDY)
    chat = served.client.generate_text(messages=messages, params=params)
    tokenizer = served.engine.tokenizer
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    assert served.client.tokenize(messages=messages) == ids
    assert chat.token_ids == served.client.generate_text(ids, params).token_ids


def test_logprobs_come_one_per_token_when_asked(served):
    params = SamplingParams(max_tokens=10, logprobs=True, **GREEDY)
    result = served.client.generate_text("abc", params)
    assert len(result.logprobs) == len(result.token_ids) == 10
    assert all(lp <= 0.0 for lp in result.logprobs), result.logprobs
    assert served.client.generate_text("abc", SamplingParams(max_tokens=3)).logprobs == []


# ---- invalid input --------------------------------------------------------------------------
def raw(prompt: str | list[int] = "hello", **sampling) -> pb.GenerateRequest:
    """A request built without the client's checks: text (str) or token-id (list) prompt."""
    request = pb.GenerateRequest(sampling=pb.SamplingParams(**sampling))
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.SetInParent()
        request.token_ids.ids.extend(prompt)
    return request


INVALID = {  # case: (request, words the error must name: field, value, limit)
    "empty text": (raw(""), ["prompt"]),
    "empty token ids": (raw([]), ["prompt_token_ids"]),
    "empty chat": (pb.GenerateRequest(chat=pb.Chat()), ["chat.messages"]),
    "no prompt": (pb.GenerateRequest(), ["prompt", "text", "token_ids", "chat"]),
    "over max_model_len": (raw([5] * 500, max_tokens=100),
                           ["max_tokens", "500", "100", "max_model_len", "512"]),
    "token id too big": (raw([5, 128]), ["prompt_token_ids", "128", "vocabulary"]),
    "negative token id": (raw([-1]), ["prompt_token_ids", "-1", "vocabulary"]),
    "temperature < 0": (raw(temperature=-0.5), ["temperature", "-0.5", ">= 0"]),
    "top_p = 0": (raw(top_p=0.0), ["top_p", "0.0", "(0, 1]"]),
    "top_p > 1": (raw(top_p=1.5), ["top_p", "1.5", "(0, 1]"]),
    "top_k < 0": (raw(top_k=-1), ["top_k", "-1", ">= 0"]),
    "min_p > 1": (raw(min_p=1.5), ["min_p", "1.5", "[0, 1]"]),
    "min_p < 0": (raw(min_p=-0.1), ["min_p", "-0.1", "[0, 1]"]),
    "max_tokens = 0": (raw(max_tokens=0), ["max_tokens", "0", ">= 1"]),
    "seed < 0": (raw(seed=-3), ["seed", "-3"]),
    "empty stop string": (raw(stop=[""]), ["stop"]),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_request_returns_invalid_argument_naming_the_field(served, case):
    request, words = INVALID[case]
    with pytest.raises(grpc.RpcError) as info:
        list(served.client.stub.Generate(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    missing = [w for w in words if w not in info.value.details()]
    assert not missing, f"{case}: {info.value.details()!r} does not name {missing}"


def test_server_still_serves_after_invalid_requests(served):
    for request, _ in INVALID.values():
        with pytest.raises(grpc.RpcError):
            list(served.client.stub.Generate(request, timeout=30))
    result = served.client.generate_text("still here", SamplingParams(max_tokens=5, **GREEDY))
    assert result.finish_reason == "length" and len(result.token_ids) == 5
    wait_until_idle(served.engine)


def fail_beside_a_healthy_stream(served, failing_call) -> JaxServeError:
    """Run failing_call(params) while another request streams; that one must still finish."""
    params = SamplingParams(max_tokens=30, **GREEDY)
    other = served.client.generate("a long one", params)
    num_tokens = len(next(other).token_ids)
    with pytest.raises(JaxServeError) as info:
        failing_call(params)
    rest = list(other)
    num_tokens += sum(len(r.token_ids) for r in rest)
    assert (num_tokens, rest[-1].finish_reason) == (30, pb.FINISH_REASON_LENGTH)
    wait_until_idle(served.engine)
    return info.value


def test_a_failure_while_starting_one_request_is_internal_and_others_go_on(served, monkeypatch):
    encode = served.engine.tokenizer.encode

    def broken_encode(text, *args, **kwargs):
        if text == "boom":
            raise RuntimeError("tokenizer exploded")
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(served.engine.tokenizer, "encode", broken_encode)
    error = fail_beside_a_healthy_stream(served, lambda p: served.client.generate_text("boom", p))
    assert error.code == grpc.StatusCode.INTERNAL and "tokenizer exploded" in error.details


def test_a_request_failing_inside_the_engine_is_internal_and_others_go_on(served, monkeypatch):
    marker = [127, 126, 125]  # a prompt whose first detokenization fails
    decode = served.engine.tokenizer.decode

    def broken_decode(ids, *args, **kwargs):
        if list(ids[:3]) == marker:
            raise RuntimeError("detokenizer exploded")
        return decode(ids, *args, **kwargs)

    monkeypatch.setattr(served.engine.tokenizer, "decode", broken_decode)
    error = fail_beside_a_healthy_stream(
        served, lambda p: served.client.generate_text(marker, p))
    assert error.code == grpc.StatusCode.INTERNAL and "detokenizer exploded" in error.details


# ---- cancellation and back-pressure ------------------------------------------------------------
@pytest.fixture
def aborted_live(served, monkeypatch):
    """Request ids the engine aborted while they were still running (engine thread records)."""
    engine, ids = served.engine, []
    abort = engine.abort

    def recording_abort(request_id):
        out = abort(request_id)
        if out is not None:
            ids.append(request_id)
        return out

    monkeypatch.setattr(engine, "abort", recording_abort)
    return ids


def test_cancelling_10_of_20_streams_finishes_the_rest_and_frees_every_page(served,
                                                                              aborted_live):
    calls, outcomes = [], {}
    for i in range(20):
        cancel = i % 2 == 0
        params = SamplingParams(max_tokens=300 if cancel else 30, **GREEDY)
        calls.append((i, cancel, served.client.generate([4 + i] * (5 + i), params,
                                                        request_id=f"c{i}")))

    def consume(i, cancel, call):
        tokens = []
        try:
            for response in call:
                tokens.extend(response.token_ids)
                if cancel:
                    call.cancel()
            outcomes[i] = ("ok", len(tokens))
        except grpc.RpcError as exc:
            outcomes[i] = (exc.code().name, len(tokens))

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        list(pool.map(lambda c: consume(*c), calls))
    kept = {i: outcomes[i] for i in range(1, 20, 2)}
    cancelled = {i: outcomes[i] for i in range(0, 20, 2)}
    assert all(o == ("ok", 30) for o in kept.values()), f"kept streams: {kept}"
    assert all(o[0] == "CANCELLED" for o in cancelled.values()), f"cancelled: {cancelled}"
    wait_until_idle(served.engine, timeout=5.0)
    assert sorted(aborted_live) == sorted(f"c{i}" for i in cancelled), (
        f"the engine aborted {aborted_live}, not every cancelled request")


def test_a_passed_deadline_aborts_the_request_in_the_engine(served, aborted_live, monkeypatch):
    # The tiny model can decode 400 tokens within the deadline on a warm cache: slow each step
    # so that the request is still running when the deadline passes.
    step = served.engine.step
    monkeypatch.setattr(served.engine, "step", lambda: (time.sleep(0.005), step())[1])
    call = served.client.generate("slow", SamplingParams(max_tokens=400, **GREEDY),
                                  timeout=0.3, request_id="deadline")
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until_idle(served.engine, timeout=5.0)
    assert aborted_live == ["deadline"], "the engine did not abort the request"


def test_third_request_on_a_blocked_engine_with_queue_bound_2_is_resource_exhausted(served):
    engine, async_engine = served.engine, served.async_engine
    original = engine.config
    # The bound is read per request, so a changed config applies to this engine at once.
    engine.config = original.replace(max_queued_requests=2)
    async_engine.paused.set()
    try:
        async_engine.abort("wake-up")  # an unknown id: only wakes the thread, which then
        time.sleep(0.3)                 # sees `paused` and waits before reading its inbox again
        params = SamplingParams(max_tokens=4, **GREEDY)
        queued = [served.client.generate(f"queued {i}", params) for i in range(2)]
        wait_for(lambda: async_engine.num_in_flight == 2)
        with pytest.raises(JaxServeError) as info:
            served.client.generate_text("third", params)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
        assert "max_queued_requests=2" in info.value.details
    finally:
        async_engine.paused.clear()
        engine.config = original
    for call in queued:
        assert list(call)[-1].finish_reason == pb.FINISH_REASON_LENGTH
    wait_until_idle(engine)


# ---- Tokenize, ModelInfo, health, reflection -------------------------------------------------
def test_tokenize_matches_the_engine_tokenizer(served):
    tokenizer = served.engine.tokenizer
    assert served.client.tokenize("héllo") == tokenizer.encode("héllo")
    assert (served.client.tokenize("hi", add_special_tokens=False)
            == tokenizer.encode("hi", add_special_tokens=False))
    with pytest.raises(grpc.RpcError) as info:
        served.client.stub.Tokenize(pb.TokenizeRequest())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_model_info_describes_the_served_engine(served):
    info = served.client.model_info()
    assert (info.model_name, info.max_model_len, info.vocab_size, info.page_size, info.dtype,
            info.num_pages, info.max_num_seqs, list(info.eos_token_ids)) == (
        "tiny-llama", 512, 128, 16, "float32", 48, 16, [2])


def test_engine_finishes_other_than_stop_or_length_end_the_call_with_a_status(served):
    """error: INTERNAL; abort by the server: ABORTED; refused at intake because the page pool
    can never hold it: INVALID_ARGUMENT. A fake engine yields each outcome for its prompt."""
    from jaxserve.core.intake import RequestError
    from jaxserve.engine.outputs import CompletionOutput, RequestOutput
    from jaxserve.engine.client_limits import ClientLimits
    from jaxserve.engine.prompt_intake import PromptLimits
    from jaxserve.entrypoints.grpc.background import ServerThread

    outcomes = {1: ("refused", "the KV page pool holds 47 pages"), 2: ("error", "kaput"),
                3: ("abort", None)}

    async def generate(prompt, params, *, request_id, priority, prompt_token_ids, deadline):
        reason, error = outcomes[len(prompt_token_ids) % 4]
        if reason == "refused":
            raise RequestError("prompt_token_ids", error, exceeds_kv_pool=True)
        yield RequestOutput("r", prompt_token_ids, [CompletionOutput(0, finish_reason=reason)],
                            finished=True, error=error)

    engine = SimpleNamespace(tokenizer=served.engine.tokenizer)
    fake = SimpleNamespace(engine=engine, error=None, generate=generate,
                           limits=PromptLimits(4096, 1 << 20), clients=ClientLimits(),
                           rank_health=lambda: None)
    # a request the pool can never hold is bad input: a retryable status would be retried
    expected = {1001: "INVALID_ARGUMENT", 10: "INTERNAL", 7: "ABORTED"}
    with ServerThread(fake) as server, JaxServeClient(server.address, timeout=10) as client:
        for length, code in expected.items():
            with pytest.raises(JaxServeError) as info:
                client.generate_text([5] * length)
            assert info.value.code.name == code, (length, info.value)


def test_health_turns_not_serving_and_calls_unavailable_when_the_engine_dies(served):
    from jaxserve.entrypoints.grpc.background import ServerThread

    dying = SimpleNamespace(engine=served.engine, error=None,  # stands in for an AsyncEngine
                            limits=served.async_engine.limits, rank_health=lambda: None)
    with ServerThread(dying) as server, JaxServeClient(server.address, timeout=10) as client:
        assert client.health("jaxserve.v1.JaxServe") == "SERVING"
        dying.error = RuntimeError("device lost")
        assert wait_for(lambda: client.health("jaxserve.v1.JaxServe") == "NOT_SERVING", 5)
        with pytest.raises(JaxServeError) as info:
            client.generate_text("hello")
        assert info.value.code == grpc.StatusCode.UNAVAILABLE and "device lost" in str(info.value)


def test_health_is_serving_and_reflection_lists_the_service(served):
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase)

    assert served.client.health("") == "SERVING"
    assert served.client.health("jaxserve.v1.JaxServe") == "SERVING"
    database = ProtoReflectionDescriptorDatabase(served.client.channel)
    services = database.get_services()
    assert "jaxserve.v1.JaxServe" in services and "grpc.health.v1.Health" in services
    service = DescriptorPool(database).FindServiceByName("jaxserve.v1.JaxServe")  # as grpcurl
    generate = service.methods_by_name["Generate"]
    assert generate.output_type.full_name == "jaxserve.v1.GenerateResponse"


def test_processors_and_top_logprobs_cross_the_wire_as_offline(served, small_llm):
    """Every new SamplingParams field survives the proto both ways; the served tokens and
    alternatives equal the offline engine's for the same request."""
    from jaxserve.entrypoints.grpc import convert

    params = SamplingParams(max_tokens=8, logprobs=3, presence_penalty=0.5,
                            frequency_penalty=-0.25, repetition_penalty=1.5,
                            logit_bias={40: 3.0, 41: -5.0}, min_tokens=2,
                            allowed_token_ids=list(range(30, 100)), bad_words=["zz"],
                            include_stop_str_in_output=True, skip_special_tokens=False,
                            prompt_logprobs=2, **GREEDY)
    assert convert.sampling_from_proto(convert.sampling_to_proto(params)) == params
    old = convert.sampling_from_proto(pb.SamplingParams(logprobs=True))
    assert old.logprobs == 0 and not old.uses_processors, "an old client's request is unchanged"
    result = served.client.generate_text("abc", params)
    want = small_llm.generate(["abc"], params, use_tqdm=False)[0]  # the same tiny model
    assert result.token_ids == want.token_ids and set(result.token_ids) <= set(range(30, 100))
    assert len(result.top_logprobs) == 8
    assert [list(e) for e in result.prompt_logprobs] == [list(e) for e in want.prompt_logprobs[1:]]
    assert [list(t) for t in result.top_logprobs] == [list(t) for t in want.top_logprobs]
    np.testing.assert_allclose([v for t in result.top_logprobs for v in t.values()],
                               [v for t in want.top_logprobs for v in t.values()], rtol=1e-6)


def test_n_samples_stream_by_index_as_offline(served, small_llm):
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=3, n=3, ignore_eos=True)
    result = served.client.generate_text("hello", params)
    want = small_llm.generate(["hello"], params, use_tqdm=False)[0]
    assert sorted(result.samples) == [0, 1, 2]
    assert [result.samples[i].token_ids for i in range(3)] == [c.token_ids for c in want.outputs]
    assert all(result.samples[i].finish_reason == "length" for i in range(3))
    assert result.usage.completion_tokens == 18
    wait_until_idle(served.engine)


def test_structured_outputs_cross_the_wire_and_need_a_real_tokenizer(served):
    from jaxserve.entrypoints.grpc import convert
    from jaxserve.structured.params import StructuredOutputs

    for so in (StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
               StructuredOutputs(regex="a+b"), StructuredOutputs(choice=["x", "y z"]),
               StructuredOutputs(grammar='start: "a"'), StructuredOutputs(json_object=True)):
        params = SamplingParams(structured_outputs=so)
        assert convert.sampling_from_proto(convert.sampling_to_proto(params)) == params
    with pytest.raises(JaxServeError) as error:  # the tiny model's toy tokenizer has no vocab
        served.client.generate_text("abc", SamplingParams(structured_outputs={"regex": "a"}))
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_outputs" in error.value.details


@pytest.mark.parametrize("ending", ["stopped", "cancelled"])
def test_an_id_reused_after_its_request_ended_gets_the_tokens_of_a_fresh_id(served, ending):
    def tokens(prompt, request_id, **sampling):
        params = SamplingParams(**{"max_tokens": 16, **GREEDY, **sampling})
        return [t for r in served.client.generate(prompt, params, request_id=request_id)
                for t in r.token_ids]

    first_prompt, second_prompt = [5, 9, 33, 40, 7, 8, 12], [60, 61, 62, 63, 90, 91]
    fresh = tokens(second_prompt, f"fresh-{ending}")
    if ending == "stopped":  # on its 4th token: with async scheduling a step is in flight then
        stop = tokens(first_prompt, f"probe-{ending}")[3]
        tokens(first_prompt, f"reused-{ending}", max_tokens=200, stop_token_ids=[stop])
    else:
        call = served.client.generate(first_prompt, SamplingParams(max_tokens=200, **GREEDY),
                                      request_id=f"reused-{ending}")
        next(iter(call))
        call.cancel()
    wait_until_idle(served.engine)
    again = tokens(second_prompt, f"reused-{ending}")
    assert again == fresh, f"a reused id after the request {ending} got another request's state"
    wait_until_idle(served.engine)
