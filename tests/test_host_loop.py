"""The host loop's plumbing: StepLauncher (where and in what order steps are launched) and the
serving loops' heap settings (engine.frozen_heap). No model, no device."""

import gc
import threading

import pytest

from jaxserve.engine.engine import SERVING_GEN0_THRESHOLD, frozen_heap
from jaxserve.runner.launcher import StepLauncher


class FakeOut:
    """A step output: ready or still computing."""

    def __init__(self, ready: bool):
        self.ready = ready

    def is_ready(self) -> bool:
        return self.ready


@pytest.fixture
def launcher():
    launcher = StepLauncher()
    yield launcher
    launcher.shutdown()


def launch(launcher, out, log, name):
    def fn():
        log.append((name, threading.get_ident()))
        return out
    return launcher.submit(fn)


def test_first_and_after_ready_steps_go_to_the_launcher_thread(launcher):
    log = []
    launch(launcher, (FakeOut(True), None), log, "a").result()
    launch(launcher, None, log, "b").result()       # after a finished step
    launch(launcher, FakeOut(False), log, "c").result()  # after a swap-only launch (None)
    assert [name for name, _ in log] == ["a", "b", "c"]
    assert all(ident != threading.get_ident() for _, ident in log)
    assert launcher.num_here == 0


def test_a_step_behind_a_computing_one_launches_from_the_caller(launcher):
    log = []
    first = FakeOut(False)
    launch(launcher, (first, None), log, "a").result()
    launch(launcher, (FakeOut(False), None), log, "b")  # queued behind a: launched here
    assert log[-1] == ("b", threading.get_ident()) and launcher.num_here == 1
    launch(launcher, FakeOut(True), log, "c")
    launch(launcher, FakeOut(False), log, "d").result()  # c had finished: the thread again
    assert log[-1][0] == "d" and log[-1][1] != threading.get_ident()
    assert [name for name, _ in log] == ["a", "b", "c", "d"]


def test_a_launch_still_running_keeps_the_order(launcher):
    """While the launcher thread is in a launch, the next one queues behind it there."""
    log, release = [], threading.Event()

    def slow():
        release.wait(5)
        log.append("slow")
        return FakeOut(False)
    pending = launcher.submit(slow)
    after = launch(launcher, FakeOut(False), log, "next")
    release.set()
    pending.result()
    after.result()
    assert log[0] == "slow" and log[1][0] == "next" and log[1][1] != threading.get_ident()


def test_a_failed_launch_reaches_the_caller_and_the_next_goes_to_the_thread(launcher):
    log = []
    launch(launcher, FakeOut(False), log, "a").result()

    def fails():
        raise RuntimeError("bad inputs")
    failed = launcher.submit(fails)  # launched here (a computes), the error kept
    with pytest.raises(RuntimeError, match="bad inputs"):
        failed.result()
    launch(launcher, FakeOut(False), log, "b").result()
    assert log[-1][1] != threading.get_ident()
    launcher.drain()


def test_frozen_heap_raises_the_young_threshold_and_restores_it():
    before = gc.get_threshold()
    frozen = gc.get_freeze_count()
    with frozen_heap():
        assert gc.get_threshold()[0] == max(before[0], SERVING_GEN0_THRESHOLD)
        assert gc.get_threshold()[1:] == before[1:]
        assert gc.get_freeze_count() > frozen
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == frozen
