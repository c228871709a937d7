"""The rollout API under tensor parallelism 2 on fake CPU devices (tests/tp_rollout_check.py in
a subprocess): after update_weights the tokens are a fresh engine's, float32 and int8 (the new
weights quantized as the loader does); nothing compiles; device bytes are the same after the
update, and sleep frees the KV pool and the weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp") / "report.json"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    script = Path(__file__).resolve().parent / "tp_rollout_check.py"
    run = subprocess.run([sys.executable, str(script), str(out)], env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("mode", ["none", "int8"])
def test_tp2_update_sleep_and_wake_give_a_fresh_engines_tokens(report, mode):
    r = report[mode]
    assert r["devices"] == 2
    assert r["updated"] == r["want"], "update_weights under TP 2 changed the tokens"
    assert r["updated"] != r["before"]
    assert r["woke1"] == r["want"] and r["woke2"] == r["want"], "wake_up changed the tokens"
    assert r["compiles"] == 0, f"{r['compiles']} compilations across update, sleep and wake"
    assert r["bytes_after"] == r["bytes_before"], "device bytes changed across the update"
    freed = r["kv_bytes"] + r["weight_bytes"]
    assert r["bytes_before"] - r["bytes_asleep1"] >= freed - 4096
    assert r["bytes_before"] - r["bytes_asleep2"] >= freed - 4096
