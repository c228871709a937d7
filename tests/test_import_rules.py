"""The host-side modules (scheduling, page accounting, plans) never import jax, even indirectly."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HOST_SIDE = ["jaxserve.scheduler", "jaxserve.page_manager", "jaxserve.swap_space",
             "jaxserve.request", "jaxserve.plan", "jaxserve.metrics", "jaxserve.batching",
             "jaxserve.step_inputs", "jaxserve.engine_info", "jaxserve.outputs",
             "jaxserve.runner.batch", "jaxserve.runner.buckets", "jaxserve.runner.protocol",
             "jaxserve.spec.batch", "jaxserve.spec.policy", "jaxserve.spec.ngram",
             "jaxserve.processor_slots", "jaxserve.step_rows", "jaxserve.output_processor",
             "jaxserve.host_prefix_tier", "jaxserve.page_stats", "jaxserve.page_invariants"]


@pytest.mark.parametrize("module", HOST_SIDE)
def test_module_does_not_import_jax(module):
    code = (f"import sys; import {module}; "
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib')); "
            "assert not heavy, f'imports {heavy[:5]}'")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                            text=True)
    assert result.returncode == 0, f"{module} pulls in jax:\n{result.stderr[-2000:]}"

