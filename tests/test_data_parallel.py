"""`jaxserve serve --data-parallel-size 2` on the CPU with a tiny model: one server process (two
rank processes behind it) shared by every check, the last of which kills a rank.

Checks: greedy tokens equal one engine's for 64 mixed requests, and both ranks served some;
shared-prefix requests land on the rank holding the prefix (prefix-cache hit tokens and hit
rate at least one engine's on the same sequence; both printed); per-rank gauges on /metrics;
a killed rank's in-flight requests fail with an error naming it, its health NOT_SERVING (gRPC
service data_parallel_rank_1, /health's data_parallel_ranks) while the server and the other
rank keep serving; each rank publishes its KV events on its own port (the wildcard endpoint's
port plus the rank) with its rank in every batch, and its vllm:* metrics say engine=<rank>.
A rank whose engine cannot start fails the server with that rank's error.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
import zmq

from scale_out_fixtures import LEAN_ENGINE, engine_flags, free_port, mixed_requests, \
    save_tiny_checkpoint

from jaxserve import SamplingParams
from jaxserve.engine.kv_events import decode_batch
from jaxserve.entrypoints.grpc.client import JaxServeClient

GREEDY = dict(temperature=0.0, ignore_eos=True)
SERVED_NAME = "tiny-served"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("dp") / "tiny")


@pytest.fixture(scope="module")
def one_engine(checkpoint):
    from jaxserve import LLM

    llm = LLM(str(checkpoint), progress=False, **LEAN_ENGINE)
    yield llm
    llm.close()


def _port_pair() -> int:
    """A free port P whose P + 1 is free too (rank r publishes on P + r)."""
    import socket
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


def _kv_events_flag(port: int) -> list[str]:
    return ["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "zmq", '
            f'"endpoint": "tcp://*:{port}", "topic": "kv"}}']


class EventCollector:
    """SUB sockets on the ports of both ranks; every batch received, by port offset."""

    def __init__(self, port: int, num_ranks: int = 2):
        self.ctx = zmq.Context()
        self.batches: dict[int, list] = {r: [] for r in range(num_ranks)}
        self.socks = []
        for r in range(num_ranks):
            sock = self.ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(f"tcp://127.0.0.1:{port + r}")
            self.socks.append(sock)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in self.socks:
            poller.register(sock, zmq.POLLIN)
        while not self.stopped.is_set():
            for sock, _ in poller.poll(100):
                _, _, payload = sock.recv_multipart()
                self.batches[self.socks.index(sock)].append(decode_batch(payload))

    def close(self) -> None:
        self.stopped.set()
        self.thread.join()
        for sock in self.socks:
            sock.close(linger=0)
        self.ctx.term()


@pytest.fixture(scope="module")
def server(checkpoint):
    port, http_port, events_port = free_port(), free_port(), _port_pair()
    events = EventCollector(events_port)
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", str(checkpoint),
         "--data-parallel-size", "2", "--port", str(port), "--http-port", str(http_port),
         *engine_flags(LEAN_ENGINE), *_kv_events_flag(events_port),
         "--served-model-name", SERVED_NAME], stderr=subprocess.PIPE, text=True)
    lines, pids = [], {}
    for line in proc.stderr:
        lines.append(line)
        if m := re.search(r"data-parallel rank (\d+) ready: pid (\d+)", line):
            pids[int(m.group(1))] = int(m.group(2))
        if "health SERVING" in line:
            break
    else:
        proc.wait()
        pytest.fail("the server exited before serving:\n" + "".join(lines))
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    client = JaxServeClient(f"127.0.0.1:{port}", timeout=120.0)
    try:
        yield dict(client=client, http=f"http://127.0.0.1:{http_port}", pids=pids, lines=lines,
                   proc=proc, events=events)
    finally:
        client.close()
        events.close()
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        for pid in pids.values():  # a rank must not outlive its front end
            assert _wait_gone(pid), f"rank pid {pid} still runs after the server exited"


def _wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def _metric(text: str, name: str) -> dict[str, float]:
    """{rank: value} of one metric's samples on /metrics."""
    pattern = re.compile(rf'^{re.escape(name)}\{{.*data_parallel_rank="(\d+)".*\}} (\S+)$', re.M)
    return {rank: float(value) for rank, value in pattern.findall(text)}


def _settled_metrics(http: str) -> str:
    """/metrics once the ranks' stats stopped changing (they arrive every 0.2 s)."""
    previous = None
    for _ in range(100):
        text = httpx.get(http + "/metrics").text
        queries = _metric(text, "jaxserve_prefix_cache_queries_total")
        running = _metric(text, "jaxserve_num_requests_running")
        if queries == previous and not any(running.values()):
            return text
        previous = queries
        time.sleep(0.5)
    raise AssertionError("the ranks' stats never settled")


