"""The host-side modules (scheduling, page accounting, plans) never import jax, even indirectly."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
REQUIRED = ["jaxserve.page_manager", "jaxserve.swap_space"]
OPTIONAL = ["jaxserve.scheduler", "jaxserve.request", "jaxserve.plan"]  # skipped until they exist


def _exists(module: str) -> bool:
    return (REPO / (module.replace(".", "/") + ".py")).is_file()


@pytest.mark.parametrize("module", REQUIRED + OPTIONAL)
def test_module_does_not_import_jax(module):
    if not _exists(module):
        if module in REQUIRED:
            pytest.fail(f"{module} must exist")
        pytest.skip(f"{module} does not exist yet")
    code = (f"import sys; import {module}; "
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib')); "
            "assert not heavy, f'imports {heavy[:5]}'")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                            text=True)
    assert result.returncode == 0, f"{module} pulls in jax:\n{result.stderr[-2000:]}"

