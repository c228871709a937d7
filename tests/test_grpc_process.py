"""The gRPC server as a process: `run_server` through tests/grpc_server_main.py.

Start-up (health NOT_SERVING while the engine loads and compiles, then SERVING), SIGTERM
draining and the exit code; and that the checked-in generated code is current. The process uses
conftest.SMALL_ENGINE shapes, so its warm-up hits the session's compile cache.
"""

from __future__ import annotations

import concurrent.futures
import re
import runpy
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from jaxserve import SamplingParams
from jaxserve.entrypoints.grpc.client import JaxServeClient, JaxServeError
from jaxserve.entrypoints.grpc.pb import jaxserve_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent
GREEDY = dict(temperature=0.0, ignore_eos=True)


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def health_or_unavailable(client: JaxServeClient, service: str = "") -> str:
    try:
        return client.health(service)
    except JaxServeError as exc:
        return exc.code.name


@pytest.fixture(scope="module")
def server_process():
    """A `run_server` process; records the health statuses seen while it started."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "grpc_server_main.py"),
                             "--port", "0", "--shutdown-timeout", "30", "--metrics-port", "0"],
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        match = re.search(r"listening on (\S+:\d+)", line)
        if match:
            break
    else:
        pytest.fail(f"server process exited before listening:\n{''.join(lines)}")
    def drain():  # keep reading stderr (never let it block the server); lines grow as it logs
        for line in proc.stderr:
            lines.append(line)
        return lines

    reader = concurrent.futures.ThreadPoolExecutor(1)
    log = reader.submit(drain)
    client = JaxServeClient(match.group(1), timeout=60.0)
    seen, early_call = [], None
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and (not seen or seen[-1] != "SERVING"):
        status = health_or_unavailable(client)
        if not seen or seen[-1] != status:
            seen.append(status)
        if status == "NOT_SERVING" and early_call is None:
            with pytest.raises(JaxServeError) as early_call:
                client.generate_text("too early")
        time.sleep(0.02)
    yield SimpleNamespace(proc=proc, client=client, health_seen=seen, log=log, lines=lines,
                          early_call=early_call and early_call.value)
    client.close()
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    reader.shutdown()


def test_health_goes_not_serving_then_serving_around_warm_up(server_process):
    assert server_process.health_seen == ["NOT_SERVING", "SERVING"], server_process.health_seen
    assert server_process.early_call.code == grpc.StatusCode.UNAVAILABLE, "call while loading"
    assert health_or_unavailable(server_process.client, "jaxserve.v1.JaxServe") == "SERVING"


def test_metrics_port_serves_what_the_server_did(server_process):
    server_process.client.generate_text("count me", SamplingParams(max_tokens=3, **GREEDY))
    urls = [m.group(1) for line in list(server_process.lines)
            if (m := re.search(r"Prometheus metrics on (\S+/metrics)", line))]
    assert urls, "the server logged no metrics address"
    with urllib.request.urlopen(urls[0], timeout=10) as response:
        text = response.read().decode()
    # The one request that reached the engine (the early call was refused while loading).
    assert 'jaxserve_requests_finished_total{finish_reason="length"} 1.0' in text, text
    assert "jaxserve_generation_tokens_total 3.0" in text, text


def test_sigterm_drains_8_in_flight_requests_refuses_new_ones_and_exits_0(server_process):
    client, proc = server_process.client, server_process.proc
    params = SamplingParams(max_tokens=200, **GREEDY)
    calls = [client.generate(f"in flight {i}", params) for i in range(8)]
    firsts = [next(call) for call in calls]  # every one is running in the engine
    proc.terminate()
    wait_for(lambda: health_or_unavailable(client) != "SERVING")
    with pytest.raises(JaxServeError) as info:
        client.generate_text("too late", params)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE, info.value
    for i, (first, call) in enumerate(zip(firsts, calls)):
        rest = list(call)
        num_tokens = len(first.token_ids) + sum(len(r.token_ids) for r in rest)
        assert (num_tokens, rest[-1].finish_reason) == (200, pb.FINISH_REASON_LENGTH), i
    exit_code = proc.wait(timeout=30)
    log = "".join(server_process.log.result(timeout=5))
    assert exit_code == 0 and "draining 8 in-flight request(s)" in log, log[-3000:]


# ---- generated code -----------------------------------------------------------------------------
def test_checked_in_generated_code_is_what_gen_protos_makes(tmp_path):
    pytest.importorskip("grpc_tools")
    from importlib.metadata import version

    from jaxserve.entrypoints.grpc.pb import jaxserve_pb2_grpc as checked_in

    if version("grpcio-tools") != checked_in.GRPC_GENERATED_VERSION:
        pytest.skip(f"grpcio-tools {version('grpcio-tools')} is not the one that made the "
                    f"checked-in code ({checked_in.GRPC_GENERATED_VERSION})")
    generate = runpy.run_path(str(ROOT / "scripts" / "gen_protos.py"))["generate"]
    for path in generate(tmp_path):
        old = ROOT / "jaxserve" / "entrypoints" / "grpc" / "pb" / path.name
        assert path.read_text() == old.read_text(), f"{old} is stale: run scripts/gen_protos.py"