def test_greedy_tokens_equal_one_engine_for_64_mixed_requests(server, one_engine):
    prompts, params = mixed_requests(64, seed=7, max_prompt=60, max_out=24)
    expected = [out.token_ids for out in one_engine.generate(prompts, params, use_tqdm=False)]
    client = server["client"]
    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(lambda a: client.generate_text(a[0], a[1]).token_ids,
                            zip(prompts, params)))
    wrong = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    assert not wrong, f"{len(wrong)} of 64 requests differ from one engine, first {wrong[0]}"
    routed = _metric(httpx.get(server["http"] + "/metrics").text,
                     "jaxserve_data_parallel_requests_routed_total")
    assert set(routed) == {"0", "1"} and all(v > 0 for v in routed.values()), (
        f"both ranks must serve some of 64 concurrent requests: {routed}")


def _prefix_groups(num_groups: int = 4, followers: int = 3):
    """Groups of prompts sharing a 3-page prefix, each with its own 5-token tail."""
    groups = []
    for g in range(num_groups):
        prefix = [3 + (g * 37 + i * 11) % 260 for i in range(48)]
        groups.append([prefix + [5 + g, 7 + i, 9, 11, 13] for i in range(1 + followers)])
    return groups


def _hits(stats) -> tuple[int, int]:
    return stats.prefix_hit_tokens, stats.prefix_query_tokens


def test_shared_prefix_requests_land_on_the_rank_holding_the_prefix(server, one_engine):
    params = SamplingParams(max_tokens=4, **GREEDY)
    groups = _prefix_groups()
    engine = one_engine.engine
    hits0, queries0 = _hits(engine.stats)
    for leader, *followers in groups:  # each leader, then its followers together
        one_engine.generate([leader], params, use_tqdm=False)
        one_engine.generate(followers, params, use_tqdm=False)
    one_hits, one_queries = (a - b for a, b in zip(_hits(engine.stats), (hits0, queries0)))

    client, http = server["client"], server["http"]
    before = _settled_metrics(http)
    with ThreadPoolExecutor(8) as pool:
        for leader, *followers in groups:
            client.generate_text(leader, params)
            list(pool.map(lambda p: client.generate_text(p, params), followers))
    after = _settled_metrics(http)
    delta = lambda name: sum(_metric(after, name).values()) - sum(_metric(before, name).values())
    dp_hits = delta("jaxserve_prefix_cache_hits_total")
    dp_queries = delta("jaxserve_prefix_cache_queries_total")
    print(f"\nprefix-cache hits on {sum(map(len, groups))} shared-prefix requests: one engine "
          f"{one_hits}/{one_queries} tokens ({one_hits / one_queries:.3f}); data parallel 2 "
          f"{dp_hits:.0f}/{dp_queries:.0f} ({dp_hits / dp_queries:.3f})")
    assert one_hits > 0, "the workload must hit the prefix cache on one engine"
    assert dp_hits >= one_hits and dp_hits / dp_queries >= one_hits / one_queries, (
        "a follower missed its prefix: it was sent to the rank without it")


def test_metrics_report_each_rank(server):
    text = httpx.get(server["http"] + "/metrics").text
    for name in ("jaxserve_num_requests_waiting", "jaxserve_num_requests_running",
                 "jaxserve_kv_cache_usage_ratio", "jaxserve_data_parallel_rank_up",
                 "jaxserve_data_parallel_requests_in_flight"):
        assert set(_metric(text, name)) == {"0", "1"}, f"{name} must have a sample per rank"
    assert _metric(text, "jaxserve_data_parallel_rank_up") == {"0": 1.0, "1": 1.0}
    body = httpx.get(server["http"] + "/health").json()
    assert body == {"status": "serving",
                    "data_parallel_ranks": {"0": "serving", "1": "serving"}}


def test_each_rank_publishes_kv_events_on_its_own_port_with_its_rank(server):
    batches = server["events"].batches
    for rank in (0, 1):
        assert batches[rank], f"no KV-event batch arrived on rank {rank}'s port"
        ranks = {batch_rank for _, _, batch_rank in batches[rank]}
        assert ranks == {rank}, f"batches on rank {rank}'s port claim ranks {ranks}"


