"""GPU check in one command and one table, sized for a lent single-GPU machine (no network, ten
minutes a command): compile sweep of the attention kernels, kernels against the reference,
decode throughput of a random-weight model against the HBM roofline, greedy agreement with
transformers.

    python scripts/gpu_check.py [--plan] [--out DIR] [--allow-cpu] [--only sweep,kernels]

The stages, their budgets (at most 540 s together) and what each records are in
jaxserve/bench/device_check.py; each runs in a child process, so one that fails or overruns
its budget becomes a row of the table and the next one runs. The table prints last and is
written to --out (default $OUT) as gpu_check.md and gpu_check.json, with the stages' output
in gpu_check.log. Nothing is downloaded. Exit status: 0 all OK, 1 a check failed, errored or
was cut, 2 no GPU (unless --allow-cpu: every stage on tiny shapes, the kernels in the Mosaic
GPU simulator, the sweep lowered for CUDA from the CPU: a smoke test, not a measurement).
This script itself imports no jax: only the stages touch the device.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxserve.bench import device_check  # noqa: E402
from jaxserve.bench.device_check import decode_rates  # noqa: E402,F401 (tests use it here)
from jaxserve.bench.kernel_stages import kernel_paths  # noqa: E402,F401 (tests use it here)


def main(argv=None) -> int:
    return device_check.main(argv, "gpu", __doc__)


if __name__ == "__main__":
    sys.exit(main())
