"""Faults the gRPC server must contain, in-process: bytes that are not a message, prompts over
the size limits, deadlines that pass in the queue, one request whose output processing fails,
and an engine whose step raises.

One in-process server (ServerThread around an AsyncEngine over the tiny model) serves the
tests that leave the engine healthy; the failing-engine test builds its own engine. Process
lifecycle (exit codes, SIGTERM, health latency) is test_grpc_lifecycle.py's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import threading
import time

import grpc
import pytest

from jaxserve import SamplingParams
from jaxserve.entrypoints.grpc.client import JaxServeError
from jaxserve.entrypoints.grpc.pb import jaxserve_pb2 as pb

from front_load_helpers import engine_held  # noqa: E402
from grpc_fixtures import GREEDY, served, wait_until_idle  # noqa: E402,F401  (one engine)


def raw_call(served, method: str, data: bytes, streaming: bool = True):
    """Send raw bytes as the request of JaxServe/<method>; the RpcError it ends with."""
    channel = served.client.channel
    path = f"/jaxserve.v1.JaxServe/{method}"
    call = (channel.unary_stream if streaming else channel.unary_unary)(path)
    with pytest.raises(grpc.RpcError) as info:
        result = call(data, timeout=30)
        if streaming:
            list(result)
    return info.value


def metric(engine, name: str) -> float:
    return engine.metrics.registry.get_sample_value(name) or 0.0


# ---- bytes that are not a message ------------------------------------------------------------
def test_truncated_generate_bytes_are_invalid_argument_naming_the_message(served):
    data = pb.GenerateRequest(text="hello", sampling=pb.SamplingParams(max_tokens=3))
    error = raw_call(served, "Generate", data.SerializeToString()[:-2])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "not a valid jaxserve.v1.GenerateRequest" in error.details(), error.details()


def test_invalid_utf8_in_a_string_field_is_invalid_argument(served):
    data = pb.GenerateRequest(text="hello").SerializeToString().replace(b"hello", b"hel\xffo")
    error = raw_call(served, "Generate", data)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "UTF-8" in error.details(), error.details()


def test_a_request_over_max_request_bytes_is_refused_undecoded_naming_the_limit(served):
    limit = served.async_engine.limits.max_request_bytes
    data = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * (limit + 1))).SerializeToString()
    error = raw_call(served, "Generate", data)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    assert f"over the limit of {limit}" in error.details(), error.details()
    assert "max_request_bytes" in error.details(), error.details()


def test_corrupt_tokenize_bytes_are_invalid_argument(served):
    error = raw_call(served, "Tokenize", b"\x0a\xff\xff\xff", streaming=False)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "jaxserve.v1.TokenizeRequest" in error.details(), error.details()


# ---- size limits before tokenizing ---------------------------------------------------------
@pytest.fixture
def encode_calls(served, monkeypatch):
    """Every tokenizer encode call: (text length, thread name)."""
    tokenizer, calls = served.engine.tokenizer, []
    encode = tokenizer.encode

    def spy(text, *args, **kwargs):
        calls.append((len(text), threading.current_thread().name))
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", spy)
    return calls


def test_a_text_over_the_character_limit_is_refused_before_tokenizing(served, encode_calls):
    limit = served.async_engine.limits.max_prompt_chars
    with pytest.raises(JaxServeError) as info:
        served.client.generate_text("x" * (limit + 1), SamplingParams(max_tokens=2))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert f"over the limit of {limit}" in info.value.details, info.value.details
    assert "max_prompt_chars" in info.value.details, info.value.details
    assert encode_calls == [], "the tokenizer ran on a prompt refused for its size"


def test_token_ids_over_max_model_len_are_refused_naming_the_limit(served):
    with pytest.raises(JaxServeError) as info:
        served.client.generate_text([5] * 513, SamplingParams(max_tokens=2))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert "513 tokens" in info.value.details and "max_model_len" in info.value.details


def test_a_chat_over_the_character_limit_is_refused_before_templating(served, encode_calls):
    limit = served.async_engine.limits.max_prompt_chars
    messages = [{"role": "user", "content": "y" * (limit // 2 + 1)}] * 2
    with pytest.raises(JaxServeError) as info:
        served.client.generate_text(messages=messages, params=SamplingParams(max_tokens=2))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert "chat.messages" in info.value.details and str(limit) in info.value.details
    assert encode_calls == [], "the chat was templated and tokenized despite its size"


def test_a_long_text_prompt_is_tokenized_on_the_text_pool_not_the_event_loop(served,
                                                                              encode_calls):
    from jaxserve.engine.prompt_intake import INLINE_MAX_CHARS

    with pytest.raises(JaxServeError) as info:  # 5000 byte tokens: over max_model_len
        served.client.generate_text("z" * (INLINE_MAX_CHARS + 1), SamplingParams(max_tokens=2))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert [name.startswith("jaxserve-text") for _, name in encode_calls] == [True], encode_calls


def test_the_text_pool_queues_work_beyond_its_workers_instead_of_refusing():
    from jaxserve.engine.prompt_intake import TextPool

    pool, release = TextPool(num_workers=1), threading.Event()

    async def scenario():
        held = asyncio.ensure_future(pool.run(release.wait))
        queued = [asyncio.ensure_future(pool.run(len, "x" * i)) for i in range(64)]
        await asyncio.sleep(0.05)
        waited = not any(q.done() for q in queued)  # behind the one busy worker
        release.set()
        await held
        return waited, await asyncio.gather(*queued)

    waited, lengths = asyncio.run(scenario())
    assert waited, "queued calls ran although the only worker was busy"
    assert lengths == list(range(64)), "a queued call was refused or lost"
    pool.close()


# ---- deadlines and queue time ----------------------------------------------------------------
def test_a_request_whose_deadline_passes_in_the_queue_is_dropped_before_it_runs(served):
    from jaxserve.engine.async_engine import DeadlineExceededError

    async_engine, engine = served.async_engine, served.engine
    dropped, prompt_tokens = (metric(engine, "jaxserve_requests_deadline_expired_total"),
                              metric(engine, "jaxserve_prompt_tokens_total"))

    async def scenario():
        stream = async_engine.generate([5, 6, 7], SamplingParams(max_tokens=4, **GREEDY),
                                       deadline=time.monotonic() + 0.05)
        with engine_held(async_engine):
            first = asyncio.ensure_future(anext(stream))
            await asyncio.sleep(0.2)  # past the deadline, before the engine saw the request
        with pytest.raises(DeadlineExceededError, match="waited in the queue"):
            await first

    asyncio.run(scenario())
    assert metric(engine, "jaxserve_requests_deadline_expired_total") == dropped + 1
    assert metric(engine, "jaxserve_prompt_tokens_total") == prompt_tokens, "it was run"
    wait_until_idle(engine)


def test_a_grpc_deadline_that_passes_in_the_queue_ends_deadline_exceeded(served):
    with engine_held(served.async_engine), pytest.raises(JaxServeError) as info:
        served.client.generate_text("late", SamplingParams(max_tokens=4), timeout=0.2)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, info.value
    wait_until_idle(served.engine)


def test_queue_time_is_observed_once_per_admitted_request(served):
    name = "jaxserve_request_queue_time_seconds_count"
    before = metric(served.engine, name)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda i: served.client.generate_text([5 + i], SamplingParams(
            max_tokens=3, **GREEDY)), range(3)))
    assert metric(served.engine, name) == before + 3


# ---- one request's failure -------------------------------------------------------------------
def test_a_failing_detokenizer_fails_its_request_alone(served, monkeypatch):
    import jaxserve.engine.output_processor as output_processor

    poisoned = [9, 9, 9, 9]

    class Detokenizer(output_processor.IncrementalDetokenizer):
        def __init__(self, tokenizer, prompt_token_ids, *args, **kwargs):
            super().__init__(tokenizer, prompt_token_ids, *args, **kwargs)
            self.poisoned = list(prompt_token_ids) == poisoned

        def feed(self, token_ids, final):
            if self.poisoned:
                raise UnicodeError("injected detokenizer failure")
            return super().feed(token_ids, final)

    monkeypatch.setattr(output_processor, "IncrementalDetokenizer", Detokenizer)
    prompts = [[5, 6], poisoned, [7, 8, 9], [10]]
    params = SamplingParams(max_tokens=12, **GREEDY)

    def run(prompt):
        try:
            return served.client.generate_text(prompt, params)
        except JaxServeError as exc:
            return exc

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, prompts))
    failed = results.pop(1)
    assert isinstance(failed, JaxServeError) and failed.code == grpc.StatusCode.INTERNAL, failed
    assert "injected detokenizer failure" in failed.details, failed.details
    for result in results:
        assert not isinstance(result, JaxServeError), f"a neighbour failed too: {result}"
        assert (len(result.token_ids), result.finish_reason) == (12, "length")
    assert served.client.health() == "SERVING"
    wait_until_idle(served.engine)


def test_a_write_refused_by_a_call_that_already_ended_sends_no_status_and_frees_the_request(
        served, caplog):
    """A client cancel racing a write: grpc refuses the write (its context not yet done) and
    would refuse any status after it; the handler returns quietly and the request is aborted."""
    from grpc._cython import cygrpc

    class EndedCall:
        aborted = None

        def __init__(self):
            self.writes = 0

        async def write(self, response):
            self.writes += 1
            raise cygrpc.ExecuteBatchError("Failed \"execute_batch\"")

        async def abort(self, code, details):
            self.aborted = (code, details)

        def done(self):
            return False

        def time_remaining(self):
            return None

        def invocation_metadata(self):
            return ()

        def peer(self):
            return "ipv4:127.0.0.1:50000"

    call = EndedCall()
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]), sampling=pb.SamplingParams(
        max_tokens=50, temperature=0.0, ignore_eos=True))
    servicer = served.server.handle.servicer
    with caplog.at_level("INFO", logger="jaxserve.entrypoints.grpc.server"):
        served.server.call(servicer.Generate(request, call), timeout=60)
    assert call.writes == 1 and call.aborted is None, (call.writes, call.aborted)
    assert "already ended" in caplog.text and "Traceback" not in caplog.text, caplog.text
    wait_until_idle(served.engine)
    assert served.client.health() == "SERVING"


# ---- the engine's own failure ----------------------------------------------------------------
def test_a_step_that_raises_fails_every_open_stream_and_refuses_new_requests():
    from conftest import make_llm

    from jaxserve.engine.async_engine import AsyncEngine, EngineDeadError, EngineFailedError

    llm = make_llm()
    engine = llm.engine
    step, num_steps = engine.step, [0]

    def failing_step():
        num_steps[0] += 1
        if num_steps[0] > 3:
            raise RuntimeError("injected step failure")
        return step()

    engine.step = failing_step
    async_engine = AsyncEngine(engine)
    async_engine.start()

    async def one(i):
        outputs = []
        try:
            async for out in async_engine.generate([5 + i] * 3, SamplingParams(
                    max_tokens=50, **GREEDY)):
                outputs.append(out)
        except EngineFailedError as exc:
            return exc
        return outputs

    async def scenario():
        results = await asyncio.gather(*(one(i) for i in range(4)))
        with pytest.raises(EngineDeadError, match="injected step failure"):
            await anext(async_engine.generate([5], SamplingParams(max_tokens=2)))
        return results

    results = asyncio.run(scenario())
    async_engine.stop(timeout=10)
    assert all(isinstance(r, EngineFailedError) for r in results), results
    assert all(re.search("injected step failure", str(r)) for r in results), results
    assert async_engine.error is not None and async_engine.num_in_flight == 0