def test_vllm_metrics_carry_each_ranks_engine_label_and_the_served_name(server):
    text = httpx.get(server["http"] + "/metrics").text
    engines = set(re.findall(r'^vllm:num_requests_running\{[^}]*engine="(\d+)"', text, re.M))
    assert engines == {"0", "1"}, f"vllm:num_requests_running engine labels: {engines}"
    names = set(re.findall(r'^vllm:num_requests_running\{[^}]*model_name="([^"]*)"', text, re.M))
    assert names == {SERVED_NAME}, f"model_name labels {names}, not --served-model-name"


def test_reset_prefix_cache_empties_every_ranks_cache(server):
    from jaxserve.core.kv_events import AllBlocksCleared

    events = server["events"]
    before = {r: len(b) for r, b in events.batches.items()}
    response = httpx.post(server["http"] + "/reset_prefix_cache", timeout=60)
    assert response.status_code == 200, response.text
    deadline = time.monotonic() + 30
    cleared = set()
    while cleared != {0, 1} and time.monotonic() < deadline:
        cleared = {r for r, b in events.batches.items()
                   if any(isinstance(e, AllBlocksCleared) for _, evs, _ in b[before[r]:]
                          for e in evs)}
        time.sleep(0.05)
    assert cleared == {0, 1}, f"ranks that reported AllBlocksCleared: {cleared}"


def test_a_rank_that_cannot_start_fails_the_server_with_its_error(checkpoint):
    """Rank 1's KV-event port is taken: the server exits non-zero naming rank 1 and why."""
    import socket
    events_port = _port_pair()
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", events_port + 1))
        taken.listen()
        proc = subprocess.run(
            [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", str(checkpoint),
             "--data-parallel-size", "2", "--port", str(free_port()), "--http-port",
             str(free_port()), *engine_flags(LEAN_ENGINE), *_kv_events_flag(events_port)],
            stderr=subprocess.PIPE, text=True, timeout=300)
    assert proc.returncode != 0, "the server started with a rank that could not"
    assert "data-parallel rank 1 failed to start" in proc.stderr, proc.stderr[-3000:]
    assert "Address already in use" in proc.stderr, proc.stderr[-3000:]


def test_a_killed_rank_fails_its_requests_and_the_other_keeps_serving(server):
    client, http, pids = server["client"], server["http"], server["pids"]
    assert set(pids) == {0, 1}, f"both ranks' pids in the log: {pids}"
    params = SamplingParams(max_tokens=120, **GREEDY)
    prompts = [[10 + i, 20, 30, 40, 50, 60] for i in range(8)]
    first_token = threading.Barrier(len(prompts) + 1, timeout=120)
    results: list = [None] * len(prompts)

    def run(i):
        waited = False
        try:
            stream = client.generate(prompts[i], params)
            tokens = list(next(stream).token_ids)
            first_token.wait()
            waited = True
            for response in stream:
                tokens += response.token_ids
            results[i] = tokens
        except Exception as exc:  # noqa: BLE001  (the test sorts them out below)
            results[i] = exc
            if not waited:  # failed before its first token: let the others go on
                try:
                    first_token.wait()
                except threading.BrokenBarrierError:
                    pass

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    first_token.wait()  # every request is running on its rank
    os.kill(pids[1], signal.SIGKILL)
    for t in threads:
        t.join(120)
    assert None not in results, f"requests that neither ended nor failed: {results!r:.500}"
    failed = [r for r in results if isinstance(r, Exception)]
    done = [r for r in results if isinstance(r, list)]
    assert failed and done, f"requests on both ranks: {results!r:.500}"
    assert all(len(r) == 120 for r in done), "the live rank's requests run to the end"
    for exc in failed:
        assert isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.INTERNAL, exc
        assert "data-parallel rank 1" in exc.details(), f"the error must name the rank: {exc}"

    assert client.health("data_parallel_rank_1") == "NOT_SERVING"
    assert client.health("data_parallel_rank_0") == "SERVING"
    assert client.health() == "SERVING", "the server serves while one rank lives"
    response = httpx.get(http + "/health")
    assert response.status_code == 200
    assert response.json()["data_parallel_ranks"] == {"0": "serving", "1": "not_serving"}
    after = [client.generate_text([30 + i, 1, 2], SamplingParams(max_tokens=5, **GREEDY))
             for i in range(4)]
    assert all(len(r.token_ids) == 5 for r in after), "new requests go to the live rank"
    text = httpx.get(http + "/metrics").text
    assert _metric(text, "jaxserve_data_parallel_rank_up") == {"0": 1.0, "1": 0.0}
    assert set(_metric(text, "jaxserve_num_requests_running")) == {"0"}, (
        "a dead rank's families leave /metrics")
