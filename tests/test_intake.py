"""Request intake (jaxserve/core/intake.py): one test per check, on a tiny RequestLimits (no
model, no jax), and one bad field refused alike by both front ends over one tiny engine: HTTP
400 with param = the field, gRPC INVALID_ARGUMENT naming it.
"""

from __future__ import annotations

import pytest

from jaxserve.core import intake
from jaxserve.core.intake import RequestError, RequestLimits
from jaxserve.core.request import SamplingParams

# 8 pages of 4 tokens (page 0 reserved): the pool (32 tokens) binds before max_model_len (64)
POOL_BOUND = RequestLimits(max_model_len=64, vocab_size=100, page_size=4, num_pages=9)
# 32 pages of 4: max_model_len binds first
CONTEXT_BOUND = RequestLimits(max_model_len=64, vocab_size=100, page_size=4, num_pages=33)


def refusal(limits, prompt, params) -> RequestError:
    with pytest.raises(RequestError) as info:
        intake.check_request(limits, prompt, params)
    return info.value


def assert_names(error: RequestError, field: str, *words: str) -> None:
    missing = [w for w in (field, *words) if w not in str(error)]
    assert error.field == field and not missing, \
        f"field {error.field!r}, message {str(error)!r} does not name {missing}"


def test_a_request_within_every_limit_passes():
    intake.check_request(CONTEXT_BOUND, [1, 2, 3], SamplingParams(max_tokens=61))
    intake.check_request(POOL_BOUND, [1, 2, 3], SamplingParams(max_tokens=29))


def test_an_empty_prompt_is_refused():
    assert_names(refusal(CONTEXT_BOUND, [], SamplingParams()), "prompt_token_ids", "empty")


@pytest.mark.parametrize("token", [100, -1])
def test_a_prompt_token_outside_the_vocabulary_is_refused(token):
    error = refusal(CONTEXT_BOUND, [5, token], SamplingParams())
    assert_names(error, "prompt_token_ids", str(token), "[0, 100)", "vocabulary")


def test_a_prompt_with_no_room_for_output_in_max_model_len_is_refused():
    error = refusal(CONTEXT_BOUND, [1] * 64, SamplingParams(max_tokens=1))
    assert_names(error, "prompt_token_ids", "64 tokens", "64 (max_model_len)")
    assert not error.exceeds_kv_pool


def test_max_tokens_past_max_model_len_is_refused_naming_the_most_allowed():
    error = refusal(CONTEXT_BOUND, [1] * 60, SamplingParams(max_tokens=5))
    assert_names(error, "max_tokens", "max_tokens=5", "60 tokens", "64 (max_model_len)",
                 "at most 4")
    assert not error.exceeds_kv_pool


def test_a_request_the_page_pool_can_never_hold_is_refused_as_exceeding_it():
    error = refusal(POOL_BOUND, [1] * 20, SamplingParams(max_tokens=13))  # 33 > 32 tokens
    assert_names(error, "max_tokens", "max_tokens=13", "8 pages of 4", "at most 12")
    assert error.exceeds_kv_pool, "the pool, not max_model_len, is what it exceeds"
    assert refusal(POOL_BOUND, [1] * 32, SamplingParams(max_tokens=1)).field == "prompt_token_ids"


@pytest.mark.parametrize("field, kwargs", [
    ("logit_bias", dict(logit_bias={100: 1.0})),
    ("allowed_token_ids", dict(allowed_token_ids=[3, 250])),
    ("stop_token_ids", dict(stop_token_ids=[100], min_tokens=2)),  # indexes the min_tokens mask
])
def test_a_sampling_token_id_outside_the_vocabulary_is_refused(field, kwargs):
    error = refusal(CONTEXT_BOUND, [1, 2], SamplingParams(**kwargs))
    assert_names(error, field, "[0, 100)", "vocabulary")


@pytest.mark.parametrize("field, value, limit", [
    ("temperature", -1.0, ">= 0"), ("top_p", 0.0, "(0, 1]"), ("top_k", -1, ">= 0"),
    ("min_p", 1.5, "[0, 1]"), ("max_tokens", 0, ">= 1"), ("presence_penalty", 3.0, "[-2, 2]"),
])
def test_a_sampling_value_out_of_range_is_refused_by_sampling_params(field, value, limit):
    with pytest.raises(RequestError) as info:
        SamplingParams(**{field: value})
    assert_names(info.value, field, repr(value), limit)


