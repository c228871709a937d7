"""TPU check in one command and one table: compile sweep of the attention kernels, kernels
against the reference, decode throughput of a random-weight model against the HBM roofline,
greedy agreement with transformers.

    python scripts/tpu_check.py [--plan] [--out DIR] [--allow-cpu] [--bandwidth-gbs 1640]

The same staged check as scripts/gpu_check.py (jaxserve/bench/device_check.py: stages,
budgets, what each records), for the Mosaic TPU kernels: each stage runs in a child process,
so one that fails or overruns its budget becomes a row and the next one runs; the table prints
last and is written to --out (default $OUT) as tpu_check.md / .json, the stages' output in
tpu_check.log. Nothing is downloaded. Exit status: 0 all OK, 1 a check failed, errored or was
cut, 2 no TPU (unless --allow-cpu: every stage on tiny shapes, the kernels in the TPU
interpreter, the sweep lowered for TPU from the CPU: a smoke test, not a measurement).
This script itself imports no jax: only the stages touch the device.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxserve.bench import device_check  # noqa: E402


def main(argv=None) -> int:
    return device_check.main(argv, "tpu", __doc__)


if __name__ == "__main__":
    sys.exit(main())
