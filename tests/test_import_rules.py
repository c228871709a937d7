"""The host-side modules (scheduling, page accounting, plans) never import jax, even indirectly."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HOST_SIDE = ["jaxserve.core.scheduler", "jaxserve.core.page_manager", "jaxserve.core.swap_space",
             "jaxserve.core.request", "jaxserve.core.plan", "jaxserve.engine.metrics", "jaxserve.core.batching_policy",
             "jaxserve.model.step_inputs", "jaxserve.engine.info", "jaxserve.engine.outputs",
             "jaxserve.runner.batch", "jaxserve.runner.buckets", "jaxserve.runner.protocol",
             "jaxserve.spec.batch", "jaxserve.spec.policy", "jaxserve.spec.ngram",
             "jaxserve.core.processor_slots", "jaxserve.core.step_rows", "jaxserve.engine.output_processor",
             "jaxserve.core.host_prefix_tier", "jaxserve.core.page_stats", "jaxserve.core.page_invariants",
             "jaxserve.core.intake"]


@pytest.mark.parametrize("module", HOST_SIDE)
def test_module_does_not_import_jax(module):
    code = (f"import sys; import {module}; "
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib')); "
            "assert not heavy, f'imports {heavy[:5]}'")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                            text=True)
    assert result.returncode == 0, f"{module} pulls in jax:\n{result.stderr[-2000:]}"

