"""TPU check, one command and one table: kernel numerics, the default model's greedy tokens
against the CPU float32 oracle, decode tokens/s against the roofline, peak memory, compile time.

    python scripts/tpu_check.py [--bandwidth-gbs 1640] [--decode-counts 1,16,64,256]

The same parts as scripts/gpu_check.py (jaxserve/bench/device_check.py holds what they share):
1. what jaxserve.model.device_select and model/device_defaults.py choose for this chip, and why;
2. the Pallas TPU kernels (paged_attention for decode, ragged_paged_attention for decode rows
   plus prefill chunks) on a realistic batch in bfloat16 against pallas_kernels.reference
   (relative error <= 2e-2, no NaN), each timed beside the reference (median of --iters);
3. the engine's greedy tokens on the default model (bfloat16, the Pallas path) against the same
   prompts through the CPU float32 engine in a child process: the share of oracle tokens
   matched before each prompt's first divergence;
4. decode tokens/s with N requests all decoding (N in --decode-counts) next to the roofline
   bound (weights + KV bytes per step over the chip's nominal bandwidth, from the device table
   or --bandwidth-gbs), with each engine's build time (compiles included);
5. the devices' peak memory in use.
It fits well inside 10 minutes on one chip. Without a TPU it exits with status 2, unless
--allow-cpu: a tiny batch with the kernels in the TPU interpreter, 2 prompts x 8 tokens, decode
at 1 and 4 requests for 4 steps: a smoke test of this script, not a measurement.
Exit status 1 when a kernel or the agreement (below --min-agreement) fails.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from gpu_check import FULL, TINY, make_batch, median_seconds  # noqa: E402
from jaxserve.bench import device_check  # noqa: E402
from jaxserve.engine.memory_profile import device_memory_bytes  # noqa: E402
from jaxserve.model import device_defaults  # noqa: E402
from jaxserve.model.device_select import DeviceDescription, select  # noqa: E402
from jaxserve.model.loader import load_model  # noqa: E402
from pallas_kernels import reference  # noqa: E402
from pallas_kernels.paged_attention import paged_attention  # noqa: E402
from pallas_kernels.ragged_paged_attention import ragged_paged_attention  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidth-gbs", type=float, default=None,
                        help="HBM bandwidth for the roofline, GB/s; default: the chip's from "
                             "jaxserve/model/device_defaults.py")
    parser.add_argument("--iters", type=int, default=20, help="timed runs per kernel")
    parser.add_argument("--decode-counts", default="1,16,64,256",
                        help="request counts of the decode tokens/s rows")
    parser.add_argument("--decode-steps", type=int, default=32, help="decode steps timed")
    parser.add_argument("--agreement-tokens", type=int, default=32,
                        help="greedy tokens per prompt compared with the CPU oracle")
    parser.add_argument("--min-agreement", type=float, default=0.8,
                        help="the agreement rate below which the check fails")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="without a TPU, a reduced run in the TPU interpreter")
    return parser.parse_args(argv)


def kernel_rows(on_tpu: bool, iters: int) -> tuple[list, bool]:
    """(table rows, all correct) for both kernels against the reference."""
    from jax.experimental.pallas import tpu as pltpu

    sizes = FULL if on_tpu else TINY
    decode, ragged, kv_bytes = make_batch(np.random.default_rng(0), **sizes,
                                          dtype=jnp.bfloat16)
    scale = sizes["head_dim"] ** -0.5
    interpret = False if on_tpu else pltpu.InterpretParams()
    cases = (("paged_attention", paged_attention, reference.paged_attention, decode),
             ("ragged_paged_attention", ragged_paged_attention,
              reference.ragged_paged_attention, ragged))
    rows, ok = [], True
    for name, kernel, ref, batch in cases:
        ref = jax.jit(functools.partial(ref, sm_scale=scale))
        fn = jax.jit(functools.partial(kernel, sm_scale=scale, interpret=interpret))
        want = np.asarray(ref(*batch), np.float32)
        got = np.asarray(fn(*batch), np.float32)
        err = float(np.abs(got - want).max() / np.abs(want).max())
        good = not np.isnan(got).any() and err <= 2e-2
        ok &= good
        rows.append((f"{name} vs reference", f"relative error {err:.2e}",
                     "OK" if good else "FAIL"))
        runs = iters if on_tpu else 1
        k_s, r_s = median_seconds(fn, batch, runs), median_seconds(ref, batch, runs)
        rows.append((f"{name} time", f"{k_s * 1e3:.3f} ms (reference {r_s * 1e3:.3f} ms)",
                     f"KV read {kv_bytes / k_s / 1e9:.1f} GB/s"))
    return rows, ok


def main(argv=None) -> int:
    args = parse_args(argv)
    backend = jax.default_backend()
    if backend != "tpu" and not args.allow_cpu:
        print(f"tpu_check: no TPU (JAX backend is {backend!r}); run on a Cloud TPU VM with "
              "jax[tpu], or pass --allow-cpu for an interpreter smoke test", file=sys.stderr)
        return 2
    on_tpu = backend == "tpu"
    device = jax.local_devices()[0]
    description = DeviceDescription.from_device(device)
    chip = device_defaults.chip(description, device_memory_bytes(device))
    print(select().describe())
    bandwidth = args.bandwidth_gbs or chip.bandwidth_gbs
    rows = [("device", f"{description} as {chip.name}",
             f"nominal {bandwidth or '?'} GB/s, {chip.memory_gib or '?'} GiB")]
    started = time.perf_counter()
    kernels, ok = kernel_rows(on_tpu, args.iters)
    rows += kernels
    prompts = device_check.PROMPTS if on_tpu else device_check.PROMPTS[:2]
    max_tokens = args.agreement_tokens if on_tpu else 8
    loaded = load_model("default", progress=False)
    want = device_check.oracle_tokens(prompts, max_tokens)
    got = device_check.greedy_tokens(loaded, prompts, max_tokens, max_num_seqs=8,
                                     max_num_batched_tokens=64, max_model_len=256)
    rate = device_check.agreement(got, want)
    ok &= rate >= args.min_agreement
    rows.append(("greedy tokens vs CPU float32", f"{100 * rate:.1f}% agreement "
                 f"({len(prompts)} prompts x {max_tokens})",
                 "OK" if rate >= args.min_agreement else "FAIL"))
    counts = [int(n) for n in (args.decode_counts if on_tpu else "1,4").split(",")]
    steps = args.decode_steps if on_tpu else 4
    rows += device_check.decode_rows(device_check.decode_rates(loaded, counts, steps,
                                                               bandwidth_gbs=bandwidth))
    peak = device_check.peak_memory_bytes()
    rows.append(("peak device memory", "not reported by this backend" if peak is None
                 else f"{peak / 2**30:.2f} GiB", ""))
    rows.append(("whole check", f"{time.perf_counter() - started:.0f} s", ""))
    print(device_check.table(rows))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
