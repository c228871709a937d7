"""scripts/tpu/: every script's --dry-run prints the commands it would run (and runs none), and
shellcheck passes on all of them.

A fake `gcloud` first on PATH records any call, so a dry run that ran gcloud would fail here.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TPU = ROOT / "scripts" / "tpu"
SCRIPTS = sorted(TPU.glob("*.sh"))
SETTINGS = ("TPU_NAME", "ZONE", "PROJECT", "ACCELERATOR_TYPE", "RUNTIME_VERSION", "PORT",
            "DRY_RUN", "MODEL", "TENSOR_PARALLEL_SIZE", "MULTIHOST", "JAXSERVE_SOURCE")
VM = ["--name", "t1", "--zone", "europe-west4-b", "--project", "proj"]
WHERE = ["--zone=europe-west4-b", "--project=proj"]


def dry_run(tmp_path, script: str, *args: str, env: dict | None = None) -> list[list[str]]:
    """The commands `script --dry-run args` prints, each as its argv."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir(exist_ok=True)
    calls = tmp_path / "gcloud-calls"
    (fake_bin / "gcloud").write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n")
    (fake_bin / "gcloud").chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    proc = subprocess.run([str(TPU / script), "--dry-run", *args], capture_output=True, text=True,
                          env={**clean, "PATH": f"{fake_bin}:{clean['PATH']}", **(env or {})},
                          cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert not calls.exists(), f"a dry run called gcloud: {calls.read_text()}"
    commands, pending = [], ""
    for line in proc.stdout.splitlines():
        pending += line + "\n"
        try:
            commands.append(shlex.split(pending))
        except ValueError:  # an open quote: the command goes on over the next line
            continue
        pending = ""
    assert not pending, f"unterminated command: {pending}"
    return commands


def remote(command: list[str]) -> str:
    """The shell command of a `gcloud ... ssh --command=...`."""
    return next(a for a in command if a.startswith("--command=")).removeprefix("--command=")


def test_create_prints_the_tpu_vm_create_command(tmp_path):
    [create] = dry_run(tmp_path, "create_vm.sh", *VM, "--accelerator-type", "v5litepod-16",
                       "--version", "v2-alpha-tpuv5-lite", "--spot")
    assert create == ["gcloud", "compute", "tpus", "tpu-vm", "create", "t1",
                      "--accelerator-type=v5litepod-16", "--version=v2-alpha-tpuv5-lite",
                      "--spot", *WHERE]


def test_settings_come_from_the_environment_when_no_flag_is_given(tmp_path):
    [create] = dry_run(tmp_path, "create_vm.sh", env={"TPU_NAME": "envtpu", "ZONE": "z1",
                                                      "ACCELERATOR_TYPE": "v6e-8"})
    assert create[5] == "envtpu" and "--zone=z1" in create
    assert "--accelerator-type=v6e-8" in create and not any("--project" in a for a in create)


def test_install_ships_this_checkout_and_installs_jax_tpu_on_every_worker(tmp_path):
    archive, scp, ssh = dry_run(tmp_path, "install.sh", *VM)
    assert archive[:4] == ["git", "-C", str(ROOT), "archive"] and archive[-1] == "HEAD"
    assert scp[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "scp", archive[5][len("--output="):]]
    assert "--worker=all" in scp and "--worker=all" in ssh
    steps = remote(ssh).split(" && ")
    assert "python3 -m pip install --upgrade 'jax[tpu]'" in steps
    assert "python3 -m pip install --upgrade ~/jaxserve" in steps


def test_install_from_git(tmp_path):
    [ssh] = dry_run(tmp_path, "install.sh", *VM, "--source", "git", "--git-url",
                    "https://example.com/jaxserve.git", "--git-ref", "v0.1.0")
    assert "'jaxserve @ git+https://example.com/jaxserve.git@v0.1.0'" in remote(ssh)


def test_model_fetches_from_cloud_storage_and_converts(tmp_path):
    fetch, convert = dry_run(tmp_path, "model.sh", *VM, "--from", "gs://bucket/llama-hf/",
                             "--convert")
    assert "gcloud storage cp --recursive gs://bucket/llama-hf/ models/" in remote(fetch)
    assert remote(convert) == "python3 -m jaxserve.entrypoints.cli convert models/llama-hf " \
                              "models/llama-hf-jaxserve"
    assert "--worker=all" in fetch and "--worker=all" in convert


def test_model_copies_a_local_directory_to_every_worker(tmp_path):
    (tmp_path / "tiny").mkdir()
    mkdir, scp = dry_run(tmp_path, "model.sh", *VM, "--from", str(tmp_path / "tiny"))
    assert remote(mkdir) == "mkdir -p models"
    assert scp[4:8] == ["scp", "--recurse", str(tmp_path / "tiny"), "t1:models/"]


def test_serve_starts_every_host_of_a_slice_and_waits_on_process_0(tmp_path):
    start, wait = dry_run(tmp_path, "serve.sh", *VM, "--model", "models/llama-jaxserve",
                          "--tensor-parallel-size", "16", "--multihost", "--port", "9000",
                          "--", "--max-num-seqs", "64")
    assert "--worker=all" in start and "--worker=0" in wait
    serve = shlex.split(remote(start).split(">")[0].removeprefix("nohup "))
    assert serve == ["python3", "-m", "jaxserve.entrypoints.cli", "serve", "--model", "models/llama-jaxserve",
                     "--host", "0.0.0.0", "--port", "9000", "--tensor-parallel-size", "16",
                     "--distributed", "auto", "--max-num-seqs", "64"]
    assert 'JaxServeClient("127.0.0.1:9000")' in remote(wait)


def test_serve_on_one_host_joins_no_cluster(tmp_path):
    start, _ = dry_run(tmp_path, "serve.sh", *VM)
    assert "--worker=0" in start and "--distributed" not in remote(start)
    [stop] = dry_run(tmp_path, "serve.sh", *VM, "--stop")
    assert "kill" in remote(stop)


def test_bench_runs_bench_serve_on_worker_0_and_copies_the_report_back(tmp_path):
    bench, mkdir, scp = dry_run(tmp_path, "bench.sh", *VM, "--out", "res", "--",
                                "--num-prompts", "32", "--max-concurrency", "8")
    assert shlex.split(remote(bench)) == [
        "python3", "-m", "jaxserve.entrypoints.cli", "bench", "serve", "--address", "127.0.0.1:50051",
        "--json", "~/jaxserve-bench-v5litepod-8.json", "--num-prompts", "32",
        "--max-concurrency", "8"]
    assert mkdir == ["mkdir", "-p", "res"]
    assert scp[4:7] == ["scp", "t1:jaxserve-bench-v5litepod-8.json", "res/"]


def test_delete_is_unprompted(tmp_path):
    [delete] = dry_run(tmp_path, "delete_vm.sh", *VM)
    assert delete == ["gcloud", "compute", "tpus", "tpu-vm", "delete", "t1", "--quiet", *WHERE]


def test_run_all_sequences_every_step_and_deletes_the_vm_last(tmp_path):
    commands = dry_run(tmp_path, "run_all.sh", *VM, "--from", "gs://b/m", "--convert",
                       "--tensor-parallel-size", "8", "--", "--num-prompts", "16")
    steps = [c[4] if c[0] == "gcloud" else c[0] for c in commands]
    assert steps == ["create", "git", "scp", "ssh", "ssh", "ssh", "ssh", "ssh", "ssh", "mkdir",
                     "scp", "delete"], steps
    assert "--model models/m-jaxserve" in remote(commands[6])
    assert all(WHERE[0] in c for c in commands if c[0] == "gcloud")


def test_unknown_flag_is_an_error(tmp_path):
    proc = subprocess.run([str(TPU / "create_vm.sh"), "--bogus"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown flag: --bogus" in proc.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None,
                    reason="shellcheck is not installed (apt-get install -y shellcheck)")
def test_shellcheck_is_clean():
    proc = subprocess.run(["shellcheck", "-x", *map(str, SCRIPTS)], capture_output=True,
                          text=True, cwd=TPU)
    assert proc.returncode == 0, proc.stdout + proc.stderr
