"""scripts/soak.py, reduced, against a real server: 300 requests (greedy ones checked against their
solo runs, cancels, tiny deadlines, hypothesis-drawn invalid inputs), then SIGTERM.

One server process (tests/grpc_server_main.py, the tiny model) with a KV pool of 23 pages and
swap space for 3 of them, so requests are preempted both ways: swapped when they fit the swap
space, recomputed when they do not. The soak runs once for the module; each test reads one of
its checks, so a failure names the behaviour that broke.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from grpc_server_main import server_process

ROOT = Path(__file__).resolve().parent.parent
PAGE_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # tiny model: layers x (K, V) x page x kv heads x dim x f32


def load_soak():
    spec = importlib.util.spec_from_file_location("soak", ROOT / "scripts" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("soak", module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def soaked():
    soak = load_soak()
    server_args = ("--num-pages", "24", "--preemption-mode", "swap", "--swap-space",
                   str(3 * PAGE_BYTES), "--metrics-port", "0", "--shutdown-timeout", "30")
    with server_process(*server_args) as server:
        args = soak.parse_args([
            "--address", server.address, "--metrics-url", server.metrics_url,
            "--requests", "300", "--distinct-greedy", "12", "--max-tokens", "40",
            "--seed", "20", "--sigterm-pid", str(server.proc.pid), "--expect-preemption",
            "--hang-seconds", "60"])
        checks = soak.Soak(args).run()
        exit_code = server.proc.wait(timeout=60)
    table = soak.table(checks)
    print(table)
    return SimpleNamespace(checks={c.name.split(":")[0]: c for c in checks}, table=table,
                           exit_code=exit_code, log=server.log)


def passed(soaked, prefix: str) -> bool:
    matches = [c for name, c in soaked.checks.items() if name.startswith(prefix)]
    assert len(matches) == 1, f"no one check named {prefix!r}: {list(soaked.checks)}"
    return matches[0].status == "PASS"


def test_every_greedy_output_equals_its_solo_run_under_preemption(soaked):
    assert passed(soaked, "greedy outputs"), soaked.table


def test_both_preemption_modes_happened(soaked):
    assert passed(soaked, "preemption happened"), soaked.table


def test_every_invalid_input_is_invalid_argument_or_resource_exhausted(soaked):
    assert passed(soaked, "invalid inputs"), soaked.table


def test_no_call_ends_internal_or_unknown(soaked):
    assert passed(soaked, "no call ends"), soaked.table


def test_no_stream_hangs(soaked):
    assert passed(soaked, "no hung stream"), soaked.table


def test_cancels_and_tiny_deadlines_end_cleanly(soaked):
    assert passed(soaked, "cancelled streams"), soaked.table
    assert passed(soaked, "tiny deadlines"), soaked.table


def test_the_server_is_idle_with_every_page_free_afterwards(soaked):
    assert passed(soaked, "idle afterwards"), soaked.table


def test_sigterm_refuses_new_calls_drains_and_exits_0(soaked):
    assert passed(soaked, "SIGTERM"), soaked.table
    assert soaked.exit_code == 0, soaked.log[-3000:]
    assert "Traceback" not in soaked.log, soaked.log[-3000:]


def test_a_stop_string_completed_by_the_last_allowed_token_finishes_stop(soaked):
    assert passed(soaked, "a stop string"), soaked.table
