"""The data-parallel front end's pure parts: the routing policy (router.py), each rank's CPU
share (launch.py) and the output deltas rebuilt into the RequestOutputs one engine gives
(wire.py). No processes, no jax."""

from __future__ import annotations

import pytest

from jaxserve import SamplingParams
from jaxserve.engine.outputs import CompletionOutput, RequestOutput
from jaxserve.entrypoints.data_parallel import wire
from jaxserve.entrypoints.data_parallel.launch import cpu_shares, device_environment
from jaxserve.entrypoints.data_parallel.router import Router, page_hashes

PAGE = 4


def test_page_hashes_are_chained_over_full_pages_only():
    a = page_hashes(list(range(10)), PAGE)
    b = page_hashes([99] + list(range(1, 10)), PAGE)
    assert len(a) == 2, "a partial last page has no hash"
    assert a[0] != b[0] and a[1] != b[1], "a page's hash must depend on every earlier token"
    assert page_hashes(list(range(8)) + [7, 7], PAGE) == a


def test_a_prompt_goes_to_the_rank_that_was_sent_its_prefix_even_when_busier():
    router = Router(2, PAGE, pages_per_rank=100)
    prefix = list(range(3, 3 + 3 * PAGE))
    rank, hashes = router.choose(prefix + [1])
    router.sent(rank, hashes, len(prefix) + 1)
    other = 1 - rank
    follower, _ = router.choose(prefix + [2, 2])
    assert follower == rank, "the shared prefix's rank must win over the idle one"
    fresh, _ = router.choose([50] * (3 * PAGE))
    assert fresh == other, "with no overlap anywhere, the rank with fewer waiting tokens wins"


def test_waiting_tokens_count_prefill_until_the_first_token_then_one_per_request():
    router = Router(2, PAGE, pages_per_rank=100)
    router.sent(0, [], 30)
    assert router.ranks[0].waiting_tokens == 30
    router.started(0, 30)
    assert router.ranks[0].waiting_tokens == 1
    router.ended(0, 30, started=True)
    router.sent(1, [], 12)
    router.ended(1, 12, started=False)
    assert [r.waiting_tokens for r in router.ranks] == [0, 0]
    assert [r.num_in_flight for r in router.ranks] == [0, 0]


def test_ties_go_to_fewer_requests_then_the_lower_rank_and_a_dead_rank_is_skipped():
    router = Router(3, PAGE, pages_per_rank=100)
    assert router.choose([1])[0] == 0
    router.sent(0, [], 0)
    assert router.choose([1])[0] == 1, "equal waiting tokens: fewer requests in flight"
    router.died(1)
    assert router.choose([1])[0] == 2
    router.died(0), router.died(2)
    with pytest.raises(ValueError, match="no data-parallel rank is alive"):
        router.choose([1])


def test_a_rank_record_forgets_the_least_recently_sent_pages_past_its_pool_size():
    router = Router(2, PAGE, pages_per_rank=3)
    old = list(range(100, 100 + 2 * PAGE))
    router.sent(0, page_hashes(old, PAGE), len(old))
    new = list(range(200, 200 + 2 * PAGE))
    router.sent(0, page_hashes(new, PAGE), len(new))
    record = router.ranks[0]
    assert len(record.record) == 3
    assert record.overlap(page_hashes(old, PAGE)) == 0, "the oldest page leaves first"
    assert record.overlap(page_hashes(new, PAGE)) == 2


@pytest.mark.parametrize("cpus, ranks, expected", [
    ([0, 1], 2, [[0], [1]]),
    ([0, 1, 2, 3, 4], 2, [[0, 1, 2], [3, 4]]),
    ([5], 2, [[5], [5]]),
    ([3, 1, 2, 0], 4, [[0], [1], [2], [3]]),
])
def test_each_rank_gets_its_own_share_of_the_cores(cpus, ranks, expected):
    assert cpu_shares(cpus, ranks) == expected


def test_each_rank_sees_its_own_accelerator_devices():
    assert device_environment(1, 2) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert device_environment(1, 1, "4,6,7") == {"CUDA_VISIBLE_DEVICES": "6"}
    with pytest.raises(ValueError, match="rank 1 needs 2 device"):
        device_environment(1, 2, "0,1")


def _engine_outputs(params) -> list[RequestOutput]:
    """What an engine's output processor hands out for a request over three steps."""
    live = [CompletionOutput(0, logprobs=[] if params.logprobs is not None else None,
                             top_logprobs=[] if params.top_logprobs else None)]
    steps = [([5, 6], "ab", [-0.5, -1.0], [{5: -0.5}, {6: -1.0}]), ([7], "c", [-2.0], [{7: -2.0}]),
             ([8], "d", [-0.25], [{8: -0.25}])]
    outs = []
    for i, (ids, text, logprobs, tops) in enumerate(steps):
        live[0].append(ids, text, logprobs, tops if params.top_logprobs else [])
        last = i == len(steps) - 1
        if last:
            live[0].finish_reason = "length"
        outs.append(RequestOutput("r#1", [1, 2], [live[0].hand_out()], last, None, 0,
                                  0.1, 0.3 if last else None))
    return outs


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=4),
                                    SamplingParams(max_tokens=4, logprobs=1)])
