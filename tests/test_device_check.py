"""The device checks' shared parts (jaxserve/bench/device_check.py) on the CPU with a tiny model,
and scripts/tpu_check.py refusing to run without a TPU unless --allow-cpu."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from jaxserve.bench import device_check

ROOT = Path(__file__).resolve().parent.parent


def test_agreement_counts_tokens_before_the_first_divergence():
    want = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert device_check.agreement(want, want) == 1.0
    assert device_check.agreement([[1, 2, 9, 4], [5, 6, 7, 8]], want) == 6 / 8
    assert device_check.agreement([[9, 2, 3, 4], [9, 6, 7, 8]], want) == 0.0


def test_roofline_bound_reads_weights_once_and_each_requests_kv():
    # 1 GB of weights, 1 KB of KV per token, 1000 tokens of context, 1000 GB/s
    assert device_check.decode_bound_tokens_per_s(1, 10**9, 1000, 1000, 1000) == pytest.approx(
        1 / (1.001e9 / 1e12))
    assert device_check.decode_bound_tokens_per_s(64, 10**9, 1000, 1000, 1000) == pytest.approx(
        64 / (1.064e9 / 1e12))


def test_decode_rates_report_speed_compile_time_and_bound_in_one_table():
    from tiny_models import tiny_loaded

    rates = device_check.decode_rates(tiny_loaded(), [2], steps=2, prompt_len=8,
                                      bandwidth_gbs=100.0)
    (rate,) = rates
    assert rate["n"] == 2 and rate["tokens_per_s"] > 0 and rate["compile_s"] > 0
    assert rate["bound_tokens_per_s"] > 0
    text = device_check.table([("device", "cpu", "")] + device_check.decode_rows(rates))
    assert "decode N=2" in text and "% of roofline" in text and "compile N=2" in text


def test_tpu_check_needs_a_tpu_or_allow_cpu(capsys):
    spec = importlib.util.spec_from_file_location("tpu_check", ROOT / "scripts" / "tpu_check.py")
    tpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tpu_check)
    assert tpu_check.main([]) == 2
    assert "no TPU" in capsys.readouterr().err