def test_check_request_revalidates_sampling_ranges():
    params = SamplingParams()
    object.__setattr__(params, "top_p", 2.0)  # past the constructor's validation
    assert_names(refusal(CONTEXT_BOUND, [1], params), "top_p", "2.0", "(0, 1]")


def test_structured_outputs_of_the_wrong_shape_are_refused():
    with pytest.raises(RequestError) as info:  # two constraints at once
        SamplingParams(structured_outputs={"regex": "a+", "choice": ["x"]})
    assert_names(info.value, "structured_outputs", "exactly one", "regex", "choice")
    params = SamplingParams()
    object.__setattr__(params, "structured_outputs", "a+")  # not a StructuredOutputs
    assert_names(refusal(CONTEXT_BOUND, [1], params), "structured_outputs", "'a+'", "str")


# ---- the same bad field through both front ends ----------------------------------------------
@pytest.fixture(scope="module")
def fronts():
    """One tiny engine served over gRPC and HTTP on one event loop thread."""
    from types import SimpleNamespace

    from conftest import SMALL_ENGINE
    from tiny_models import tiny_loaded

    from jaxserve.config import EngineConfig
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.engine.engine import Engine
    from jaxserve.entrypoints.grpc.background import ServerThread
    from jaxserve.entrypoints.openai.http_server import HttpServer, HttpSettings

    engine = Engine(EngineConfig.from_kwargs(**SMALL_ENGINE), loaded=tiny_loaded(),
                    progress=False)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    grpc_server = ServerThread(async_engine)
    http = grpc_server.call(HttpServer.start("127.0.0.1", HttpSettings(port=0)), 60)
    http.attach(async_engine)
    yield SimpleNamespace(grpc=grpc_server, http=http, vocab=engine.info.vocab_size)
    grpc_server.call(http.shutdown(timeout=1), 60)
    grpc_server.stop(timeout=1.0)
    async_engine.stop(timeout=10.0)


def test_a_token_id_outside_the_vocabulary_is_400_and_invalid_argument_naming_the_field(fronts):
    import grpc
    import httpx

    from jaxserve.entrypoints.grpc.client import JaxServeClient
    from jaxserve.entrypoints.grpc.pb import jaxserve_pb2 as pb

    token = fronts.vocab + 372
    r = httpx.post(fronts.http.url + "/v1/completions", timeout=60, json={
        "model": fronts.http.state.serving.model_name, "prompt": "hello", "max_tokens": 2,
        "logit_bias": {str(token): 1.0}})
    error = r.json()["error"]
    assert (r.status_code, error["param"]) == (400, "logit_bias"), r.text
    request = pb.GenerateRequest(text="hello", sampling=pb.SamplingParams(
        max_tokens=2, logit_bias={token: 1.0}))
    with JaxServeClient(fronts.grpc.address, timeout=60) as client, \
            pytest.raises(grpc.RpcError) as info:
        list(client.stub.Generate(request, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert info.value.details() == error["message"], "the two front ends word it differently"
    for word in ("logit_bias", str(token), f"[0, {fronts.vocab})"):
        assert word in error["message"], f"{error['message']!r} does not name {word!r}"


def test_admission_refuses_an_id_in_use_and_a_full_queue_as_load():
    from jaxserve.core.intake import QueueFullError, check_admission

    check_admission("new", {"old"}, queued=3, incoming=1, max_queued_requests=4)
    with pytest.raises(ValueError, match="request_id 'old' is already in use"):
        check_admission("old", {"old"}, 0, 1, None)
    with pytest.raises(QueueFullError, match=r"max_queued_requests=4"):
        check_admission("new", set(), queued=3, incoming=2, max_queued_requests=4)


def test_a_lora_request_where_no_adapter_is_served_is_refused_naming_the_field_and_why():
    from jaxserve.core.intake import check_adapter_served

    check_adapter_served(None, False)  # the base model: nothing to refuse
    check_adapter_served(object(), True)
    with pytest.raises(RequestError, match=r"serves no LoRA adapters \(not with data") as err:
        check_adapter_served(object(), False, "not with data_parallel_size > 1")
    assert err.value.field == "lora_request"
