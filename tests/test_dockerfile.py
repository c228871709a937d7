"""The Dockerfile builds a CPU image whose `jaxserve` runs (skipped where Docker can't build)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _docker_ready() -> str | None:
    """None when a Docker daemon answers and the base image is here or can be pulled."""
    if shutil.which("docker") is None:
        return "no docker command"
    if subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode != 0:
        return "no Docker daemon"
    base = "python:3.11-slim"
    if subprocess.run(["docker", "image", "inspect", base], capture_output=True).returncode:
        if subprocess.run(["docker", "pull", base], capture_output=True,
                          timeout=600).returncode:
            return f"base image {base} is not here and cannot be pulled"
    return None


def test_cpu_image_builds_and_its_cli_runs():
    reason = _docker_ready()
    if reason:
        pytest.skip(reason)
    tag = "jaxserve-test:cpu"
    built = subprocess.run(["docker", "build", "-t", tag, str(ROOT)], capture_output=True,
                           text=True, timeout=3600)
    assert built.returncode == 0, built.stderr[-4000:]
    ran = subprocess.run(["docker", "run", "--rm", tag, "serve", "--help"], capture_output=True,
                         text=True, timeout=300)
    assert ran.returncode == 0 and "--swap-space" in ran.stdout, ran.stderr[-2000:]


def test_dockerfile_names_every_accelerator_it_documents():
    text = (ROOT / "Dockerfile").read_text()
    for accelerator in ("cpu", "cuda", "tpu"):
        assert f"{accelerator})" in text, f"Dockerfile has no ACCELERATOR={accelerator} branch"
        assert f"ACCELERATOR={accelerator}" in text or accelerator == "cpu", (
            f"the header does not show how to build ACCELERATOR={accelerator}")
