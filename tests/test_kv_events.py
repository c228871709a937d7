"""KV-cache events without a model: the page manager's log, the wire format and the config.

A property test drives a PageManager with a host tier and a small pool (evictions to the host
and back, hash collisions, LoRA chains, resets) and rebuilds the prefix cache from its events
alone, sent through the real encoder and decoder: after every operation the rebuilt map of page
hashes (device and host, with token ids and parents) equals the page manager's. The end-to-end
check over ZeroMQ against a serving engine is test_kv_events_server.py's.
"""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxserve.config import EngineConfig
from jaxserve.config.kv_events import KVEventsConfig, parse_kv_events_config
from jaxserve.core.host_prefix_tier import HostPrefixTier
from jaxserve.core.kv_events import (MEDIUM_DEVICE, MEDIUM_HOST, AllBlocksCleared, BlockRemoved,
                                     BlockStored, KVEventLog)
from jaxserve.core.page_manager import PageManager
from jaxserve.engine.kv_events import decode_batch, encode_batch, offset_endpoint
from kv_event_view import KVCacheView, expected, parent_keys

PS, NUM_PAGES, HOST_SLOTS = 4, 12, 5
PREFIXES = ([], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 1, 2])
TOKENS = st.builds(lambda prefix, tail: prefix + tail, st.sampled_from(PREFIXES),
                   st.lists(st.integers(0, 3), max_size=9)).filter(len)


class EventMachine(RuleBasedStateMachine):
    hash_fn = None

    def __init__(self):
        super().__init__()
        self.log = KVEventLog(PS)
        self.pm = PageManager(NUM_PAGES, PS, hash_fn=self.hash_fn,
                              host_tier=HostPrefixTier(HOST_SLOTS * 8, 8), events=self.log)
        self.view = KVCacheView()
        self.tokens: dict[str, list[int]] = {}
        self.next_id = 0

    def _publish(self) -> None:
        """One step's batch, through the wire format; the runner's host copies are done."""
        self.pm.take_prefix_ops()
        events = self.log.take()
        if events:
            _, decoded, rank = decode_batch(encode_batch(1.5, events, 0))
            assert decoded == events and rank == 0
            self.view.apply(decoded)

    @rule(prompt=TOKENS, lora_id=st.sampled_from([0, 0, 3]))
    def admit_and_prefill(self, prompt, lora_id):
        self.next_id += 1
        rid = f"r{self.next_id}"
        if self.pm.allocate(rid, prompt, len(prompt), lora_id=lora_id) is not None:
            self.pm.commit(rid, prompt)
            self.tokens[rid] = prompt
        self._publish()

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new=st.lists(st.integers(0, 3), min_size=1, max_size=5))
    def decode(self, data, new):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[rid] + new
        if self.pm.append_slots(rid, len(tokens)):
            self.pm.commit(rid, tokens)
            self.tokens[rid] = tokens
        self._publish()

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.pm.free(rid)
        del self.tokens[rid]
        self._publish()

    @rule()
    def reset(self):
        self.pm.reset_prefix_cache()
        events = self.log.take()
        assert events == [AllBlocksCleared()], events
        self.view.apply(events)

    @invariant()
    def view_equals_the_prefix_cache(self):
        want = expected(self.pm)
        for medium in (MEDIUM_DEVICE, MEDIUM_HOST):
            got = {key: tokens for key, (_, tokens, _) in self.view.blocks[medium].items()}
            assert got == want[medium], f"{medium}: events say {got}, the cache holds {want}"
        device = self.view.blocks[MEDIUM_DEVICE]
        for key, parent in parent_keys(self.pm).items():
            assert device[key][0] == parent, f"page {key}: parent {device[key][0]} != {parent}"


_SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestEventsRebuildTheCache = EventMachine.TestCase
TestEventsRebuildTheCache.settings = _SETTINGS


class CollidingEventMachine(EventMachine):
    """Keys collide often: orphaned entries are replaced (removed, then stored again)."""
    hash_fn = staticmethod(lambda parent, tokens: hash((parent, tokens)) % 5)


TestEventsRebuildTheCacheUnderCollisions = CollidingEventMachine.TestCase
TestEventsRebuildTheCacheUnderCollisions.settings = _SETTINGS


def test_a_chain_of_new_pages_is_one_block_stored_and_removals_share_one_event():
    log = KVEventLog(2)
    log.stored(10, None, (1, 2), 0)
    log.stored(11, 10, (3, 4), 0)
    log.stored(20, None, (5, 6), 7)  # another chain (and adapter): a new event
    log.removed(10)
    log.removed(11)
    log.removed(20, MEDIUM_HOST)
    assert log.take() == [BlockStored([10, 11], None, [1, 2, 3, 4], 2, None, MEDIUM_DEVICE),
                          BlockStored([20], None, [5, 6], 2, 7, MEDIUM_DEVICE),
                          BlockRemoved([10, 11], MEDIUM_DEVICE),
                          BlockRemoved([20], MEDIUM_HOST)]
    assert log.take() == []


def test_the_wire_format_is_vllms_array_like_msgpack_with_the_tag_first():
    events = [BlockStored([2**64 - 1, 5], None, [1, 2, 3, 4], 2, None, "GPU"),
              BlockRemoved([7], "CPU"), AllBlocksCleared()]
    assert msgpack.unpackb(encode_batch(12.5, events, 3)) == [
        12.5, [["BlockStored", [2**64 - 1, 5], None, [1, 2, 3, 4], 2, None, "GPU"],
               ["BlockRemoved", [7], "CPU"], ["AllBlocksCleared"]], 3]
    # A newer vLLM's trailing fields (lora_name, extra_keys, ...) are ignored when decoding.
    newer = msgpack.packb([1.0, [["BlockStored", [1], 9, [4, 4], 2, 3, "GPU", "ad", None]]])
    assert decode_batch(newer) == (1.0, [BlockStored([1], 9, [4, 4], 2, 3, "GPU")], None)


def test_kv_events_config_reads_vllms_json_and_names_a_bad_key():
    config = parse_kv_events_config('{"enable_kv_cache_events": true, "endpoint": '
                                    '"tcp://*:6000", "replay_endpoint": "tcp://*:6001", '
                                    '"topic": "kv", "buffer_steps": 4}')
    assert config == KVEventsConfig(True, None, "tcp://*:6000", "tcp://*:6001", 4, topic="kv")
    assert config.enabled and config.resolved_publisher == "zmq"
    assert not parse_kv_events_config(None).enabled
    assert not parse_kv_events_config({"enable_kv_cache_events": True,
                                       "publisher": "null"}).enabled
    for bad, named in (("{", "not valid JSON"), ('{"hwm": -1}', "hwm=-1"),
                       ('{"buffer_steps": 0}', "buffer_steps=0"), ('{"port": 1}', "port"),
                       ('{"publisher": "kafka"}', "publisher='kafka'"),
                       ('{"endpoint": "localhost:5557"}', "endpoint='localhost:5557'"),
                       ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events")):
        with pytest.raises(ValueError, match="kv_events_config") as err:
            EngineConfig.from_kwargs(kv_events_config=bad)
        assert named in str(err.value), str(err.value)


def test_data_parallel_ranks_publish_on_offset_ports():
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert offset_endpoint(None, 1) is None
