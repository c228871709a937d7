"""XLA's CPU compute threads run below the host loop's priority (runner/cpu_threads.py)."""

import os
import sys

import jax.numpy as jnp
import pytest

from jaxserve.config import EngineConfig
from jaxserve.runner.cpu_threads import XLA_CPU_THREAD_NAME, lower_xla_cpu_threads

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="threads are found in /proc (Linux only)")


def _xla_threads():
    tasks = "/proc/self/task"
    return [int(t) for t in os.listdir(tasks)
            if open(f"{tasks}/{t}/comm").read().strip() == XLA_CPU_THREAD_NAME]


def test_xla_compute_threads_get_the_increment_and_this_thread_keeps_its_priority():
    x = jnp.ones((256, 256))
    (x @ x).block_until_ready()  # the CPU client and its pool exist
    threads = _xla_threads()
    assert threads, "XLA's CPU client names its compute threads differently now"
    own = os.getpriority(os.PRIO_PROCESS, 0)
    increment = EngineConfig().runner.xla_cpu_nice  # what every engine in this process applies
    assert lower_xla_cpu_threads(increment) == len(threads)
    assert {os.getpriority(os.PRIO_PROCESS, t) for t in threads} == {own + increment}
    assert os.getpriority(os.PRIO_PROCESS, 0) == own
    assert lower_xla_cpu_threads(increment) == len(threads)  # again: nothing to change


def test_nothing_is_touched_without_xla_threads_or_an_increment(tmp_path):
    (tmp_path / str(os.getpid())).mkdir()
    (tmp_path / str(os.getpid()) / "comm").write_text("python\n")
    assert lower_xla_cpu_threads(10, tasks=tmp_path) == 0
    assert lower_xla_cpu_threads(0) == 0
    assert lower_xla_cpu_threads(10, tasks=tmp_path / "missing") == 0


def test_the_setting_is_checked():
    with pytest.raises(ValueError, match=r"xla_cpu_nice=20 .*\[0, 19\]"):
        EngineConfig.from_kwargs(xla_cpu_nice=20)
