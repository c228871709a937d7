"""Multi-host serving: a two-process JAX cluster on localhost (CPU, one device per process).

Both processes run `jaxserve serve` on the tiny checkpoint with tensor_parallel_size 2 across
the two processes: process 0 schedules, serves gRPC and broadcasts each plan; process 1 runs
the same steps. Its greedy tokens must equal a one-process engine's. If this JAX cannot run
multi-process collectives on the CPU, the test is skipped with the exact error.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from scale_out_fixtures import (LEAN_ENGINE, engine_flags, free_port, mixed_requests,
                                save_tiny_checkpoint)

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "JAX_PLATFORMS": "cpu",
       "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
PROBE = """
import sys, jax, numpy as np
jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
from jax.experimental import multihost_utils
print(int(multihost_utils.broadcast_one_to_all(np.int32(7 + jax.process_index()))))
"""


def _two_processes(args_for):
    return [subprocess.Popen(args_for(i), cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for i in range(2)]


@pytest.fixture(scope="module")
def cpu_collectives():
    """Skip, with the exact error, when two CPU processes cannot broadcast to each other."""
    address = f"127.0.0.1:{free_port()}"
    procs = _two_processes(lambda i: [sys.executable, "-c", PROBE, address, str(i)])
    results = [p.communicate(timeout=120) for p in procs]
    printed = [(r[0].strip().splitlines() or [""])[-1] for r in results]  # Gloo logs first
    if any(p.returncode != 0 for p in procs) or printed != ["7", "7"]:
        errors = [(r[1].strip().splitlines() or [f"printed {r[0][-200:]!r}"])[-1]
                  for r in results]
        pytest.skip(f"CPU multi-process collectives do not work in this JAX: {errors}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("multihost") / "tiny")


def test_two_process_cluster_serves_the_same_greedy_tokens_as_one_process(cpu_collectives,
                                                                            checkpoint):
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.entrypoints.grpc.client import JaxServeClient

    prompts, params = mixed_requests(n=16, seed=5, max_out=12)
    address = f"127.0.0.1:{free_port()}"
    procs = _two_processes(lambda i: [
        sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", "--model", str(checkpoint),
        "--coordinator-address", address, "--num-processes", "2", "--process-id", str(i),
        "--tensor-parallel-size", "2", "--port", "0", "--shutdown-timeout", "5",
        *engine_flags(LEAN_ENGINE)])
    readers = concurrent.futures.ThreadPoolExecutor(2)  # keep draining both logs
    follower_log = readers.submit(procs[1].communicate, timeout=600)
    try:
        lines = []
        for line in procs[0].stderr:
            lines.append(line)
            match = re.search(r"listening on (\S+:\d+)", line)
            if match:
                break
        else:
            pytest.fail(f"process 0 exited before listening:\n{''.join(lines)[-4000:]}")
        leader_log = readers.submit(lambda: lines + list(procs[0].stderr))
        with JaxServeClient(match.group(1), timeout=300) as client:
            deadline = time.monotonic() + 300
            while _health(client) != "SERVING" and procs[0].poll() is None:
                assert time.monotonic() < deadline, "the cluster never became SERVING"
                time.sleep(0.2)
            with concurrent.futures.ThreadPoolExecutor(8) as callers:  # steps batch requests
                results = list(callers.map(lambda a: client.generate_text(*a).token_ids,
                                           zip(prompts, params)))
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(60) == 0, "".join(leader_log.result())[-4000:]
        assert procs[1].wait(60) == 0, f"process 1 did not stop: {follower_log.result()[1][-4000:]}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        readers.shutdown(wait=False, cancel_futures=True)
    assert "following process 0" in follower_log.result()[1], follower_log.result()[1][-2000:]
    single = LLM(str(checkpoint), progress=False, **LEAN_ENGINE)
    want = [o.token_ids for o in single.generate(prompts, params, use_tqdm=False)]
    differ = [i for i, (a, b) in enumerate(zip(want, results)) if a != b]
    assert not differ, f"requests {differ} differ from one process: {results[differ[0]]} vs " \
                       f"{want[differ[0]]}"


def _health(client) -> str:
    from jaxserve.entrypoints.grpc.client import JaxServeError
    try:
        return client.health()
    except JaxServeError as exc:
        return exc.code.name


# ---- the plan channel and the leader/follower runners, in one process -----------------------

def _plan(n: int):
    from jaxserve.core.plan import PageUpdate, SamplingRow, ScheduledChunk, StepPlan, SwapIn

    row = SamplingRow(temperature=0.5, top_k=3, top_p=0.9, min_p=0.0, seed=n)
    chunk = ScheduledChunk(f"r{n}", tuple(range(3, 3 + 200 * n)), 0, PageUpdate.whole((1, 2)),
                           row, output_index=1)
    return StepPlan(chunks=[chunk], swap_in=[SwapIn("s", (4,))], dropped_swaps=["d"])


def _linked_channels():
    """A leader and a follower PlanChannel joined by a fake broadcast that, like the real one,
    requires both sides to pass arrays of one shape and dtype."""
    from jaxserve.runner.multihost import PlanChannel

    wire = []

    def follower_side(array):
        sent = wire.pop(0)
        assert (sent.shape, sent.dtype) == (array.shape, array.dtype), "collective mismatch"
        return sent

    return PlanChannel(lambda a: wire.append(a.copy()) or a), PlanChannel(follower_side), wire


def test_plans_pings_and_stop_reach_the_follower_in_order():
    leader, follower, wire = _linked_channels()
    first, second = _plan(1), _plan(9)  # 9: a payload over the smallest bucket
    leader.send(first)
    leader.ping()
    leader.send(second)
    leader.send(None)
    assert follower.receive() == first and follower.receive() == second
    assert follower.receive() is None and not wire


class _Recorder:
    def __init__(self):
        self.plans, self.pings = [], 0

    def send(self, plan):
        self.plans.append(plan)

    def ping(self):
        self.pings += 1


def test_leader_sends_plans_that_touch_the_runner_and_pings_while_idle():
    from jaxserve.core.plan import StepPlan
    from jaxserve.runner.multihost import LeaderRunner

    ran, closed, channel = [], [], _Recorder()
    leader = LeaderRunner(type("R", (), {"execute": lambda self, p: ran.append(p),
                                         "buckets": "table", "num_host_swapped": 3,
                                         "close": lambda self: closed.append(True)})(),
                          channel, keepalive_s=0.05)
    empty, busy = StepPlan(), _plan(1)
    leader.execute(empty)
    leader.execute(busy)
    assert ran == [empty, busy] and channel.plans == [busy], "empty plans stay on process 0"
    assert (leader.buckets, leader.num_host_swapped) == ("table", 3), "Runner members delegate"
    deadline = time.monotonic() + 5
    while channel.pings < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert channel.pings >= 2, "an idle leader must keep the followers' collective alive"
    leader.close()
    leader.close()
    assert channel.plans[-1] is None and channel.plans.count(None) == 1, "close sends stop once"
    assert closed, "closing the leader closes the runner it leads"
    with pytest.raises(RuntimeError, match="stopped"):
        leader.execute(busy)


def test_every_runner_implements_the_declared_protocol():
    from jaxserve.runner.model_runner import ModelRunner
    from jaxserve.runner.multihost import FollowerRunner, LeaderRunner
    from jaxserve.runner.protocol import Runner
    from jaxserve.spec.runner import SpeculativeRunner

    members = {n for n in dir(Runner) if not n.startswith("_")} | set(Runner.__annotations__)
    assert {"warmup", "dispatch", "collect", "execute", "wait", "close", "num_host_swapped",
            "buckets", "timings", "can_overlap", "rollout_memory"} <= members
    for cls in (ModelRunner, SpeculativeRunner, LeaderRunner, FollowerRunner):
        assert not hasattr(cls, "__getattr__"), f"{cls.__name__} must not forward implicitly"
        # buckets is an instance attribute of the model and speculative runners
        missing = [n for n in members - {"buckets"} if not hasattr(cls, n)]
        assert not missing, f"{cls.__name__} lacks {missing}"


@pytest.mark.parametrize("cls_path, words", [
    ("jaxserve.spec.runner.SpeculativeRunner", "speculative decoding"),
    ("jaxserve.runner.multihost.LeaderRunner", "several JAX processes"),
    ("jaxserve.runner.multihost.FollowerRunner", "several JAX processes")])
def test_runners_without_rollout_verbs_say_why(cls_path, words):
    import importlib

    module, name = cls_path.rsplit(".", 1)
    runner = object.__new__(getattr(importlib.import_module(module), name))
    with pytest.raises(NotImplementedError, match=words):
        runner.rollout_memory()


def test_follower_runs_every_plan_until_stop_and_never_schedules():
    from jaxserve.runner.multihost import FollowerRunner

    leader, follower_channel, _ = _linked_channels()
    plans = [_plan(1), _plan(2)]
    for plan in plans:
        leader.send(plan)
    leader.send(None)
    ran = []
    follower = FollowerRunner(type("R", (), {"execute": lambda self, p: ran.append(p)})(),
                              follower_channel)
    assert follower.follow() == 2 and ran == plans
    with pytest.raises(RuntimeError, match="only process 0 schedules"):
        follower.execute(plans[0])


def test_a_plan_that_only_frees_rows_reaches_the_followers():
    """Every process keeps the same request -> row mapping (runner/batch_rows.py)."""
    from jaxserve.core.plan import StepPlan
    from jaxserve.runner.multihost import _touches_runner

    assert _touches_runner(StepPlan(released=["a"])), (
        "followers would keep a finished request's row while process 0 hands it out")
