"""Stage functions for the staged runner's tests (jaxserve/bench/stage_runner.py): each runs in
the runner's child process, so they live in a module the child can import, and touch no
device."""

from __future__ import annotations

import os
import time


def records_one_row(rec, config):
    rec.row("fine", f"config {config.get('value')}", "OK")


def raises(rec, config):
    rec.row("before the exception", "recorded", "OK")
    raise RuntimeError("the stage broke on purpose")


def hangs(rec, config):
    rec.row("before the hang", "recorded", "OK")
    while True:  # ignores its deadline: only the runner's budget can stop it
        time.sleep(0.1)


def exits_without_a_row(rec, config):
    os._exit(3)