def test_deltas_sent_over_the_wire_rebuild_the_outputs_one_engine_gives(params):
    rebuilder = wire.OutputRebuilder("r", [1, 2], params)
    for sent in _engine_outputs(params):
        item = wire.unpack(wire.pack([wire.output_item(sent)]))[0]
        got = rebuilder.rebuild(item)
        assert got.request_id == "r", "the caller's id, not the wire id"
        assert (got.token_ids, got.new_token_ids, got.text, got.new_text) == (
            sent.token_ids, sent.new_token_ids, sent.text, sent.new_text)
        assert got.outputs[0].cumulative_logprob == sent.outputs[0].cumulative_logprob
        assert got.logprobs == sent.logprobs and got.top_logprobs == sent.top_logprobs
        assert (got.finished, got.finish_reason, got.latency) == (
            sent.finished, sent.finish_reason, sent.latency)


def test_a_request_at_fault_keeps_its_error_field_over_the_wire():
    sent = RequestOutput("r#1", [1, 2], [CompletionOutput(0, finish_reason="error")], True,
                         "bad_words ban every token", error_field="bad_words")
    item = wire.unpack(wire.pack([wire.output_item(sent)]))[0]
    got = wire.OutputRebuilder("r", [1, 2], SamplingParams(max_tokens=4)).rebuild(item)
    assert (got.finish_reason, got.error, got.error_field) == (
        "error", sent.error, "bad_words"), "the front end must see the request was at fault"


def test_an_error_crosses_the_wire_as_its_own_type():
    from jaxserve.core.intake import RequestError

    sent = RequestError("max_tokens", "too many", exceeds_kv_pool=True)
    item = wire.unpack(wire.pack([wire.error_item("r", sent)]))[0]
    exc = wire.load_error(item[2])
    assert isinstance(exc, RequestError), f"got {exc!r}"
    assert (exc.field, str(exc), exc.exceeds_kv_pool) == ("max_tokens", "too many", True)


@pytest.mark.parametrize("cls_path", ["jaxserve.engine.async_engine.AsyncEngine",
                                      "jaxserve.entrypoints.data_parallel.client."
                                      "DataParallelClient"])
def test_both_engine_clients_have_every_member_the_front_ends_use(cls_path):
    import importlib

    from jaxserve.entrypoints.engine_client import EngineClient

    module, name = cls_path.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    members = [m for m in vars(EngineClient) if not m.startswith("_")]
    members += list(EngineClient.__annotations__)
    source = __import__("inspect").getsource(cls)
    missing = [m for m in members if not hasattr(cls, m)
               and f"self.{m} =" not in source and f"self.{m}:" not in source]
    assert not missing, f"{name} lacks {missing}"


def test_front_ends_use_only_the_engine_client_members_both_clients_have():
    """Every `async_engine.<member>` the front ends read is declared on EngineClient (so both
    clients have it, by the test above); AsyncEngine's `control` only behind the rollout
    routes' data_parallel_size check."""
    import re
    from pathlib import Path

    from jaxserve.entrypoints.engine_client import EngineClient

    declared = set(vars(EngineClient)) | set(EngineClient.__annotations__)
    root = Path(__file__).resolve().parent.parent / "jaxserve" / "entrypoints"
    used = {}
    for path in root.rglob("*.py"):
        for member in re.findall(r"async_engine\.([a-z_]+)", path.read_text()):
            used.setdefault(member, set()).add(path.name)
    undeclared = {m: files for m, files in used.items() if m not in declared and m != "py"}  # (py: the module's name)
    assert undeclared == {"control": {"rollout_routes.py"}}, undeclared
    source = (root / "openai" / "rollout_routes.py").read_text()
    assert "data_parallel_size > 1" in source, "the rollout routes must refuse data parallelism"


def test_rollout_endpoints_with_data_parallelism_are_refused_at_start_naming_both():
    import asyncio

    from jaxserve.config import EngineConfig
    from jaxserve.entrypoints.openai.http_server import HttpSettings
    from jaxserve.entrypoints.serve import serve

    with pytest.raises(ValueError, match="enable_rollout_endpoints.*data_parallel_size 2"):
        asyncio.run(serve(EngineConfig(), "127.0.0.1", 0, 1.0,
                          http=HttpSettings(enable_rollout_endpoints=True),
                          data_parallel_size=2))
